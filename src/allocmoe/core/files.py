"""Small file helpers: atomic writes (nothing half-written) and JSON reading with clear errors."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..errors import AllocMoeError



def _read_umask() -> int:
    """The process's umask, read once at import: reading it means setting it, which is not thread-safe
    later (a file another thread made in between would get the wrong permissions)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


UMASK = _read_umask()      # what new files and folders get their permissions from

def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file in the same folder, then rename over `path`. Only a new file or a
    regular file is replaced: a device, FIFO, socket or folder at `path` is refused (as root, renaming
    over /dev/null would replace the device with a file)."""
    with staged_file(path, data):
        pass


@contextmanager
def staged_file(path: str | os.PathLike, data: bytes) -> Iterator[None]:
    """`data` written to a temporary file beside `path` now, renamed over `path` when the block ends
    without an error, removed if it raises. Two files that must change together (a plan and its means
    file): stage one and write the other inside the block, so a failure of the second leaves the first
    as it was (the same checks as atomic_write_bytes)."""
    path = Path(path)
    check_writable_target(path, "output file")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:             # mkstemp inside the try: an interrupt right after it still removes the file
        # the temporary name is short whatever `path` is: a name near the system's 255-byte limit must
        # not fail here, after the work, when the name itself was accepted before it
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())                # the data is on disk before the rename makes it the file
        os.chmod(tmp, 0o666 & ~UMASK)          # mkstemp makes 0600; give the usual permissions
        yield
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


def path_stat(path: str | os.PathLike, what: str, follow: bool = True) -> os.stat_result | None:
    """os.stat of `path` (lstat with follow=False), None if nothing is there; any other failure (a name
    too long, a permission denied, a loop of links, an embedded NUL) as one AllocMoeError line. Only a
    str or os.PathLike is a path: os.stat would read an integer as an open file descriptor."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise AllocMoeError(f"{what} must be a path (str or os.PathLike), got {type(path).__name__}; give a path")
    if str(path) == "":
        raise AllocMoeError(f"{what} is an empty path; give a path")
    try:
        return os.stat(path) if follow else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise AllocMoeError(f"{what} {_shown(path)}: {exc.strerror or exc}; give another path") from None
    except ValueError as exc:                        # an embedded NUL byte
        raise AllocMoeError(f"{what} {_shown(path)!s} is not a valid path ({exc}); give another path") from None


def shown_path(path) -> str:
    """A path for a one-line message: quoted when it holds a newline or other unprintable character
    (the message must stay one line), and cut in the middle when very long (ENAMETOOLONG)."""
    text = str(path)
    text = text if text.isprintable() else repr(text)
    return text if len(text) <= 120 else text[:60] + "..." + text[-40:]


_shown = shown_path


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_writable_target(path: str | os.PathLike, what: str) -> None:
    """Refuse a path that a write would not simply create or replace: anything there that is not a
    regular file (a folder, a device, a FIFO, a socket), or an unusable name."""
    st = path_stat(path, what)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise AllocMoeError(f"{what} {_shown(path)} is {kind_of(st.st_mode)}, not a regular file; give the path "
                            "of a new or regular file")


def existing_file(path: str | os.PathLike, what: str, expected: str, missing_hint: str = "check the path") -> Path:
    """`path` as a Path, refused in one line if it is a folder (`give <expected>`), a device, FIFO or
    socket (never opened: a FIFO would hang the read), or does not exist."""
    st = path_stat(path, what)
    path = Path(path)
    if st is None:
        raise AllocMoeError(f"{what} not found: {_shown(path)}; {missing_hint}")
    if stat.S_ISDIR(st.st_mode):
        raise AllocMoeError(f"{what} {_shown(path)} is a folder; give {expected}")
    if not stat.S_ISREG(st.st_mode):
        raise AllocMoeError(f"{what} {_shown(path)} is {kind_of(st.st_mode)}, not a regular file; give {expected}")
    return path


def read_utf8(path: str | os.PathLike, what: str, missing_hint: str = "check the path") -> str:
    """The text of a UTF-8 file the user named (`what`: "prompt file", "text file", ...), or one clear line."""
    path = existing_file(path, what, "a UTF-8 text file", missing_hint)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise AllocMoeError(f"{what} {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:                           # unreadable: permissions, an I/O error
        raise AllocMoeError(f"{what} {path}: {exc.strerror or exc}; check the file") from None


MAX_JSON_DEPTH = 64          # no allocmoe file nests deeper than a few levels
MAX_JSON_BYTES = 1 << 30     # a plan or profile is kilobytes, an eval result with per-item scores megabytes


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Read a JSON file, naming `what` it should be in any error."""
    path = existing_file(path, f"{what} file", f"the {what} JSON file")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise AllocMoeError(f"{what} file {path} is {path.stat().st_size / 2**30:.1f} GiB, more than any {what} "
                            f"file allocmoe writes (at most 1 GiB); give the right file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AllocMoeError(f"{what} file {path}: {exc.strerror or exc}; check the file") from None
    return loads_strict(data, f"{what} file {path}")


def loads_strict(data: bytes | str, source: str) -> Any:
    """JSON as the standard defines it, or one AllocMoeError naming `source`: UTF-8, no duplicate keys
    (Python would keep the last one silently), no NaN/Infinity and no number too large for a double
    (1e400 would read as infinity), at most MAX_JSON_DEPTH levels of nesting (deeper would exhaust
    the recursion of the reader, or of everything that walks the document after it)."""
    fix = "recreate it"
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return _check_depth(json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant,
                                       parse_float=_finite_float, parse_int=_short_int), source)
    except _Refused as exc:
        raise AllocMoeError(f"{source} is invalid JSON: {exc}; {fix}") from None
    except RecursionError:
        raise AllocMoeError(f"{source} is invalid: nested more than {MAX_JSON_DEPTH} levels deep; {fix}") from None
    except (ValueError, UnicodeDecodeError) as exc:      # JSONDecodeError, or an integer of too many digits
        said = (str(exc).splitlines() or [""])[0][:200]
        raise AllocMoeError(f"{source} is corrupt or truncated ({said}); {fix}") from None


class _Refused(Exception):
    """A JSON document that parses in Python but is not allocmoe's JSON (its message says why)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = {}
    for key, value in pairs:
        if key in result:
            raise _Refused(f"the key {key[:40]!r} appears twice in one object")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is too large for a double")
    return value


def _unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _Refused(f"a string holds a lone surrogate ({text[exc.start]!r}), which is not Unicode text") from None


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > 400:                 # past any double; Python would refuse past 4300 digits
        raise _Refused(f"the number {text[:20]}... has {len(text)} digits, too many for a double")
    return int(text)


def json_depth_problem(obj: Any) -> str | None:
    """Why `obj` (parsed JSON, or a document built in Python) nests too deeply, or None."""
    try:
        _check_depth(obj, "")
    except _Refused as exc:
        return str(exc)
    return None


def _check_depth(obj: Any, source: str) -> Any:
    """`obj` unchanged, or _Refused if it nests deeper than MAX_JSON_DEPTH (iterative: no recursion) or
    holds a string that is not Unicode text (a lone surrogate such as "\\ud800", which JSON's escapes
    allow but no UTF-8 output can print)."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _unicode(item)
        elif isinstance(item, (dict, list, tuple)):
            if isinstance(item, dict):
                for key in item:
                    if isinstance(key, str):
                        _unicode(key)
            if depth > MAX_JSON_DEPTH:
                raise _Refused(f"nested more than {MAX_JSON_DEPTH} levels deep")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return obj
