"""Where a command may write: the one check every `--output` (and the Python API's `output=`) passes
before any work, so that an output never destroys one of the command's inputs, a device, FIFO or
socket, or the built-in files, and never fails at the end for a reason known at the start.

Not for writing itself: `core/files.py` writes atomically and refuses a non-regular target too.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ..errors import AllocMoeError
from .files import kind_of, path_stat, shown_path

BUILTIN_FILES = Path(__file__).resolve().parent.parent / "builtin"    # the built-in model, texts and tasks
Inputs = "dict[str, str | None] | list[tuple[str, str | None]]"


def check_output_file(path: str | None, flag: str = "--output", inputs: Inputs = (), writes: tuple = ()) -> None:
    """Refuse, before any work, an output file that could not be written at the end, or that would
    destroy something: an empty path or one the system cannot take (too long), an existing folder,
    device, FIFO or socket (only an absent or regular file is ever replaced), a read-only file or
    folder, a folder that does not exist, and any of the command's `inputs` (flag -> path; a plan's
    means file counts, see `plan_inputs`), through any link or hard link. `writes` are the other
    files the command writes beside it (a plan's means file, a `.partial.json`), checked the same way."""
    if path is None:
        return
    if str(path).endswith(("/", os.sep)):
        raise AllocMoeError(f"{flag} {shown_path(path)} ends with a slash, a folder; give a file path")
    _check_output_path(path, f"{flag} {shown_path(path)}", inputs)
    for other in writes:
        _check_output_path(other, f"{flag} {shown_path(path)} also writes {shown_path(other)}, which", inputs)


def check_output_dir(path: str | None, flag: str = "--output", inputs: Inputs = (), names: tuple = ()) -> None:
    """Refuse, before any work, an output folder that is a file (or a device, FIFO, socket) or lies
    under one, an empty path, an input folder (--model), or one whose files `names` (what the command
    writes into it) would replace one of the command's `inputs` or are not regular files."""
    if path is None:
        return
    st = path_stat(path, flag)
    target, said = Path(path), f"{flag} {shown_path(path)}"
    if len(os.fsencode(target.name)) > 200:     # its files are first written to a hidden temporary folder beside it
        raise AllocMoeError(f"{said}: the folder name is {len(os.fsencode(target.name))} bytes long, more than the "
                            "200 allocmoe can write beside; give a shorter name")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        kind = "a file" if stat.S_ISREG(st.st_mode) else kind_of(st.st_mode)
        raise AllocMoeError(f"{said} is {kind}; give a folder path")
    refuse_under_a_file(target, said)
    for name, given in [*_pairs(inputs), ("allocmoe's built-in files", str(BUILTIN_FILES))]:
        if given and os.path.isdir(given) and _same(target, given):
            raise AllocMoeError(f"{said} is also an input folder ({name} {shown_path(given)}); give another folder")
    if st is not None:
        _check_folder_writable(target, said)
        for name in names:
            _check_output_path(str(target / name), f"{said} would replace {name} in it, which", inputs)


def plan_inputs(flag: str, plan: str | None) -> list[tuple[str, str | None]]:
    """A plan input and its means file (named in the plan, else the default name beside it), so an
    output can be refused for either; read only if the plan is a regular file, errors left for loading."""
    if not plan or plan.startswith("builtin:"):
        return [(flag, plan)]
    from .means import sidecar_name

    found = [(flag, plan), (f"{flag}'s means file", str(Path(plan).parent / sidecar_name(plan)))]
    try:
        if os.path.isfile(plan) and os.path.getsize(plan) < 1 << 20:
            with open(plan, "rb") as f:
                named = json.loads(f.read()).get("substitute", {}).get("means_file")
            if isinstance(named, str) and named and "/" not in named and "\\" not in named:
                found.append((f"{flag}'s means file", str(Path(plan).parent / named)))
    except Exception:                  # any problem with the plan is the loader's to report, in its words
        pass
    return found


def _pairs(inputs: Inputs) -> list[tuple[str, str | None]]:
    return list(inputs.items()) if isinstance(inputs, dict) else list(inputs)


def _same(a, b) -> bool:
    """Whether two paths name one file: the same inode (hard links, links, bind mounts) or, for a path
    that does not exist yet, the same resolved path."""
    try:
        if os.path.samefile(a, b):
            return True
    except (OSError, ValueError):
        pass
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


def _check_output_path(path: str, said: str, inputs: Inputs) -> None:
    """`said` begins every refusal: "--output X" (then "is ..."), or what names the file in question."""
    st = path_stat(path, said.split(" ", 1)[0])
    target = Path(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise AllocMoeError(f"{said} is a folder; give a file path")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise AllocMoeError(f"{said} is {kind_of(st.st_mode)}, not a regular file; give the path of a new or "
                            "regular file")
    for name, given in [*_pairs(inputs), ("allocmoe's built-in files", str(BUILTIN_FILES))]:
        if not given or str(given).startswith(("builtin:", "synthetic:")):
            continue
        if _same(path, given):
            raise AllocMoeError(f"{said} is also an input ({name} {shown_path(given)}): writing it would destroy "
                                "the input; give another output path")
        if st is not None and os.path.isdir(given) and _inside(path, given):
            raise AllocMoeError(f"{said} is a file inside an input folder ({name} {shown_path(given)}): writing "
                                "it would change the input; give a path outside it")
    refuse_under_a_file(target, said)
    if path_stat(target.parent, said.split(" ", 1)[0]) is None:
        raise AllocMoeError(f"{said}: the folder {shown_path(target.parent)} does not exist; create it or choose "
                            "another path")
    _check_folder_writable(target.parent, said)
    if st is not None and not os.access(path, os.W_OK):
        raise AllocMoeError(f"{said} is read-only; make it writable or choose another path")


def _inside(path, folder) -> bool:
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    except (OSError, ValueError):
        return False


def _check_folder_writable(folder: Path, said: str) -> None:
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AllocMoeError(f"{said}: the folder {shown_path(folder)} is not writable; choose another path")


def refuse_under_a_file(target: Path, said: str) -> None:
    """The nearest existing folder above `target` must be a folder, not a regular file."""
    parent = next((p for p in target.parents if _exists(p)), None)
    if parent is not None and not parent.is_dir():
        raise AllocMoeError(f"{said} lies under {shown_path(parent)}, which is a file; choose another path")


def _exists(path: Path) -> bool:
    try:
        os.stat(path)
        return True
    except (OSError, ValueError):
        return False
