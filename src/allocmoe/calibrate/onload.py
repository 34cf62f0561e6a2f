"""A model's weights a piece at a time: its modules built without weights, then one piece (a decoder
layer, the input embedding, the output head) read from the safetensors files, used and freed, so a
model larger than memory can run layer by layer. Every read is counted.

The pieces are named as the model names its parameters, whatever the checkpoint calls them:
transformers' own conversion table (the one `from_pretrained` applies: checkpoint experts stacked
into one tensor, renamed keys) turns each piece's checkpoint tensors into the model's, so the
weights a piece gets are exactly the ones `from_pretrained` would give it. Tensors are read with
plain file reads, not mapped, so what is resident is what is loaded. A tied output head is read
from the tensor it shares (the embedding's).

Not here: what runs while a piece is loaded (calibrate/walk.py), or loading a model that fits
(models.py).
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import AllocMoeError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
           "F8_E5M2": getattr(torch, "float8_e5m2", None)}
EMBEDDING, HEAD, RESIDENT = "embedding", "head", "resident"   # the pieces besides the decoder layers


class StoredTensor:
    """One checkpoint tensor, read from its file when indexed (`tensor[...]`, as transformers'
    loader asks for it) with a plain read into fresh memory."""

    def __init__(self, file: os.PathLike, data_start: int, entry: dict[str, Any]):
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise AllocMoeError(f"{file} stores a tensor of type {entry['dtype']}, which allocmoe cannot read "
                                "layer by layer; profile without --max-memory")
        begin, end = (int(x) for x in entry["data_offsets"])
        self.file, self.dtype, self.shape = file, dtype, tuple(int(n) for n in entry["shape"])
        self.offset, self.nbytes = data_start + begin, end - begin

    def __getitem__(self, item) -> torch.Tensor:
        if item is not Ellipsis:
            raise TypeError("a stored tensor is read whole: index it with [...]")
        data = torch.empty(self.nbytes, dtype=torch.uint8)
        with open(self.file, "rb", buffering=0) as handle:
            handle.seek(self.offset)
            view, done = memoryview(data.numpy()), 0
            while done < self.nbytes:
                got = handle.readinto(view[done:])
                if not got:
                    raise AllocMoeError(f"weight file {self.file} ended early; download or save the model again")
                done += got
        return data.view(self.dtype).reshape(self.shape)


@dataclass
class Piece:
    """Parameters that are loaded and freed together."""
    name: str                                  # "embedding", "head", "resident", or "layer N"
    params: list[str]                          # the model's parameter (and persistent buffer) names
    nbytes: int                                # the parameters' bytes, in the model's dtype
    load_extra: int = 0                        # most bytes held beside the piece's own while it loads (see _load_extra)

    @property
    def load_peak(self) -> int:
        """Bytes resident while the piece loads."""
        return self.nbytes + self.load_extra


class OnloadedModel:
    """A model whose parameters stay on the meta device (its buffers, such as rotary tables, are real)
    until a piece is loaded: `with model.loaded("layer 3"):` reads that decoder layer, and frees it on exit.

    `reads` counts how often each piece was read, `bytes_read` the checkpoint bytes read."""

    def __init__(self, spec, dtype: torch.dtype = torch.float32):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        from ..models import read_safetensors_header, safetensors_files
        from .prefix import PrefixCacheUnsupported, decoder_layers

        files = safetensors_files(spec.path)
        if files is None:
            raise AllocMoeError(f"{spec.path} holds PyTorch pickles (pytorch_model.bin); --max-memory reads "
                                "safetensors: save the model with save_pretrained (safetensors) and profile that")
        self.path, self.dtype = spec.path, dtype
        self.model = _weightless(spec, dtype)
        try:
            self.layers = decoder_layers(self.model)
        except PrefixCacheUnsupported as exc:
            raise AllocMoeError(f"{exc}, so it cannot be profiled layer by layer; profile without "
                                "--max-memory") from None
        self._placeholders = {name: tensor for name, tensor in _weights(self.model)}

        self._stored: dict[str, StoredTensor] = {}
        for file in files:
            data_start, header = read_safetensors_header(file)
            for key, entry in header.items():
                self._stored[key] = StoredTensor(file, data_start, entry)
        mapping = get_model_conversion_mapping(self.model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self._mapping = mapping
        targets: dict[str, list[str]] = {}          # model name -> checkpoint keys that make it
        self._target_of: dict[str, str] = {}        # checkpoint key -> the model name it makes
        converted: set[str] = set()
        for key in self._stored:
            target, pattern = rename_source_key(key, renamings, converters, self.model.base_model_prefix,
                                                self._placeholders)
            if target not in self._placeholders and key in self._placeholders:
                target, pattern = key, None
            if target in self._placeholders:
                self._target_of[key] = target
                targets.setdefault(target, []).append(key)
                if pattern is not None:
                    converted.add(target)
        ties = _tied(self.model)
        self._ties = {tied: source for tied, source in ties.items() if tied not in targets and source in targets}
        missing = [name for name in self._placeholders if name not in targets and name not in self._ties]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise AllocMoeError(f"the weights in {spec.path} lack {missing[0]}{more}, which the model needs; profile "
                                "without --max-memory, or save the model again")
        self._sources = targets
        self.pieces = self._pieces(targets, converted)
        self.reads = {name: 0 for name in self.pieces}
        self.bytes_read = 0

    def _pieces(self, targets: dict[str, list[str]], converted: set[str]) -> dict[str, Piece]:
        prefix = next(name for name, module in self.model.named_modules() if module is self.layers) + "."
        embedding = _module_name(self.model, self.model.get_input_embeddings())
        head = _module_name(self.model, self.model.get_output_embeddings())

        def piece_of(name: str) -> str:
            if name.startswith(prefix):
                return f"layer {int(name[len(prefix):].split('.')[0])}"
            if embedding is not None and name.startswith(embedding + "."):
                return EMBEDDING
            if head is not None and name.startswith(head + "."):
                return HEAD
            return RESIDENT

        pieces = {name: Piece(name, [], 0) for name in
                  [EMBEDDING] + [f"layer {j}" for j in range(len(self.layers))] + [HEAD, RESIDENT]}
        for name, tensor in self._placeholders.items():
            piece = pieces[piece_of(name)]
            size = tensor.numel() * tensor.element_size()
            piece.params.append(name)
            piece.nbytes += size
            piece.load_extra = max(piece.load_extra, self._load_extra(name, tensor, converted))
        return pieces

    def _load_extra(self, name: str, placeholder: torch.Tensor, converted: set[str]) -> int:
        """Bytes held beside the loaded ones while this tensor is made: a converted tensor is built
        from its parts, stacked and joined (its size twice for a moment); a tensor stored in another
        dtype is read before it is cast."""
        size = placeholder.numel() * placeholder.element_size()
        if name in converted:
            return size
        stored = [self._stored[key] for key in self._sources.get(name, [])]
        return sum(s.nbytes for s in stored if s.dtype != placeholder.dtype)

    @contextmanager
    def loaded(self, *names: str) -> Iterator[None]:
        """The named pieces' weights are real inside, meta again (and their memory freed) after."""
        try:
            for name in names:
                self._load(self.pieces[name])
            yield
        finally:
            for name in names:
                self.free(name)

    def load(self, name: str) -> None:
        """Read a piece and keep it (the small `resident` piece, or every piece of a model that fits)."""
        self._load(self.pieces[name])

    def _load(self, piece: Piece) -> None:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging as hf_logging

        if not piece.params:
            return
        shared = {tied: self._ties[tied] for tied in piece.params if tied in self._ties}
        already = {source for source in shared.values() if not _get(self.model, source).is_meta}
        keys = [key for name in piece.params if name not in shared or shared[name] not in already
                for key in self._sources[shared.get(name, name)]]
        sources = {key: self._stored[key] for key in dict.fromkeys(keys)}
        config = LoadStateDictConfig(dtype=self.dtype, device_map={"": "cpu"}, weight_mapping=self._mapping)
        bars_were_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()             # transformers' "Loading weights" bar, once per piece
        saved_async = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
        os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # read tensor by tensor as they are converted, not ahead
        mismatched, errors = set(), {}
        try:
            with mapped_allocations():
                for group in self._by_target(sources):   # one tensor at a time, freed memory returned between
                    info, _ = convert_and_load_state_dict_in_model(self.model, group, config)
                    mismatched |= info.mismatched_keys
                    errors.update(info.conversion_errors)
                    release_freed_memory()
        finally:
            if saved_async is None:
                os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
            else:
                os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = saved_async
            if bars_were_on:
                hf_logging.enable_progress_bar()
        for tied, source in shared.items():         # a tied head shares the embedding's tensor, as when loaded whole
            _set(self.model, tied, _get(self.model, source))
            if source not in already and source not in piece.params:      # read for the head only:
                _set(self.model, source, self._placeholders[source])      # the embedding stays unloaded
        still = [name for name in piece.params if _get(self.model, name).is_meta]
        if still or mismatched or errors:
            self.free(piece.name)
            why = (f"{still[0]} was not in them" if still else f"{sorted(mismatched)[0][0]} has another shape"
                   if mismatched else next(iter(errors.values())).splitlines()[0])
            raise AllocMoeError(f"cannot read the {piece.name} weights from {self.path} ({why}); "
                                "profile without --max-memory, or save the model again")
        self.reads[piece.name] += bool(sources)      # a tied head whose embedding is loaded reads nothing
        self.bytes_read += sum(stored.nbytes for stored in sources.values())

    def _by_target(self, sources: dict[str, StoredTensor]) -> list[dict[str, StoredTensor]]:
        """The checkpoint tensors grouped by the model tensor they make (a converted one has several)."""
        groups: dict[str, dict[str, StoredTensor]] = {}
        for key, stored in sources.items():
            groups.setdefault(self._target_of[key], {})[key] = stored
        return list(groups.values())

    def release(self) -> None:
        """Free every piece."""
        for name in self.pieces:
            self.free(name)

    def free(self, name: str) -> None:
        """Put a piece's weights back on the meta device, and hand the freed memory back to the system."""
        for param in self.pieces[name].params:
            _set(self.model, param, self._placeholders[param])
        release_freed_memory()


