"""Expert means: what a plan's substitute adds back for the experts its budget skips.

A plan made with `substitute` carries, per MoE layer, each routed expert's mean output over the
calibration tokens whose top-K_orig held it, measured on the unmodified model (MoNE, arXiv
2507.00390; calibrate/means.py measures them, routing/apply.py adds them). That is E x H numbers
per layer: too many for JSON, so they live in a safetensors file beside the plan, and the plan names
it and records its SHA-256. Loading reads tensors only (safetensors never executes anything), and
refuses a file whose hash, layers or shapes do not match the plan.

File shape: one float32 tensor per MoE layer, named `layer.<decoder layer index>`, shape [E, H];
metadata {"format": "allocmoe-expert-means", "tokens": "<calibration tokens measured>"}.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import AllocMoeError
from .files import atomic_write_bytes, existing_file

FORMAT = "allocmoe-expert-means"
SUFFIX = ".means.safetensors"


@dataclass
class ExpertMeans:
    means: dict[int, torch.Tensor]     # decoder-layer index -> [E, H] float32, each expert's mean output
    tokens: int                        # calibration tokens the means were measured on

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors = {f"layer.{index}": t.detach().float().cpu().contiguous() for index, t in sorted(self.means.items())}
        return save(tensors, metadata={"format": FORMAT, "tokens": str(self.tokens)})

    def check_shape(self, layers: list[int], num_experts: int, hidden: int | None, what: str) -> None:
        """Refuse means that do not fit a model: other layers, another expert count or hidden size."""
        if sorted(self.means) != sorted(layers):
            raise AllocMoeError(f"{what} holds means for layers {sorted(self.means)} but the model's MoE layers are "
                                f"{sorted(layers)}; recreate the plan with `allocmoe allocate --substitute`")
        for index, t in self.means.items():
            want = (num_experts, hidden if hidden is not None else t.shape[-1])
            if tuple(t.shape) != want:
                raise AllocMoeError(f"{what}: layer {index}'s means have shape {tuple(t.shape)}, the model needs "
                                    f"{want} (experts x hidden size); recreate the plan for this model")


def sidecar_name(plan_path: str | Path) -> str:
    """The means file written beside plan `dir/name.json`: `name.means.safetensors`."""
    name = Path(plan_path).name
    return (name[:-5] if name.endswith(".json") else name) + SUFFIX


def write_means(means: ExpertMeans, path: Path) -> str:
    """Write the means file atomically; returns its SHA-256 (hex) for the plan to record."""
    data = means.to_bytes()
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def read_means(path: Path, sha256: str, what: str) -> ExpertMeans:
    """Read a means file a plan names, checking its hash first; one clear line on any problem."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    fix = "keep the means file beside its plan, or recreate the plan with `allocmoe allocate --substitute`"
    path = existing_file(path, f"{what}'s means file", "the .means.safetensors file", fix)
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise AllocMoeError(f"{what}'s means file {path} does not match the hash the plan records (changed or "
                            f"replaced since the plan was written); {fix}")
    try:
        tensors = load(data)
    except (SafetensorError, ValueError) as exc:        # unreachable with a matching hash, unless written so
        raise AllocMoeError(f"{what}'s means file {path} is not a safetensors file ({exc}); {fix}") from None
    means = {}
    for name, t in tensors.items():
        index = name.removeprefix("layer.")
        if not index.isdigit() or t.dim() != 2 or t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
            raise AllocMoeError(f"{what}'s means file {path} holds {name!r} {tuple(t.shape)} {t.dtype}, not a finite "
                                f"float32 [experts, hidden] tensor named layer.<index>; {fix}")
        means[int(index)] = t
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    tokens = meta.get("tokens", "")
    if meta.get("format") != FORMAT or not tokens.isdigit():
        raise AllocMoeError(f"{what}'s means file {path} is not an allocmoe expert-means file; {fix}")
    return ExpertMeans(means=means, tokens=int(tokens))
