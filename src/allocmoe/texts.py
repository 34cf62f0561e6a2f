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
    """(text, name): `source` None -> the built-in `default_split`; "builtin:<split>"; or a file path
    to UTF-8 text (refused if empty, or if it is not text: NUL or other control characters)."""
    if not isinstance(source, (str, os.PathLike)) and source is not None:
        raise AllocMoeError(f"read_text: source must be a text file's path, builtin:<split> or None, got "
                            f"{source!r:.60} ({type(source).__name__}); give a path")
    if default_split not in BUILTIN_SPLITS:
        raise AllocMoeError(f"read_text: unknown built-in split {default_split!r}; choose one of "
                            f"{', '.join(BUILTIN_SPLITS)}")
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
    check_text(text, f"text file {path}")
    return text, str(path)


# Control characters a text may hold: tab, newline, vertical tab, form feed, carriage return.
_LAYOUT = frozenset("\t\n\v\f\r")
_CONTROL_SHARE = 0.01       # more than 1% other control characters (or any NUL): binary data, not text


def check_text(text, name: str = "the text") -> str:
    """Refuse what is not text: not a string, empty, or holding NUL characters or more than 1% other
    control characters (a binary file, a NUL-padded file). Returns the text."""
    if not isinstance(text, str):
        raise AllocMoeError(f"{name} must be a string of text, got {text!r:.60} ({type(text).__name__}); give "
                            "the text itself (allocmoe.read_text(PATH, ...) reads a file)")
    if not text.strip():
        raise AllocMoeError(f"{name} is empty; give a text with text in it")
    nul = text.count("\0")
    control = nul or sum(1 for ch in text if ch < " " and ch not in _LAYOUT or ch == "\x7f")
    if nul or control > _CONTROL_SHARE * len(text):
        what = f"{nul} NUL" if nul else f"{control} control"
        raise AllocMoeError(f"{name} is not text: {what} characters among its {len(text)}; give a UTF-8 text "
                            "file (not a binary or NUL-padded one)")
    return text
