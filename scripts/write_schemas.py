"""Write docs/schemas/{plan,profile}.schema.json from the typed documents in allocmoe.core.formats.

Run after changing a format; tests/test_formats.py fails while the published schemas are stale.
"""

import json
from pathlib import Path

from allocmoe.core.formats import json_schemas

OUT = Path(__file__).resolve().parent.parent / "docs" / "schemas"


def render() -> dict[str, str]:
    return {f"{name}.schema.json": json.dumps(schema, indent=2) + "\n" for name, schema in json_schemas().items()}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
