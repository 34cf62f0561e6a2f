"""Loading models: the built-in model shipped in the package, or a local Hugging Face folder.

Nothing is downloaded: `--model` must be a folder on disk. Remote code stays off unless asked for.
The architecture is checked against the adapter registry before any weights are read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import AllocMoeError

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BUILTIN_MODEL = BUILTIN_DIR / "model"
BUILTIN = "builtin"


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    if model in (None, BUILTIN):
        if not (BUILTIN_MODEL / "config.json").is_file():
            raise AllocMoeError(f"the built-in model is missing from {BUILTIN_MODEL}; reinstall allocmoe "
                                "or rebuild it with scripts/train_builtin.py")
        return BUILTIN_MODEL
    path = Path(model)
    if not path.is_dir():
        raise AllocMoeError(f"model folder not found: {path} (give a local Hugging Face model folder; "
                            "allocmoe never downloads)")
    if not (path / "config.json").is_file():
        raise AllocMoeError(f"{path} has no config.json: it is not a Hugging Face model folder")
    return path


def load_model(model: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
               device: str = "cpu", trust_remote_code: bool = False):
    """Load (model, tokenizer) from a local folder, or the built-in model when `model` is None."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .routing.adapters import adapter_for_config

    path = resolve_model_path(model)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError) as exc:
        raise AllocMoeError(f"cannot read the config in {path}: {str(exc).splitlines()[0]}") from None
    adapter_for_config(config)      # refuse unsupported architectures before reading weights
    try:
        net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, RuntimeError) as exc:
        raise AllocMoeError(f"cannot load the model in {path}: {str(exc).splitlines()[0]}") from None
    return net.to(device).eval(), tokenizer