# -- building the model without its weights ----------------------------------------------------------------
def _weightless(spec, dtype: torch.dtype) -> nn.Module:
    """The model's modules with every parameter on the meta device and every buffer computed as its
    constructor computes it (rotary tables); nothing initialised, nothing tied."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from ..routing.adapters import adapter_for_model

    real = nn.Module.register_parameter

    def on_meta(module, name, param):
        real(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(spec.config, dtype=dtype,
                                                     trust_remote_code=spec.trust_remote_code)
    finally:
        nn.Module.register_parameter = real
    adapter_for_model(model)
    return model.eval()


def _tied(model: nn.Module) -> dict[str, str]:
    """Tied parameter name -> the name it shares (transformers' table; else a tied output head)."""
    table = getattr(model, "all_tied_weights_keys", None)
    if table is not None:
        return dict(table)
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and inputs is not None and outputs is not None:
        return {_module_name(model, outputs) + ".weight": _module_name(model, inputs) + ".weight"}
    return {}


def _weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (each name, ties included) and persistent buffers: what a checkpoint holds."""
    seen = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        seen.add(name)
        yield name, param
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            full = f"{module_name}.{name}" if module_name else name
            if buffer is not None and name not in module._non_persistent_buffers_set and full not in seen:
                yield full, buffer


def _module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    if target is None:
        return None
    return next((name for name, module in model.named_modules() if module is target), None)


def _get(model: nn.Module, name: str) -> torch.Tensor:
    module, _, attr = name.rpartition(".")
    owner = model.get_submodule(module) if module else model
    return owner._parameters[attr] if attr in owner._parameters else owner._buffers[attr]


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module, _, attr = name.rpartition(".")
    owner = model.get_submodule(module) if module else model
    if attr in owner._parameters:
        owner._parameters[attr] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attr] = value


# -- resident memory that follows what is held ------------------------------------------------------------
_M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:             # not glibc: nothing to tune
        return None


@contextmanager
def mapped_allocations() -> Iterator[None]:
    """Inside, glibc maps every allocation of 128 KiB or more on its own, so a weight freed later leaves
    resident memory at once; after, blocks under 32 MiB come from the heap again, as glibc's default
    lets them (a fixed M_MMAP_THRESHOLD both times). glibc's own rule raises the threshold to the
    largest block freed so far, after which a layer's tensors come from the heap and their freed pages
    stay resident: 30% over a layer's weights on the test model. Mapping every block all the time
    would cost the passes about as much time in page faults. Elsewhere than glibc, nothing changes."""
    libc = _libc()
    tune = libc is not None and hasattr(libc, "mallopt")
    if tune:
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    try:
        yield
    finally:
        if tune:
            libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)


def release_freed_memory() -> None:
    """Ask glibc to return freed heap pages to the system (elsewhere a no-op), so the process's
    resident memory follows what is held rather than the most it ever held."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
