"""Which weights a model has: the `weights` field of a profile's model fingerprint.

A profile (and its `.partial.json`, and a sweep's kept rows) must not be reused for a model of the
same shape with other weights (a fine-tune). The shape fingerprint (core/plan.py) cannot tell them
apart, so profiles also record one of two kinds of weights fingerprint:

  * "files:<16 hex>" for a model that has a folder of weight files (a folder given, or a model
    loaded from one: its config's `_name_or_path`, as transformers sets it): the SHA-256 of every
    weight file's bytes (*.safetensors, pytorch_model*.bin), each file's hash computed once and cached
    by (real path, size, modification time) in $XDG_CACHE_HOME/allocmoe/weights.json (default
    ~/.cache/allocmoe); a cache that cannot be read or written is only a slower run. Changing a
    loaded model in memory afterwards is not seen: save it, or build it without a folder.
  * "tensors:<16 hex>" for a model in memory with no weight files: the SHA-256 of every state_dict
    tensor's name, dtype, shape and full bytes (exact, one pass over the weights; remembered on the
    model until a tensor is replaced or changed in place).

The two kinds are not comparable (a file's bytes are not the tensors' in memory: transformers
renames and fuses tensors while loading), so a check only compares fingerprints of the same kind.
A model with no weights yet (the meta-device skeleton) and no folder has none (None).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
CHUNK = 16 * 2**20


def cache_file() -> Path:
    """Where file hashes are kept: $XDG_CACHE_HOME/allocmoe/weights.json, or ~/.cache/allocmoe/."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "allocmoe" / "weights.json"


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files of a model folder, sorted; [] if it is not a folder or has none."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted({path for pattern in WEIGHT_PATTERNS for path in folder.glob(pattern) if path.is_file()})


def _read_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, cache: dict[str, str]) -> None:
    from .files import atomic_write_json

    try:
        atomic_write_json(path, dict(sorted(cache.items())))
    except OSError:                        # a read-only home: hash again next time
        pass


def file_sha256(path: Path, cache: dict[str, str]) -> tuple[str, bool]:
    """(SHA-256 of a file's bytes, whether it was computed now) using `cache`, keyed by the file's
    real path, size and modification time, so a file replaced or rewritten is hashed again."""
    stat = path.stat()
    key = f"{os.path.realpath(path)}|{stat.st_size}|{stat.st_mtime_ns}"
    if key in cache:
        return cache[key], False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    cache[key] = digest.hexdigest()
    return cache[key], True


def folder_weights(folder: str | os.PathLike) -> str | None:
    """"files:<16 hex>" for the weight files of `folder` (names and contents); None if it has none."""
    files = weight_files(folder)
    if not files:
        return None
    where = cache_file()
    cache = _read_cache(where)
    combined, computed = hashlib.sha256(), False
    for path in files:
        digest, now = file_sha256(path, cache)
        computed |= now
        combined.update(f"{path.name}\0{digest}\n".encode())
    if computed:
        _write_cache(where, cache)
    return "files:" + combined.hexdigest()[:16]


def tensors_weights(model: torch.nn.Module) -> str | None:
    """"tensors:<16 hex>" for the state_dict of a model in memory; None if any tensor has no data
    (the meta device). Remembered on the model while every tensor is the same object at the same
    version (an in-place change bumps the version and is hashed again)."""
    state = model.state_dict(keep_vars=True)
    if any(t.device.type == "meta" for t in state.values()):
        return None
    stamp = tuple((name, id(t), t._version) for name, t in state.items())
    memo = getattr(model, "_allocmoe_weights", None)
    if memo is not None and memo[0] == stamp:
        return memo[1]
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\n".encode())
        data = tensor.cpu().contiguous().reshape(-1)
        if data.numel():
            digest.update(data.view(torch.uint8).numpy().tobytes())
    value = "tensors:" + digest.hexdigest()[:16]
    try:
        object.__setattr__(model, "_allocmoe_weights", (stamp, value))
    except (AttributeError, TypeError):
        pass
    return value


def weights_fingerprint(model: Any) -> str | None:
    """The weights fingerprint of a model folder (a path, or a ModelSpec: anything with `.path`) or of
    a model object (its folder's files if its config names one that has weight files, else its
    tensors); None when neither is there (a meta-device model without a folder)."""
    if isinstance(model, (str, os.PathLike)):
        return folder_weights(model)
    if not isinstance(model, torch.nn.Module) and hasattr(model, "path"):
        return folder_weights(model.path)
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if source and weight_files(source):
        return folder_weights(source)
    return tensors_weights(model)


def same_weights(found: str | None, expected: str | None) -> bool | None:
    """True or False when both fingerprints are there and of one kind; None when they cannot be
    compared (one missing, an old file without it, or files against tensors)."""
    if not found or not expected or found.split(":", 1)[0] != expected.split(":", 1)[0]:
        return None
    return found == expected
