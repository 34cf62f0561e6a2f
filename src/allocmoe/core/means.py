"""Expert means: what a plan's substitute adds back for the experts its budget skips.

A plan made with `substitute` carries, per MoE layer (or per MoE layer that `auto`'s (k, rank) DP gave
a stand-in: a layer without means adds nothing back), each routed expert's mean output over the
calibration tokens whose top-K_orig held it, measured on the unmodified model (MoNE, arXiv
2507.00390; calibrate/means.py measures them, routing/router.py adds them). With a rank r > 0 it
also carries a rank-r linear term fitted by least squares on the same tokens, so a skipped expert
is stood in for by an affine map of the token instead of a constant:
    f_e(x) ~ mean_e + ((x - input_mean_e) @ down_e) @ up_e
That is E x H (+ E x H x 2r) numbers per layer: too many for JSON, so they live in a safetensors
file beside the plan, and the plan names it and records its SHA-256. Loading reads tensors only
(safetensors never executes anything), and refuses a file whose hash, layers or shapes do not match.

Each layer has its own rank (with --rank-menu, `auto`'s (k, rank) DP may give layer 1 rank 16 and
layer 3 the mean alone, rank 0); a plan made with one --substitute-rank has the same on every layer.

File shape: float32 tensors per MoE layer i (i = decoder layer index): `layer.<i>` [E, H], the
means; where layer i's rank r_i > 0 also `layer.<i>.input_mean` [E, H], `layer.<i>.down` [E, H, r_i]
and `layer.<i>.up` [E, r_i, H]. Metadata {"format": "allocmoe-expert-means", "tokens": "<calibration
tokens measured>", "rank": "<largest r_i>", "ranks": "<i>:<r_i>,..."} (no "ranks": every layer at
"rank", files written before per-layer ranks; no rank: 0, files written before the linear term).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import AllocMoeError
from .files import existing_file

FORMAT = "allocmoe-expert-means"
SUFFIX = ".means.safetensors"


LINEAR_PARTS = ("input_mean", "down", "up")


@dataclass
class LinearTerm:
    """One layer's rank-r least-squares term: f_e(x) - mean_e ~ ((x - input_mean_e) @ down_e) @ up_e."""
    input_mean: torch.Tensor           # [E, H] each expert's mean input over its routed tokens
    down: torch.Tensor                 # [E, H, r]
    up: torch.Tensor                   # [E, r, H]

    @property
    def rank(self) -> int:
        return int(self.down.shape[-1])

    def shapes_fit(self, num_experts: int, hidden: int) -> bool:
        r = self.rank
        return (tuple(self.input_mean.shape) == (num_experts, hidden)
                and tuple(self.down.shape) == (num_experts, hidden, r)
                and tuple(self.up.shape) == (num_experts, r, hidden))


@dataclass
class ExpertMeans:
    means: dict[int, torch.Tensor]     # decoder-layer index -> [E, H] float32, each expert's mean output
    tokens: int                        # calibration tokens the means were measured on
    linear: dict[int, LinearTerm] | None = None   # rank-r linear terms per layer (None: the means alone, rank 0)

    @property
    def ranks(self) -> dict[int, int]:
        """Each layer's rank: its linear term's, 0 where it has the mean alone."""
        return {i: self.linear[i].rank if i in (self.linear or {}) else 0 for i in self.means}

    @property
    def rank(self) -> int:
        """The largest layer's rank (every layer's, for means fitted at one rank)."""
        return max(self.ranks.values(), default=0)

    def truncated(self, ranks: dict[int, int]) -> "ExpertMeans":
        """These means for the layers of `ranks` only, layer i's linear term cut to its first ranks[i]
        directions (0: the mean alone). The reduced-rank fit (core/regression.py) orders its directions
        by the fitted output's variance, so the cut of a rank-R fit is the rank-r fit of the same moments."""
        linear = {}
        for i, r in ranks.items():
            have = self.ranks[i]
            if not 0 <= r <= have:
                raise AllocMoeError(f"layer {i}'s stand-ins have rank {have}; they cannot be cut to rank {r}")
            if r:
                term = self.linear[i]
                linear[i] = LinearTerm(input_mean=term.input_mean, down=term.down[..., :r].contiguous(),
                                       up=term.up[:, :r, :].contiguous())
        return ExpertMeans(means={i: self.means[i] for i in ranks}, tokens=self.tokens, linear=linear or None)

    def restricted(self, layers) -> "ExpertMeans":
        """These means for `layers` only: a plan whose other layers carry no stand-in (auto's (k, rank) DP)."""
        keep = set(layers)
        linear = {i: t for i, t in (self.linear or {}).items() if i in keep}
        return ExpertMeans(means={i: t for i, t in self.means.items() if i in keep}, tokens=self.tokens,
                           linear=linear or None)

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors = {f"layer.{index}": t.detach().float().cpu().contiguous() for index, t in sorted(self.means.items())}
        for index, term in sorted((self.linear or {}).items()):
            for part in LINEAR_PARTS:
                tensors[f"layer.{index}.{part}"] = getattr(term, part).detach().float().cpu().contiguous()
        ranks = ",".join(f"{i}:{r}" for i, r in sorted(self.ranks.items()))
        return save(tensors, metadata={"format": FORMAT, "tokens": str(self.tokens), "rank": str(self.rank),
                                       "ranks": ranks})

    def check_shape(self, layers: list[int], num_experts: int, hidden: int | None, what: str) -> None:
        """Refuse means that do not fit a model: other layers, another expert count or hidden size."""
        if not self.means or not set(self.means) <= set(layers):
            raise AllocMoeError(f"{what} holds means for layers {sorted(self.means)} but the model's MoE layers are "
                                f"{sorted(layers)}; recreate the plan with `allocmoe allocate --substitute`")
        for index, t in self.means.items():
            want = (num_experts, hidden if hidden is not None else t.shape[-1])
            if tuple(t.shape) != want:
                raise AllocMoeError(f"{what}: layer {index}'s means have shape {tuple(t.shape)}, the model needs "
                                    f"{want} (experts x hidden size); recreate the plan for this model")
            term = (self.linear or {}).get(index)
            if term is not None and not term.shapes_fit(*want):
                raise AllocMoeError(f"{what}: layer {index}'s linear term has shapes {tuple(term.down.shape)} and "
                                    f"{tuple(term.up.shape)}, the model needs {want[0]} x {want[1]} x rank; "
                                    "recreate the plan for this model")


