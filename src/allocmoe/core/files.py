"""Small file helpers: atomic writes (nothing half-written) and JSON reading with clear errors."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..errors import AllocMoeError



def _read_umask() -> int:
    """The process's umask, read once at import: reading it means setting it, which is not thread-safe
    later (a file another thread made in between would get the wrong permissions)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


UMASK = _read_umask()      # what new files and folders get their permissions from

def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file in the same folder, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:             # mkstemp inside the try: an interrupt right after it still removes the file
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~UMASK)          # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as JSON atomically. JSON has no NaN or infinity: such values are written as null, and
    one warning line names where they were (a perplexity that overflowed, a correlation of constants)."""
    clean, where = json_safe(obj)
    if where:
        shown = ", ".join(where[:5]) + (f" and {len(where) - 5} more" if len(where) > 5 else "")
        print(f"allocmoe: warning: {path}: {shown} not finite (NaN or infinity), written as null", file=sys.stderr)
    atomic_write_bytes(path, (json.dumps(clean, indent=2, allow_nan=False) + "\n").encode("utf-8"))


def json_safe(obj: Any, at: str = "") -> tuple[Any, list[str]]:
    """(`obj` with every non-finite float replaced by None, the dotted paths of those values)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None, [at or "value"]
    if isinstance(obj, dict):
        pairs = [(key, json_safe(value, f"{at}.{key}" if at else str(key))) for key, value in obj.items()]
        return {key: value for key, (value, _) in pairs}, [p for _, (_, found) in pairs for p in found]
    if isinstance(obj, (list, tuple)):
        items = [json_safe(value, f"{at}[{i}]") for i, value in enumerate(obj)]
        return [value for value, _ in items], [p for _, found in items for p in found]
    return obj, []


def existing_file(path: str | os.PathLike, what: str, expected: str, missing_hint: str = "check the path") -> Path:
    """`path` as a Path, refused in one line if it is a folder (`give <expected>`) or does not exist."""
    path = Path(path)
    if path.is_dir():
        raise AllocMoeError(f"{what} {path} is a folder; give {expected}")
    if not path.is_file():
        raise AllocMoeError(f"{what} not found: {path}; {missing_hint}")
    return path


def read_utf8(path: str | os.PathLike, what: str, missing_hint: str = "check the path") -> str:
    """The text of a UTF-8 file the user named (`what`: "prompt file", "text file", ...), or one clear line."""
    path = existing_file(path, what, "a UTF-8 text file", missing_hint)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise AllocMoeError(f"{what} {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Read a JSON file, naming `what` it should be in any error."""
    path = existing_file(path, f"{what} file", f"the {what} JSON file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AllocMoeError(f"{what} file {path} is corrupt or truncated ({exc}); recreate it") from None
