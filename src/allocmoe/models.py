"""Loading models: the built-in model shipped in the package, or a local Hugging Face folder.

Nothing is downloaded: `--model` must be a folder on disk. Remote code stays off unless asked for.
Everything about a folder that can be checked without reading its weights is checked first
(`inspect_model`): config.json is JSON naming a supported architecture, and every safetensors
file's header is whole and covers exactly the file. The model's layout (MoE layer indices, K,
context) then comes from a weightless copy on the meta device (`ModelSpec.skeleton`), so a plan or
profile of another model, a budget or a `--seq-len` is refused before the weights load. That copy
is all a plan needs whose method reads only the config (uniform, ascending, descending, alloc-t):
`inspect_model(folder, require_weights=False)` accepts a folder of config.json alone for them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import AllocMoeError

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BUILTIN_MODEL = BUILTIN_DIR / "model"
BUILTIN = "builtin"
_HEADER_LIMIT = 100 * 2**20           # safetensors' own limit on a header's size


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise AllocMoeError(f"model must be a model folder's path (or None for the built-in model), got "
                            f"{repr(model)[:60]} ({type(model).__name__}); give a local Hugging Face model folder")
    if model in (None, BUILTIN):
        if not (BUILTIN_MODEL / "config.json").is_file():
            raise AllocMoeError(f"the built-in model is missing from {BUILTIN_MODEL}; reinstall allocmoe "
                                "or rebuild it with scripts/train_builtin.py")
        return BUILTIN_MODEL
    path = Path(model)
    if path.is_file():
        raise AllocMoeError(f"model folder {path} is a file; give the folder that holds config.json")
    if not path.is_dir():
        raise AllocMoeError(f"model folder not found: {path}; give a local Hugging Face model folder "
                            "(allocmoe never downloads)")
    if not (path / "config.json").is_file():
        raise AllocMoeError(f"{path} has no config.json, so it is not a Hugging Face model folder; give the "
                            "folder that holds config.json")
    return path


@dataclass
class ModelSpec:
    """A model folder whose config and weight files have been checked, no weights read yet (or a
    synthetic shape's config, whose `path` is its name)."""
    path: Path | str
    config: Any
    trust_remote_code: bool = False
    has_weights: bool = True            # False: config.json alone (inspect_model(require_weights=False))
    _skeleton: Any = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def context(self) -> int | None:
        """Positions the model takes (max_position_embeddings), or None if its config does not say."""
        return getattr(self.config, "max_position_embeddings", None) or None

    def skeleton(self):
        """The model's modules on the meta device: its MoE layout and config, no weights read or held.
        Plans and profiles check against it (`routing.layout.check_plan(plan, spec.skeleton())`) as
        against the model."""
        if self._skeleton is None:
            from transformers import AutoModelForCausalLM

            from .routing.adapters import adapter_for_model

            try:
                with torch.device("meta"):
                    net = AutoModelForCausalLM.from_config(self.config, trust_remote_code=self.trust_remote_code)
            except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError) as exc:
                raise AllocMoeError(f"the config in {self.path} does not describe a model transformers can build "
                                    f"({_first_line(exc)}); fix config.json or give another folder") from None
            adapter_for_model(net)          # refuses a model whose MoE layers cannot be found
            self._skeleton = net
        return self._skeleton

    def fingerprint(self) -> dict[str, Any]:
        """What a plan or profile must match (routing.layout.model_fingerprint), from the config alone."""
        from .routing.layout import model_fingerprint

        return model_fingerprint(self.skeleton())

    def tokenizer(self):
        """The folder's tokenizer (loaded once): texts are cut and checked with it before the weights load."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                raise AllocMoeError(f"cannot load the tokenizer in {self.path} ({_first_line(exc)}); the folder "
                                    "needs the model's tokenizer files (tokenizer.json, tokenizer_config.json)") from None
        return self._tokenizer

    def load(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """(model, tokenizer): the weights read, on `device`."""
        from safetensors import SafetensorError
        from transformers import AutoModelForCausalLM

        target = check_device(device)
        if not self.has_weights:
            raise AllocMoeError(no_weights_message(self.path))
        tokenizer = self.tokenizer()
        try:
            net = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            raise AllocMoeError(f"cannot load the model in {self.path} ({_first_line(exc)}); download or save "
                                "the model again") from None
        return net.to(target).eval(), tokenizer


def inspect_model(model: str | os.PathLike | None = None, trust_remote_code: bool = False, *,
                  require_weights: bool = True) -> ModelSpec:
    """Check a model folder (default: the built-in model) without reading its weights: config.json is a
    JSON object naming a supported architecture that transformers reads, and every weight file is whole.
    A folder with no weight files is refused, unless `require_weights` is False: then its spec has
    `has_weights` False, gives the skeleton and fingerprint from the config, and refuses to load."""
    from transformers import AutoConfig

    from .routing.adapters import adapter_for_config
    from .routing.adapters.registry import adapter_class

    path = resolve_model_path(model)
    config_file = path / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AllocMoeError(f"{config_file} is not JSON ({_first_line(exc)}); restore the model's config.json") from None
    if not isinstance(raw, dict):
        raise AllocMoeError(f"{config_file} is not a JSON object; restore the model's config.json")
    if not isinstance(raw.get("model_type"), str):
        raise AllocMoeError(f"{config_file} names no model_type; restore the model's config.json")
    adapter_class(raw["model_type"])        # an unsupported architecture, before transformers reads anything
    check_top_k(raw, config_file)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise AllocMoeError(f"cannot read the config in {path} ({_first_line(exc)}); fix config.json or give "
                            "another folder") from None
    adapter_for_config(config)
    has_weights = has_weight_files(path)
    if has_weights or require_weights:
        check_weight_files(path)            # refuses a folder with none
    return ModelSpec(path=path, config=config, trust_remote_code=trust_remote_code, has_weights=has_weights)


# config.json's names for the experts each token runs (top-k) and the routed experts per layer, by family
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")


def check_top_k(raw: dict[str, Any], config_file: Path) -> None:
    """Refuse a config whose top-k is not a whole number in 1..its routed experts per layer (0 would
    route nothing, more than the experts cannot be routed): named here, not as a budget problem later."""
    top_key = next((key for key in _TOP_K_KEYS if key in raw), None)
    expert_key = next((key for key in _EXPERT_KEYS if isinstance(raw.get(key), int)
                       and not isinstance(raw.get(key), bool)), None)
    if top_key is None:
        return                          # the family's own default applies; transformers fills it in
    top_k, experts = raw[top_key], raw.get(expert_key) if expert_key else None
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1 or (experts is not None and top_k > experts):
        where = f"1..{experts} ({expert_key} = {experts})" if experts is not None else "1 or more"
        raise AllocMoeError(f"{config_file}: {top_key} = {top_k!r} is outside {where}, the experts each token can "
                            "run; restore the model's config.json")
    if experts is not None and experts < 1:
        raise AllocMoeError(f"{config_file}: {expert_key} = {experts} routed experts; a MoE layer needs at least one; "
                            "restore the model's config.json")


def load_model(model: str | os.PathLike | ModelSpec | None = None, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", trust_remote_code: bool = False):
    """Load (model, tokenizer) from a local folder, or the built-in model when `model` is None.
    Everything checkable is checked before any weights are read (see `inspect_model`)."""
    from .core.config import check_argument

    check_argument("load_model", "trust_remote_code", trust_remote_code, bool)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise AllocMoeError(f"load_model: dtype must be a floating torch dtype (torch.float32, torch.bfloat16, "
                            f"torch.float16), got {dtype!r}; give one of those")
    check_device(device)
    spec = model if isinstance(model, ModelSpec) else inspect_model(model, trust_remote_code)
    return spec.load(dtype=dtype, device=device)


# -- weight files ---------------------------------------------------------------------------------------
_WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def has_weight_files(path: Path) -> bool:
    """Whether the folder names its weights the way transformers reads them (whole or sharded, as
    safetensors or PyTorch pickles): False for a folder of config.json (and a tokenizer) alone."""
    return any((path / name).is_file() for name in _WEIGHT_NAMES)


def no_weights_message(path) -> str:
    return f"{path} has no weights (no model.safetensors); download or save the model again"


def check_weight_files(path: Path) -> None:
    """Refuse a folder with no weights, a shard index naming missing files, or a safetensors file that is
    truncated or corrupt (its header is read, never its tensors)."""
    files = safetensors_files(path)
    if files is None:
        return                              # PyTorch pickles: transformers checks them as it reads them
    for file in files:
        read_safetensors_header(file)


def safetensors_files(path: Path) -> list[Path] | None:
    """The folder's safetensors weight files (one, or the shards its index names); None when it holds
    PyTorch pickles instead. Refuses a folder with no weights, or an index that is corrupt or names
    missing files."""
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
            files = [path / name for name in names]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise AllocMoeError(f"{index} is corrupt ({_first_line(exc)}); download or save the model again") from None
        # `../plan.json`, `/etc/passwd`: never read a file the folder does not hold. Judged by the name, not
        # by resolving links: a Hugging Face cache folder's weight files are links into its blobs folder.
        outside = [name for name in names if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == ".."
                   or os.path.normpath(name) in (".", "")]
        if outside:
            raise AllocMoeError(f"{index} names weight files outside the model folder: "
                                f"{', '.join(map(repr, outside[:3]))}; an index may name only files inside "
                                f"{path}: download or save the model again")
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise AllocMoeError(f"{index} names weight files that are missing: {', '.join(missing[:3])}; "
                                "download or save the model again")
        return files
    if any((path / name).is_file() for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        return None
    raise AllocMoeError(no_weights_message(path))


def read_safetensors_header(file: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data, header) of a safetensors file: {name: {"dtype", "shape", "data_offsets"}}
    with data_offsets counted from that offset. Refuses a header that is not whole or does not
    cover exactly the file."""
    size = file.stat().st_size

    def bad(why: str) -> AllocMoeError:
        return AllocMoeError(f"weight file {file} is truncated or corrupt ({why}); download or save the model again")

    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than a safetensors header")
        length = int.from_bytes(head, "little")
        if length > min(size - 8, _HEADER_LIMIT):
            raise bad(f"its header claims {length} bytes; the file has {size}")
        try:
            header = json.loads(handle.read(length))
            ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, IndexError,
                AttributeError):
            raise bad("its header is not a safetensors header") from None
    need = 8 + length + max(ends, default=0)
    if need != size:
        raise bad(f"its tensors need {need} bytes; the file has {size}")
    header.pop("__metadata__", None)
    return 8 + length, header


