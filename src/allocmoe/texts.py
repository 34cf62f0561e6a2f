"""Text sources: the built-in splits shipped with the package, or any UTF-8 file.

Built-in splits (see builtin/README.md for provenance): "train", "calibration", "test"; disjoint by
document. Calibration text is for profiling and threshold calibration; test text for evaluation.
"""

from __future__ import annotations

import lzma
import os
from pathlib import Path

from .core.files import read_utf8
from .errors import AllocMoeError

BUILTIN_DATA = Path(__file__).resolve().parent / "builtin" / "data"
# The offline lm-eval suite built from the test split by scripts/build_tasks.py. Named here, in a
# module that imports nothing heavy, so the CLI's help can list them without loading lm-eval.
BUILTIN_TASKS = Path(__file__).resolve().parent / "builtin" / "tasks"
OFFLINE_TASKS = ("allocmoe_lastword", "allocmoe_cloze", "allocmoe_style", "allocmoe_nextword")
BUILTIN_SPLITS = ("train", "calibration", "test")


def read_text(source: str | os.PathLike | None, default_split: str) -> tuple[str, str]:
    """(text, name): `source` None -> the built-in `default_split`; "builtin:<split>"; or a file path."""
    if source is None or str(source).startswith("builtin:"):
        split = default_split if source is None else str(source).split(":", 1)[1]
        if split not in BUILTIN_SPLITS:
            raise AllocMoeError(f"unknown built-in split {split!r}; choose one of "
                                f"{', '.join('builtin:' + s for s in BUILTIN_SPLITS)}")
        path = BUILTIN_DATA / f"{split}.txt.xz"
        if not path.is_file():
            raise AllocMoeError(f"built-in text {path} is missing; rebuild it with scripts/prepare_data.py")
        return lzma.open(path, "rt", encoding="utf-8").read(), f"builtin:{split}"
    path = Path(source)
    text = read_utf8(path, "text file", f"check the path (or give builtin:{default_split} for the built-in "
                                        f"{default_split} text)")
    if not text.strip():
        raise AllocMoeError(f"text file {path} is empty; give a file with text in it")
    return text, str(path)
