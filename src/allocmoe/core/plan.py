"""Plans: which policy and budget each MoE layer gets, saved as versioned JSON other tools can read.

File shape (format_version 1; the typed document and its checks are in core/formats.py, its JSON
Schema in docs/schemas/plan.schema.json):
    {"format_version": 1,
     "model": {"model_type", "num_moe_layers", "num_experts", "k_orig", "moe_layers": [indices]},
     "budget": {"activations_per_token": B, "full": L*K_orig, "fraction": B/full},
     "method": "alloc-moe",
     "layers": {"1": {"k": 3, "policy": "alloc-t", "k_base": 1, "pool": "batch"}, ...},
     "provenance": {"allocmoe_version", "created", ...},
     "substitute": {"means_file": "plan.means.safetensors", "sha256": ..., "tokens": N},  (optional)
     "cost": {"activations": A, "standins": S, "total": A + S, "layers": {"1": cost, ...},
              "standin_per_slot": {"1": u, ...}}}                                        (optional)
Layers are keyed by the decoder layer's index in the model. `k` is the layer's average activations
per token; fractional only for alloc-t, and a measured expectation for threshold policies.

`substitute` is present when the plan adds back what it skips (core/means.py): the means file sits
beside the plan, named without a folder, and its hash is checked on loading.

`cost` is what the plan's work costs per token in activations (core/budget.py): each layer's k plus,
where it has a stand-in, K_orig - k stand-ins of `standin_per_slot[layer]` activation-equivalents
each. B (`budget.activations_per_token`) bounds the total. Written when every layer has a set k;
plans written before it was recorded load without it (their stand-ins' cost is then not known).

A plan is data only: loading never executes anything from the file (or from its means file).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AllocMoeError
from .files import atomic_write_json, read_json, staged_file
from .formats import PLAN_FORMAT_VERSION as FORMAT_VERSION
from .formats import PlanDocument, validated
from .budget import plan_costs
from .means import ExpertMeans, read_means, sidecar_name
from .policies import AllocT, Policy, StaticTopK, policy_from_entry, policy_to_dict

FINGERPRINT_KEYS = ("model_type", "num_moe_layers", "num_experts", "k_orig", "moe_layers")

# A plan's name where plans are named (a server's MODEL@NAME, `--plan NAME=FILE`, the vLLM plugin's
# ALLOCMOE_PLANS): letters, digits, '.', '_' or '-', at most 64, not starting with a punctuation mark.
PLAN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_fingerprint(found: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """Refuse a file made for another model, naming the first field that differs."""
    for key in FINGERPRINT_KEYS:
        if key in found and found.get(key) != expected.get(key):
            raise AllocMoeError(
                f"{what} was made for another model: {key} is {found.get(key)!r} in the file but "
                f"{expected.get(key)!r} in this model; recreate it for this model")


@dataclass
class Plan:
    model: dict[str, Any]                      # fingerprint of the model the plan was made for
    layers: dict[int, Policy]                  # decoder-layer index -> the layer's selection policy
    method: str                                # the allocation method that made it
    budget: float                              # B, activations per token over all MoE layers
    provenance: dict[str, Any] = field(default_factory=dict)   # version, time, and method details
    # each skipped candidate expert's calibrated mean output, added back at inference (None: add nothing)
    means: ExpertMeans | None = None
    # the means file's entry in the plan file, {"means_file", "sha256", "tokens"}; set by save and load
    substitute: dict[str, Any] | None = None
    # per layer that carries a stand-in, its cost per skipped slot in activation-equivalents (core/budget.py;
    # routing.layout.standin_costs reads it off a model); None: not known (a plan written before it was recorded)
    standins: dict[int, float] | None = None

    @property
    def k_orig(self) -> int:
        return int(self.model["k_orig"])

    @property
    def full_budget(self) -> int:
        return int(self.model["num_moe_layers"]) * self.k_orig

    def k_per_layer(self) -> dict[int, float | None]:
        return {index: getattr(policy, "k", None) for index, policy in self.layers.items()}

    def k_text(self) -> str:
        """`layer:k` pairs in layer order, `?` where a policy has no set k: "0:1 1:2"."""
        return " ".join(f"{i}:{k:g}" if k is not None else f"{i}:?" for i, k in sorted(self.k_per_layer().items()))

    def standin_costs(self) -> dict[int, float] | None:
        """Per layer the plan adds stand-ins to, one's cost per skipped slot: none without means (a plan
        whose means were taken off runs none), only the layers its means cover; None if not known."""
        if self.means is None and not self.substitute:
            return {}
        if self.standins is None:
            return None
        return {i: u for i, u in self.standins.items() if self.means is None or i in self.means.means}

    def layer_costs(self) -> dict[int, float | None] | None:
        """Each layer's cost per token (k plus its stand-ins in activation-equivalents), None per layer
        without a set k; None in all if the plan has stand-ins whose cost is not known."""
        standins = self.standin_costs()
        return None if standins is None else plan_costs(self.k_per_layer(), self.k_orig, standins)

    def cost(self) -> dict[str, Any] | None:
        """The plan's cost per token: {"activations", "standins" (their activation-equivalents), "total",
        "layers": {index: total}, "standin_per_slot": {index: u}}; None unless every layer is top-k or
        alloc-t (top-p and naee spend what the text makes them: measured only; a distinct layer caps
        experts per step) or when the stand-ins' cost is not known."""
        layers = self.layer_costs()
        if layers is None or not all(isinstance(p, (StaticTopK, AllocT)) for p in self.layers.values()):
            return None
        activations = sum(float(k) for k in self.k_per_layer().values())
        total = sum(layers.values())
        return {"activations": activations, "standins": total - activations, "total": total, "layers": layers,
                "standin_per_slot": self.standin_costs()}

    def measured_cost(self, layer_activations: dict[int, float]) -> float | None:
        """The cost per token of activations as measured per layer (a threshold layer's spend drifts
        with the text): each layer's measured activations plus its stand-ins for the rest of its
        top-K_orig. None when the stand-ins' cost is not known."""
        standins = self.standin_costs()
        return None if standins is None else sum(plan_costs(dict(layer_activations), self.k_orig, standins).values())

    def cost_text(self) -> str:
        """The plan's cost in one phrase: "cost 19.59 per token = 18 activations + 1.59 in stand-ins"."""
        cost = self.cost()
        if cost is None:
            return ("cost: stand-ins' cost not recorded (plan made before it was)" if self.substitute or self.means
                    else "cost: measured only (threshold layers)")
        if not cost["standin_per_slot"]:
            return f"cost {cost['total']:.4g} activations per token"
        return (f"cost {cost['total']:.4g} per token = {cost['activations']:.4g} activations + "
                f"{cost['standins']:.3g} in stand-ins")

    def to_dict(self) -> dict[str, Any]:
        from ..version import __version__

        provenance = {"allocmoe_version": __version__,
                      "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        provenance.update(self.provenance)
        return {
            "format_version": FORMAT_VERSION,
            "model": dict(self.model),
            "budget": {"activations_per_token": self.budget, "full": self.full_budget,
                       "fraction": round(self.budget / self.full_budget, 6)},
            "method": self.method,
            "layers": {str(index): policy_to_dict(policy) for index, policy in sorted(self.layers.items())},
            "provenance": provenance,
            **({"substitute": dict(self.substitute)} if self.substitute else {}),
            **({"cost": _cost_entry(cost)} if (cost := self.cost()) is not None else {}),
        }

    def to_document(self) -> dict[str, Any]:
        """`to_dict`, validated as a plan file: a plan that could not be loaded back is never written."""
        data = self.to_dict()
        validated(PlanDocument, data, "the plan to write", FORMAT_VERSION, "this is a bug in allocmoe; please report it")
        return data

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        """Validate a plan document (core/formats.py) and build the plan; AllocMoeError names the first problem."""
        doc = validated(PlanDocument, data, source, FORMAT_VERSION, "recreate the plan with `allocmoe allocate`")
        k_orig = doc.model.k_orig
        layers = {int(key): policy_from_entry(entry, k_orig, where=f"{source}, layer {key}")
                  for key, entry in doc.layers.items()}
        standins = ({int(key): float(u) for key, u in doc.cost.standin_per_slot.items()} if doc.cost is not None
                    else None if doc.substitute else {})
        return cls(model=doc.model.model_dump(), layers=layers, method=doc.method,
                   budget=float(doc.budget.activations_per_token), provenance=dict(doc.provenance),
                   substitute=doc.substitute.model_dump() if doc.substitute else None, standins=standins)

    def save(self, path) -> None:
        """Write the plan (and, with means, its means file beside it: `<name>.means.safetensors`)."""
        path = Path(path)
        if self.means is None:
            atomic_write_json(path, self.to_document())
            return
        sidecar, data = path.parent / sidecar_name(path), self.means.to_bytes()
        self.substitute = {"means_file": sidecar.name, "sha256": hashlib.sha256(data).hexdigest(),
                           "tokens": self.means.tokens}
        # the means file is staged, the plan written, then the means renamed into place: a plan that
        # fails to write leaves an earlier plan and its means file as they were (an interrupt between
        # the two renames leaves a new plan whose means hash does not match: refused on load, never used)
        with staged_file(sidecar, data):
            atomic_write_json(path, self.to_document())

    @classmethod
    def load(cls, path, fingerprint: dict[str, Any] | None = None, hidden_size: int | None = None) -> "Plan":
        """Load a plan; with a model's `fingerprint` (and `hidden_size`), also check it was made for that
        model (`check_model`). allocmoe.routing.layout.load_plan(path, model) reads both off a model."""
        plan = cls.from_dict(read_json(path, "plan"), source=f"plan {path}")
        if plan.substitute:
            plan.means = read_means(Path(path).parent / plan.substitute["means_file"], plan.substitute["sha256"],
                                    f"plan {path}")
            plan.means.check_shape(plan.model["moe_layers"], plan.model["num_experts"], None, f"plan {path}")
        if fingerprint is not None:
            plan.check_model(fingerprint, hidden_size, "Plan.load")
        return plan

    def check_model(self, fingerprint: dict[str, Any], hidden_size: int | None = None,
                    caller: str = "Plan.check_model") -> None:
        """Refuse this plan unless it was made for the model of `fingerprint` (allocmoe.model_fingerprint:
        a plan is data, so the model is read by routing/, not here); with the model's `hidden_size`,
        its expert means are checked against it too. routing.layout.check_plan(plan, model) does both."""
        if not isinstance(fingerprint, dict):
            raise AllocMoeError(f"{caller} takes the model's fingerprint, got {type(fingerprint).__name__}; give "
                                "allocmoe.model_fingerprint(model)")
        check_fingerprint(self.model, fingerprint, "the plan")
        missing = set(fingerprint["moe_layers"]) - set(self.layers)
        if missing:
            raise AllocMoeError(f"the plan has no entry for MoE layer(s) {sorted(missing)}; recreate it")
        if self.means is not None:
            self.means.check_shape(fingerprint["moe_layers"], fingerprint["num_experts"], hidden_size, "the plan")


def _cost_entry(cost: dict[str, Any]) -> dict[str, Any]:
    """A plan's `cost` as its file holds it: layers keyed by index as text, rounded to 9 places."""
    return {"activations": round(cost["activations"], 9), "standins": round(cost["standins"], 9),
            "total": round(cost["total"], 9),
            "layers": {str(i): round(c, 9) for i, c in sorted(cost["layers"].items())},
            "standin_per_slot": {str(i): round(u, 12) for i, u in sorted(cost["standin_per_slot"].items())}}