# -- devices ----------------------------------------------------------------------------------------------
def check_device(device: str | torch.device | None) -> torch.device:
    """`device` as a torch.device that exists on this machine; refuses an unknown device type, one this
    machine lacks, or an index past its device count (cuda:7 on a machine with one GPU)."""
    if isinstance(device, torch.device):
        dev, text = device, str(device)
    else:
        text = str(device if device is not None else "").strip()
        try:
            dev = torch.device(text)
        except (RuntimeError, ValueError, TypeError):
            raise AllocMoeError(f"device {text!r} is not a device torch knows; give cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise AllocMoeError(f"device {text!r}: the CPU takes no index; give cpu")
        return dev
    if dev.type == "meta":
        raise AllocMoeError("device 'meta' holds no data, so it cannot run a model; give cpu or cuda")
    if dev.type == "mps":
        available, count = torch.backends.mps.is_available(), 1
    else:
        backend = getattr(torch, dev.type, None)
        is_available = getattr(backend, "is_available", None)
        available = bool(is_available()) if callable(is_available) else False
        count = int(backend.device_count()) if available and hasattr(backend, "device_count") else 0
    if not available:
        raise AllocMoeError(f"device {text!r}: no {dev.type} device is available on this machine; give cpu")
    if dev.index is not None and dev.index >= count:
        raise AllocMoeError(f"device {text!r}: this machine has {count} {dev.type} device(s), "
                            f"{dev.type}:0..{dev.type}:{count - 1}; give one of those")
    return dev


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
