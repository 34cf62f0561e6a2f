"""The file formats, as typed documents: what a plan or profile JSON may hold, checked field by field.

These pydantic models are the single source of truth for both formats: loading validates through
them (unknown or missing fields, wrong types, non-finite numbers, k outside [1, K_orig], a whole
number where one is required, ragged tables), saving validates before a byte is written, and
`docs/schemas/*.schema.json` are generated from them (`python scripts/write_schemas.py`).

They describe documents only; the objects the rest of allocmoe works with are `Plan` (core/plan.py),
its policies (core/policies.py) and the profile dict. Nothing here executes anything from a file.

Numbers follow JSON, not Python: `true` is not 1, `"3"` is not 3, and `NaN`/`Infinity` (which
Python's json module would read) are refused. A whole number may be written `3` or `3.0`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from ..errors import AllocMoeError

PLAN_FORMAT_VERSION = 1
PROFILE_FORMAT_VERSION = 1


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {_short(value)}")
    return value


def _whole(value: Any) -> Any:
    value = _number(value)
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        if not value.is_integer():
            raise ValueError(f"must be a whole number, got {value!r}")
        return int(value)
    if isinstance(value, int) and abs(value) > 2**53:
        raise ValueError("is too large")
    return value


def number(**bounds: float) -> Any:
    """A JSON number within `bounds` (pydantic's ge/gt/le): not true, not "3", finite."""
    return Annotated[float, Field(**bounds), BeforeValidator(_number)]


def whole(**bounds: int) -> Any:
    """A whole JSON number within `bounds`, written 3 or 3.0 (not 2.5)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


Count = whole(ge=1, le=2**53)              # layers, experts, k, tokens: at least one, and exact in a double
Index = whole(ge=0, le=2**53)              # a decoder-layer index


class Document(BaseModel):
    """Strict JSON: no unknown fields, no type coercion, no NaN or infinity."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class ModelFingerprint(Document):
    """The model a plan or profile was made for; using it with another model is refused."""
    model_type: str = Field(min_length=1)                             # config.model_type: the family's adapter
    num_moe_layers: Count                     # L: MoE layers sharing the budget
    num_experts: Count                        # E: routed experts per MoE layer
    k_orig: Count                             # K_orig: the model's own top-k
    moe_layers: list[Index]                   # decoder-layer index of each MoE layer

    @model_validator(mode="after")
    def _consistent(self):
        if self.k_orig > self.num_experts:
            raise ValueError(f"k_orig {self.k_orig} is above num_experts {self.num_experts}")
        if len(self.moe_layers) != self.num_moe_layers:
            raise ValueError(f"moe_layers lists {len(self.moe_layers)} layers for num_moe_layers "
                             f"{self.num_moe_layers}")
        if sorted(set(self.moe_layers)) != list(self.moe_layers):
            raise ValueError("moe_layers must be distinct and in increasing order")
        return self


# --- plans -------------------------------------------------------------------------------------

class TopKEntry(Document):
    policy: Literal["top-k"]
    k: Count                                  # experts every token keeps


class AllocTEntry(Document):
    policy: Literal["alloc-t"]
    k: number(ge=1)                                 # average activations per token
    k_base: Index = 1                         # experts every token keeps
    pool: Literal["batch", "sequence"] = "batch"                      # extent of the shared pool

    @model_validator(mode="after")
    def _base_within_k(self):
        if self.k_base > self.k:
            raise ValueError(f"k_base {self.k_base} is above k {self.k}")
        return self


class TopPEntry(Document):
    policy: Literal["top-p"]
    p: number(gt=0, le=1)                           # cumulative probability to reach
    k: number(ge=1) | None = None                   # measured at calibration (informational)


class NaeeEntry(Document):
    policy: Literal["naee"]
    beta: number(ge=0)                              # drop expert j when w_j < beta * w_0
    k: number(ge=1) | None = None                   # measured at calibration (informational)


class DistinctEntry(Document):
    policy: Literal["distinct"]
    max_experts: Count                        # M: distinct experts one decode step may load in the layer
    k_floor: Count = 1                        # each token's top experts chosen first (at most k_orig)
    k: number(ge=1) | None = None                   # activations per token, measured or expected (informational)


POLICY_NAMES = ("top-k", "alloc-t", "top-p", "naee", "distinct")
LayerEntry = Annotated[Union[TopKEntry, AllocTEntry, TopPEntry, NaeeEntry, DistinctEntry],
                       Field(discriminator="policy")]


class PlanBudget(Document):
    activations_per_token: number(gt=0)             # B: what the plan may spend per token
    full: Count                               # L * K_orig, for the reader's convenience
    fraction: number(gt=0)                          # B / full, for the reader's convenience


class SubstituteRef(Document):
    """The plan's means file (core/means.py): each expert's calibrated mean output, added for skipped experts."""
    means_file: str = Field(pattern=r"^[^/\\.][^/\\]*\.means\.safetensors$")   # beside the plan, no folder
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")                    # of the file's bytes, checked on loading
    tokens: Count                                                     # calibration tokens the means came from


class PlanCost(Document):
    """What the plan's work costs per token, in activations (core/budget.py): B bounds `total`."""
    activations: number(ge=0)                       # the layers' k, summed
    standins: number(ge=0)                          # the stand-ins, in activation-equivalents
    total: number(ge=0)                             # activations + standins
    layers: dict[str, number(ge=0)]                 # each layer's k + its stand-ins' equivalents
    standin_per_slot: dict[str, number(ge=0, le=1)] = {}   # per layer with a stand-in: one's cost per skipped slot


class PlanDocument(Document):
    """A plan file: which policy, and which k, each MoE layer of one model gets under a budget."""
    format_version: Literal[1]
    model: ModelFingerprint
    budget: PlanBudget
    method: str = Field(min_length=1)                                 # the allocation method that made it
    layers: dict[str, LayerEntry]                                     # decoder-layer index (as text) -> policy
    provenance: dict[str, Any] = {}                                   # version, time, method details
    substitute: SubstituteRef | None = None                           # skipped experts' means, added back
    cost: PlanCost | None = None                                      # the work per token; absent in older plans

    @model_validator(mode="after")
    def _fits_model(self):
        fp = self.model
        expected = [str(i) for i in fp.moe_layers]
        if sorted(self.layers, key=_layer_order) != expected:
            raise ValueError(f"layers must be exactly the MoE layers {expected}, got {sorted(self.layers, key=_layer_order)}")
        for index, entry in self.layers.items():
            k = getattr(entry, "k", None)
            if k is not None and k > fp.k_orig:
                raise ValueError(f"layer {index}: k {k} is above k_orig {fp.k_orig}")
            k_floor = getattr(entry, "k_floor", None)
            if k_floor is not None and k_floor > fp.k_orig:
                raise ValueError(f"layer {index}: k_floor {k_floor} is above k_orig {fp.k_orig}")
        full = fp.num_moe_layers * fp.k_orig
        if self.budget.full != full:
            raise ValueError(f"budget.full is {self.budget.full} but the model's full budget is {full} "
                             f"({fp.num_moe_layers} x {fp.k_orig})")
        spend = self.budget.activations_per_token
        if not fp.num_moe_layers * (1 - 1e-9) <= spend <= full * (1 + 1e-9):
            raise ValueError(f"budget.activations_per_token {spend:g} is outside [{fp.num_moe_layers}, {full}] "
                             "(every MoE layer keeps at least one expert, none more than k_orig)")
        least = least_spend(self.layers.values(), fp.k_orig)
        if least > spend * (1 + 1e-9):
            raise ValueError(f"the layers spend at least {least:g} activations per token but "
                             f"budget.activations_per_token says {spend:g} (top-k and alloc-t layers spend their "
                             "k, distinct layers up to k_orig, top-p and naee layers at least one expert)")
        if abs(self.budget.fraction - spend / full) > 1e-6:
            raise ValueError(f"budget.fraction {self.budget.fraction:g} is not activations_per_token / full "
                             f"= {spend / full:.6g}")
        if self.cost is not None:
            _check_cost(self.cost, self.layers, fp.k_orig, spend)
        return self


def _check_cost(cost: PlanCost, layers: dict[str, Any], k_orig: int, spend: float) -> None:
    """A plan's `cost` agrees with its layers (each layer's k plus K_orig - k stand-ins at its per-slot
    cost; the sums) and fits its budget: B bounds the total."""
    if sorted(cost.layers, key=_layer_order) != sorted(layers, key=_layer_order):
        raise ValueError("cost.layers must name exactly the plan's layers")
    if not set(cost.standin_per_slot) <= set(layers):
        raise ValueError("cost.standin_per_slot names a layer the plan does not have")
    close = lambda a, b: abs(a - b) <= 1e-6 * max(1.0, abs(b))              # noqa: E731 (the file rounds to 9 places)
    for index, entry in layers.items():
        k = getattr(entry, "k", None)
        u = cost.standin_per_slot.get(index)
        if k is None or not close(cost.layers[index], k + (k_orig - k) * (u or 0.0)):
            raise ValueError(f"cost.layers.{index} {cost.layers[index]:g} is not the layer's k plus its stand-ins")
    if not close(cost.activations, sum(layers[i].k for i in layers)) or not close(cost.total, sum(cost.layers.values())) \
            or not close(cost.standins, cost.total - cost.activations):
        raise ValueError("cost.activations, cost.standins and cost.total do not add up over the layers")
    if cost.total > spend * (1 + 1e-9) + 1e-9:
        raise ValueError(f"cost.total {cost.total:g} is above budget.activations_per_token {spend:g}: B bounds the "
                         "activations plus the stand-ins' equivalents")


def least_spend(entries, k_orig: int) -> float:
    """What a plan's budget must cover, per token: a top-k or alloc-t layer its k (fixed, whatever the
    text); a distinct layer K_orig (it caps distinct experts per decode step, not activations: a token
    keeps all K_orig of its experts whenever they fit, so allocmoe writes such plans at the full
    budget); a top-p or naee layer one expert (their spend depends on the text, and their budget is
    the average calibration measured, which `k` records for information)."""
    total = 0.0
    for entry in entries:
        if entry.policy in ("top-k", "alloc-t"):
            total += entry.k
        elif entry.policy == "distinct":
            total += k_orig
        else:
            total += 1
    return total


def _layer_order(key: str) -> tuple[int, str]:
    return (int(key), key) if key.isascii() and key.isdigit() else (-1, key)


# --- profiles ----------------------------------------------------------------------------------

class Calibration(Document):
    """What the profile was measured on; a partial profile resumes only under the same values."""
    text: str                                                         # name of the calibration text
    sha256: str                                                       # first 16 hex digits of its hash
    tokens_scored: Count
    windows: Count
    seq_len: whole(ge=2, le=2**53)
    max_tokens: Count              # ProfileConfig.calib_tokens; the file keeps the old key so older profiles load
    batch_size: Count              # ProfileConfig.windows_per_pass; the file keeps the old key, as above


class ProfileModel(ModelFingerprint):
    """A profile's model: the fingerprint, and which weights it was measured on (core/fingerprint.py);
    absent in profiles made before it was recorded."""
    weights: Union[str, None] = Field(default=None, pattern=r"^(files|tensors):[0-9a-f]{16}$")


class ProfileDocument(Document):
    """A profile file: calibration perplexity S[i][k] of each MoE layer i at each k in 1..K_orig."""
    format_version: Literal[1]
    model: ProfileModel
    k_orig: Count
    num_layers: Count
    metric: Literal["perplexity"]
    calibration: Calibration
    # perplexity is >= 1 for any model; null marks a cell whose value was not finite and is refused
    sensitivity: list[list[number(ge=1)]]
    provenance: dict[str, Any] = {}

    @model_validator(mode="after")
    def _table_shape(self):
        if self.k_orig != self.model.k_orig or self.num_layers != self.model.num_moe_layers:
            raise ValueError(f"k_orig {self.k_orig} and num_layers {self.num_layers} must match the model's "
                             f"{self.model.k_orig} and {self.model.num_moe_layers}")
        if len(self.sensitivity) != self.num_layers:
            raise ValueError(f"sensitivity has {len(self.sensitivity)} rows for {self.num_layers} layers")
        for i, row in enumerate(self.sensitivity):
            if len(row) != self.k_orig:
                raise ValueError(f"sensitivity row {i} has {len(row)} values for k = 1..{self.k_orig}")
        return self


# --- reading -----------------------------------------------------------------------------------

def validated(cls: type[Document], data: Any, source: str, version: int, fix: str) -> Document:
    """`data` as a `cls` document, or one AllocMoeError naming the first problem and the fix."""
    if not isinstance(data, dict):
        raise AllocMoeError(f"{source} is not an allocmoe {_kind(cls)} (expected a JSON object); {fix}")
    from .files import json_depth_problem

    deep = json_depth_problem(data)
    if deep:
        raise AllocMoeError(f"{source} is invalid: {deep}; {fix}")
    found = data.get("format_version")
    if type(found) is not int or found != version:          # true and 1.0 are not the version 1
        raise AllocMoeError(f"{source} has format_version {found!r} but this allocmoe reads version {version}; {fix}")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise AllocMoeError(f"{source} is invalid: {describe(exc)}; {fix}") from None


def describe(exc: ValidationError) -> str:
    """The first problem of a ValidationError as `where: what`, with a count of the others."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(_loc_part(part) for part in first["loc"] if not _is_union_tag(part))
    what = _PLAIN.get(first["type"], first["msg"].removeprefix("Value error, "))
    if first["type"] == "union_tag_invalid":
        what = f"unknown policy {_short(first.get('ctx', {}).get('tag'))}; known: {', '.join(POLICY_NAMES)}"
    if first["type"] in ("float_type", "int_type", "string_type", "literal_error", "dict_type", "list_type",
                         "model_type", "bool_type") and "input" in first:
        what += f" (got {_short(first['input'])})"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {what}{more}" if where else f"{what}{more}"


_PLAIN = {   # pydantic's wording -> what a user editing the file needs to hear
    "extra_forbidden": "unknown field (not part of the format)",
    "missing": "missing field",
    "union_tag_not_found": "needs a 'policy' field: one of " + ", ".join(POLICY_NAMES),
    "union_tag_invalid": "unknown policy; known: " + ", ".join(POLICY_NAMES),
}


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in POLICY_NAMES or part.startswith(
        ("int", "float", "function-after", "constrained")))


def _loc_part(part: Any) -> str:
    """A key as the user would find it in the file: quoted when it is empty or holds odd characters."""
    text = str(part)
    return text if text and text.isprintable() and "." not in text and " " not in text else repr(text)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(cls: type[Document]) -> str:
    return "plan" if cls is PlanDocument else "profile"


def json_schemas() -> dict[str, dict[str, Any]]:
    """The published JSON Schemas (docs/schemas/<name>.schema.json), generated from the documents above.
    The cross-field rules (k <= k_orig, table shape, layer keys) are in the validators, not the schema."""
    schemas = {}
    for name, cls in (("plan", PlanDocument), ("profile", ProfileDocument)):
        schema = cls.model_json_schema()
        schemas[name] = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
    return schemas