def sidecar_name(plan_path: str | Path) -> str:
    """The means file written beside plan `dir/name.json`: `name.means.safetensors`."""
    name = Path(plan_path).name
    return (name[:-5] if name.endswith(".json") else name) + SUFFIX


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
    means, parts = {}, {}
    for name, t in tensors.items():
        index, _, part = name.removeprefix("layer.").partition(".")
        dims = 3 if part in ("down", "up") else 2
        if (not name.startswith("layer.") or not index.isdigit() or part not in ("",) + LINEAR_PARTS
                or t.dim() != dims or t.dtype != torch.float32 or not bool(torch.isfinite(t).all())):
            raise AllocMoeError(f"{what}'s means file {path} holds {name!r} {tuple(t.shape)} {t.dtype}, not a finite "
                                f"float32 tensor named layer.<index>[.input_mean|.down|.up]; {fix}")
        if part:
            parts.setdefault(int(index), {})[part] = t
        else:
            means[int(index)] = t
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    tokens, rank = meta.get("tokens", ""), meta.get("rank", "0")
    if meta.get("format") != FORMAT or not tokens.isdigit() or not rank.isdigit():
        raise AllocMoeError(f"{what}'s means file {path} is not an allocmoe expert-means file; {fix}")
    ranks = _layer_ranks(meta.get("ranks"), sorted(means), int(rank))
    if ranks is None:
        raise AllocMoeError(f"{what}'s means file {path} names per-layer ranks {meta.get('ranks')!r} that do not "
                            f"match its layers {sorted(means)} and largest rank {rank}; {fix}")
    linear = {}
    for index, found in parts.items():
        if sorted(found) != sorted(LINEAR_PARTS) or index not in means:
            raise AllocMoeError(f"{what}'s means file {path}: layer {index}'s linear term is incomplete (holds "
                                f"{sorted(found)}); {fix}")
        linear[index] = LinearTerm(**found)
        if linear[index].rank != ranks[index] or not linear[index].shapes_fit(*means[index].shape):
            raise AllocMoeError(f"{what}'s means file {path}: layer {index}'s linear term does not have rank "
                                f"{ranks[index]} and the means' {tuple(means[index].shape)} shape; {fix}")
    wanted = sorted(i for i, r in ranks.items() if r)
    if sorted(linear) != wanted:
        raise AllocMoeError(f"{what}'s means file {path} names linear terms for layers {wanted} but holds them for "
                            f"{sorted(linear)}; {fix}")
    return ExpertMeans(means=means, tokens=int(tokens), linear=linear or None)


def _layer_ranks(written: str | None, layers: list[int], rank: int) -> dict[int, int] | None:
    """Each layer's rank from a means file's "ranks" metadata ("<i>:<r>,..."; absent: `rank` on every
    layer); None when it does not name exactly `layers` with ranks up to `rank`, the largest."""
    if written is None:
        return {i: rank for i in layers}
    ranks = {}
    for item in written.split(",") if written else []:
        index, _, r = item.partition(":")
        if not (index.isdigit() and r.isdigit()) or int(index) in ranks:
            return None
        ranks[int(index)] = int(r)
    if sorted(ranks) != layers or max(ranks.values(), default=0) != rank:
        return None
    return ranks
