"""Allocation methods: from a budget (and a profile, or the model) to a Plan.

  alloc-moe   Alloc-L's exact DP on the profile, each layer then run with Alloc-T (k_base)
  alloc-l     the DP's K_l as static top-k
  alloc-t     uniform K_l = B/L (may be fractional) with Alloc-T
  uniform     static top-(B/L); a fractional B/L mixes floor and ceil across layers
  ascending / descending   K_l rising (falling) linearly with depth, summing to floor(B)
  lexi        data-free: output deviation of each layer alone on Gaussian inputs, same exact DP
  top-p       one global p calibrated so measured activations match B on calibration text
  naee        per-layer beta_l calibrated so each layer spends B/L on calibration text
  auto        tries alloc-moe, alloc-l and alloc-t (k_base 0..2), each with and without the substitute,
              on calibration text, keeps the best, refines it, then spends what whole k left of B on the
              layer where it helps most (the default method); every choice is scored with stand-ins
              fitted on the other half of the calibration windows (two folds), then they are refitted
              on all of them (calibrate/crossfit.py) and on the slots the plan skips (standin_fit)

Two add-ons work with any budget-exact method, and `auto` uses both by default (docs/quality.md):
  substitute  each skipped candidate expert adds gate x a stand-in for its output: its calibrated mean
              (MoNE) plus a rank-r least-squares linear term in the token (substitute_rank, default 8),
              measured on the unmodified model and saved beside the plan: calibrate/means.py
  refine      moves activations between layers while calibration perplexity improves (calibrate/refine.py;
              with the substitute, each window scored with stand-ins fitted on the others: calibrate/crossfit.py)

Profile-based methods (alloc-moe, alloc-l) are pure given the profile; the rest of the budget-exact
methods need only the model's fingerprint, which its config gives: `model` may be a model folder (its
path, or inspect_model's ModelSpec) with config.json alone, no weights (`weights_reason` says which
runs need the weights). Threshold methods match B only on average over the
calibration text: their real cost drifts with the input, so always report measured activations.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, MutableMapping

import torch
from tqdm import tqdm

from ..routing.apply import apply_plan, static_plan
from ..core.budget import Budget, expert_budget, layer_cost, plan_costs, standin_equivalent
from ..core.config import Config, check_counts, checked_config, replaced
from ..errors import AllocMoeError
from ..scoring.perplexity import check_batch_size, window_len, evaluate_perplexity, tokenize_windows, windows_digest
from ..core.plan import Plan, check_fingerprint
from ..routing.layout import expert_weights, model_fingerprint, standin_costs
from ..core.policies import AllocT, NaeeSkip, StaticTopK, TopP
from ..core.solver import solve_allocation
from .crossfit import cross_fit_provenance, held_out_perplexity, refit, scored_tokens, split_windows

PROFILE_METHODS = ("alloc-moe", "alloc-l")
MODEL_METHODS = ("lexi", "top-p", "naee", "auto")
METHODS = ("alloc-moe", "auto", "alloc-l", "alloc-t", "uniform", "ascending", "descending", "lexi", "top-p", "naee")
CONFIG_METHODS = ("uniform", "ascending", "descending", "alloc-t")    # the model's config is all they read


STANDIN_FITS = ("skipped", "routed")     # AllocateConfig.standin_fit: calibrate/means.py fit_skipped_standins, measure_expert_means


class AllocateConfig(Config):
    """How a plan is made from a budget: Alloc-T's settings, calibration, and the add-ons."""
    __config_aliases__ = {"calib_max_tokens": "calib_tokens", "batch_size": "windows_per_pass"}   # deprecated
    __config_flags__ = {"lexi_samples": "AllocateConfig.lexi_samples", "seed": "AllocateConfig.seed"}   # no flag

    k_base: int = 1                 # Alloc-T: experts every token keeps (the paper's default, near-best)
    pool: str = "batch"             # Alloc-T pool: "batch" (all tokens of a pass) or "sequence"
    calib_tokens: int = 8192        # calibration tokens for top-p/naee thresholds and auto's trials
    seq_len: int | None = None      # calibration window; None = min(2048, the model's limit)
    windows_per_pass: int = 4       # windows per forward pass in calibration
    lexi_samples: int = 512         # Gaussian inputs per layer for LExI's deviation profile
    seed: int = 0                   # LExI's input seed
    progress: bool = True           # progress bar (stderr) for the methods that run the model: lexi, top-p, naee, auto
    substitute: bool | None = None  # add stand-ins for skipped experts back; None: auto tries both, others don't
    refine: int | None = None       # calibration passes for the joint refinement; None: AUTO_REFINE for auto, else 0
    substitute_rank: int = 8        # rank of the least-squares term beside each mean (0: the means alone, MoNE);
                                    # on the shipped models rank 8 kept half the loss the means left (quality.md)
    standin_fit: str = "skipped"    # how a plan's stand-ins are fitted for shipping: "skipped", on the slots the plan
                                    # skips, gate^2-weighted, under the plan (built-in model at half: 0.137 -> 0.075
                                    # of uniform's loss, quality.md); "routed", on every token routed to the expert
    rank_menu: bool = False         # auto's (k, stand-in) DP also offers each layer ranks 0, r/2 and 2r (menu_ranks);
                                    # off by default: over the 20 quality cells it lost 2.6 test ppl in all (quality.md)

    def __post_init__(self):        # types are checked by Config.__init__ before this runs
        if self.pool not in ("batch", "sequence"):
            raise AllocMoeError(f"pool (--pool) must be 'batch' or 'sequence', got {self.pool!r}; give one of those")
        if self.standin_fit not in STANDIN_FITS:
            raise AllocMoeError(f"standin_fit (--standin-fit) must be one of {', '.join(STANDIN_FITS)}, got "
                                f"{self.standin_fit!r}; give one of those")
        check_counts(self, {"k_base": 0, "calib_tokens": 2, "seq_len": 2, "windows_per_pass": 1, "lexi_samples": 1,
                            "seed": 0, "refine": 0, "substitute_rank": 0},
                     most={"lexi_samples": 1 << 20, "seed": 2**63 - 1})


AUTO_REFINE = 128        # auto's default bound on refinement passes: 4 rounds of every move on a 6-layer model
ADDON_METHODS = ("alloc-moe", "auto", "alloc-l", "alloc-t", "uniform", "ascending", "descending", "lexi")


# -- budget-only allocations ---------------------------------------------------------------------
def spread_evenly(total: int, num_layers: int) -> list[int]:
    """Integer K_l summing to `total`, differing by at most one, the larger ones spread out."""
    return [(i + 1) * total // num_layers - i * total // num_layers for i in range(num_layers)]


def linear_allocation(total: int, num_layers: int, k_orig: int, ascending: bool) -> list[int]:
    """K_l on a straight line through depth (as steep as [1, K] allows), rounded by largest
    remainder so the sum is exactly `total`."""
    mean = total / num_layers
    half = min(mean - 1, k_orig - mean)
    slope = [(-1 + 2 * i / (num_layers - 1)) if num_layers > 1 else 0.0 for i in range(num_layers)]
    target = [min(k_orig, max(1.0, mean + half * (s if ascending else -s))) for s in slope]
    ks = [math.floor(t) for t in target]
    order = sorted(range(num_layers), key=lambda i: (-(target[i] - ks[i]), i))
    for i in order[: total - sum(ks)]:
        ks[i] += 1
    return ks


def _fingerprint(profile, model) -> dict[str, Any]:
    if model is not None:
        fingerprint = model_fingerprint(model)
        if profile is not None:
            check_fingerprint(profile.get("model", {}), fingerprint, "the profile")
        return fingerprint
    if profile is not None:
        return profile["model"]
    raise AllocMoeError("neither a model nor a profile was given; pass model= (allocmoe.load_model) or profile= "
                        "(allocmoe.profile_sensitivity), which say what the plan is for")


def _plan(fingerprint, policies: list, method: str, budget: Budget, **details) -> Plan:
    layers = dict(zip(fingerprint["moe_layers"], policies))
    return Plan(model=fingerprint, layers=layers, method=method, budget=budget.activations_per_token,
                provenance={"details": details} if details else {})


def _alloc_t(k: float, config: AllocateConfig, k_base: int | None = None) -> AllocT:
    base = config.k_base if k_base is None else k_base
    return AllocT(k=k, k_base=min(base, int(math.floor(k))), pool=config.pool)


# -- model-based profiles ------------------------------------------------------------------------
@torch.no_grad()
def lexi_deviation(model, samples: int = 512, seed: int = 0, progress: bool = False) -> list[list[float]]:
    """LExI: for each MoE layer alone, mean over Gaussian inputs of ||Y_k(x) - Y_K(x)||, k = 1..K.
    `progress` shows a bar over the L*K layer passes."""
    fingerprint = model_fingerprint(model)
    from ..routing.adapters import adapter_for_model

    layers = adapter_for_model(model).moe_layers(model)
    k_orig = fingerprint["k_orig"]
    param = next(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    table = []
    with tqdm(total=len(layers) * k_orig, desc="lexi", unit="pass", disable=not progress) as bar:
        for layer in layers:
            x = torch.randn(1, samples, hidden, generator=gen).to(param.device, param.dtype)    # [1, N, H]
            outputs = []
            for k in range(1, k_orig + 1):
                ks = {index.index: (k if index.index == layer.index else k_orig) for index in layers}
                with apply_plan(model, static_plan(model, ks)):
                    y = layer.block(x)
                outputs.append((y[0] if isinstance(y, tuple) else y).float().squeeze(0))    # [N, H]
                bar.update(1)
            full = outputs[-1]
            table.append([float((y - full).norm(dim=-1).mean()) for y in outputs])
    return table


class _CandidateRecorder:
    """Collects each layer's sorted candidate probabilities during a full-K calibration pass."""

    def __init__(self):
        self.by_layer: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer, cand_idx, cand_probs, counts, valid):
        self.by_layer.setdefault(layer, []).append(cand_probs[valid].float().cpu())

    def tables(self) -> dict[int, torch.Tensor]:
        return {layer: torch.cat(parts) for layer, parts in self.by_layer.items()}


def _calibration_windows(model, tokenizer, calib_text: str | None, config: AllocateConfig) -> torch.Tensor:
    if calib_text is None or tokenizer is None:
        raise AllocMoeError("this method needs calibration text and a tokenizer")
    default = AllocateConfig.model_fields["calib_tokens"].default     # "up to": a shorter text is fine
    windows = tokenize_windows(tokenizer, calib_text, window_len(model, config.seq_len), config.calib_tokens,
                               beyond=None if config.calib_tokens == default
                               else "calib_tokens (--calib-tokens)")
    check_batch_size(windows, config.windows_per_pass)
    return windows


@torch.no_grad()
def _candidate_tables(model, windows, config: AllocateConfig, desc: str = "calibrate") -> dict[int, torch.Tensor]:
    """One full-K pass over the calibration windows (a bar over its batches), recording candidates."""
    fingerprint = model_fingerprint(model)
    recorder = _CandidateRecorder()
    device = next(model.parameters()).device
    with apply_plan(model, static_plan(model, [fingerprint["k_orig"]] * fingerprint["num_moe_layers"])) as handle:
        handle.context.recorders.append(recorder)
        with tqdm(windows.split(config.windows_per_pass), desc=desc, unit="batch", disable=not config.progress) as bar:
            for batch in bar:
                model(input_ids=batch.to(device))
    return recorder.tables()


def _bisect(mean_count, target: float, lo: float, hi: float, increasing: bool, steps: int = 50) -> float:
    """Threshold t in [lo, hi] with mean_count(t) closest to target (mean_count monotone in t)."""
    best_t, best_err = lo, math.inf
    for _ in range(steps):
        mid = (lo + hi) / 2
        value = mean_count(mid)
        if abs(value - target) < best_err:
            best_t, best_err = mid, abs(value - target)
        if (value < target) == increasing:
            lo = mid
        else:
            hi = mid
    return best_t


def calibrate_top_p(tables: dict[int, torch.Tensor], budget: Budget) -> tuple[float, float]:
    """One global p so the summed mean activations over layers match B; returns (p, measured)."""
    valid = torch.ones(1, dtype=torch.bool)

    def total(p):
        return sum(float(TopP(p).counts(t, valid.expand(t.size(0)), 1).float().mean()) for t in tables.values())

    p = _bisect(total, budget.activations_per_token, 1e-6, 1.0, increasing=True)
    return p, total(p)


def calibrate_naee(table: torch.Tensor, target: float) -> tuple[float, float]:
    """beta for one layer so its mean activations match `target`; returns (beta, measured)."""
    valid = torch.ones(table.size(0), dtype=torch.bool)

    def mean(beta):
        return float(NaeeSkip(beta).counts(table, valid, 1).float().mean())

    beta = _bisect(mean, target, 0.0, 1.0, increasing=False)
    return beta, mean(beta)


# -- what needs the weights ----------------------------------------------------------------------
def weights_reason(method: str, *, profile_given: bool, target_ppl, substitute: bool, refine: int) -> str | None:
    """Why an allocation needs the model's weights (it runs the model), or None when the model's config
    (with a profile, for alloc-moe and alloc-l) is all it reads."""
    if target_ppl is not None:
        return "a perplexity target (--target-ppl) scores plans on calibration text"
    if method in ("top-p", "naee"):
        return f"method {method} calibrates its thresholds on calibration text"
    if method == "lexi":
        return "method lexi measures each MoE layer's output on random inputs"
    if method == "auto":
        return "method auto scores its trials on calibration text"
    if method in PROFILE_METHODS and not profile_given:
        return f"method {method} without a profile (--profile) profiles the model first"
    if substitute:
        return "the substitute (--substitute) measures each expert's mean output"
    if refine:
        return "the refinement (--refine) scores calibration passes"
    return None


def weightless_message(path, reason: str) -> str:
    """The one line that refuses a run needing weights on a folder of config.json alone."""
    return (f"{path} has no weights (config.json alone), and {reason}, which needs the model's weights; run "
            f"allocate where the weights are, or use --method {', '.join(CONFIG_METHODS[:-1])} or "
            f"{CONFIG_METHODS[-1]} (or alloc-moe or alloc-l with --profile), which read only the config")


def _model_from_folder(model, method: str, profile_given: bool, target_ppl, config: AllocateConfig):
    """A model given as a folder (path or ModelSpec) as its weightless skeleton, for the runs that read
    only its config; a run that needs the weights is refused (a folder without them: weightless_message;
    one with them: load it first). Anything else is returned as given."""
    import os

    from ..models import ModelSpec, inspect_model

    if not isinstance(model, (str, os.PathLike, ModelSpec)):
        return model
    spec = model if isinstance(model, ModelSpec) else inspect_model(model, require_weights=False)
    substitute, refine = addons(method, config)
    # alloc-moe and alloc-l never profile here: without a profile allocate's own line refuses them
    reason = weights_reason(method, profile_given=profile_given or method in PROFILE_METHODS, target_ppl=target_ppl,
                            substitute=substitute, refine=refine)
    if reason is not None and not spec.has_weights:
        raise AllocMoeError(weightless_message(spec.path, reason))
    if reason is not None:
        raise AllocMoeError(f"allocate: {reason}, which needs the model loaded, not its folder; pass "
                            f"model=allocmoe.load_model({str(spec.path)!r})[0] and its tokenizer")
    return spec.skeleton()


# -- the entry point -----------------------------------------------------------------------------
# The expert means measured during one outermost allocate() call, keyed by the windows and the rank:
# a target's search makes a plan per budget and auto then refits, all from the same windows, and each
# measuring would otherwise be a full calibration pass over the same text (identical means each time).
_MEANS_MEMO: ContextVar[dict | None] = ContextVar("allocmoe_means_memo", default=None)


@contextmanager
def _means_memo() -> Iterator[None]:
    """Open the memo for an outermost allocate() call; nested calls share it; it closes with the call
    (so a model changed between two calls is measured afresh)."""
    if _MEANS_MEMO.get() is not None:
        yield
        return
    token = _MEANS_MEMO.set({})
    try:
        yield
    finally:
        _MEANS_MEMO.reset(token)


def allocate(budget: str | float | Budget | None = None, method: str = "auto", *, profile: dict | None = None,
             model=None, tokenizer=None, calib_text: str | None = None, config: AllocateConfig | dict | None = None,
             target_ppl: str | float | None = None, refine_memo: MutableMapping[str, float] | None = None) -> Plan:
    """Make a plan for `budget` (fraction "0.5", count "78", or a Budget) with `method`; or, with
    `target_ppl` ("5%" above the full model, or a perplexity) instead of a budget, the plan of the
    smallest budget that meets it on calibration text (calibrate/target.py; needs the model and text).
    `refine_memo` keeps the refinement's scored allocations (persist it to resume an interrupted run).
    `model` may be a model folder (a path or inspect_model's ModelSpec, even one of config.json alone)
    for the runs that read only its config (weights_reason: uniform, ascending, descending, alloc-t,
    and alloc-moe or alloc-l given a profile)."""
    with _means_memo():
        return _allocate(budget, method, profile, model, tokenizer, calib_text, config, target_ppl, refine_memo)


def _allocate(budget, method: str, profile, model, tokenizer, calib_text, config, target_ppl, refine_memo) -> Plan:
    """allocate(), inside its call's means memo."""
    config = checked_config(AllocateConfig, config)
    model = _model_from_folder(model, method, profile is not None, target_ppl, config)
    profile = _check_arguments(budget, method, profile, model, tokenizer, calib_text, target_ppl, refine_memo)
    if (budget is None) == (target_ppl is None):
        said = "both a budget and a perplexity target were given" if budget is not None else "no budget was given"
        raise AllocMoeError(f"{said}; give a budget (e.g. 0.5) or target_ppl (e.g. '5%'), one of the two")
    if method == "distinct":          # a budget of distinct experts per step, not of activations
        raise AllocMoeError("a distinct-expert budget is allocated by allocmoe.allocate_distinct(M, model=, "
                            "tokenizer=, calib_text=) (CLI: allocate --max-distinct-experts M); use that")
    if method not in METHODS:
        raise AllocMoeError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method in PROFILE_METHODS + ("auto",) and profile is None:
        raise AllocMoeError(f"method {method!r} needs a sensitivity profile; run `allocmoe profile` and pass "
                            "--profile (profile= in Python)")
    if method in MODEL_METHODS and model is None:
        raise AllocMoeError(f"method {method!r} needs the model; pass model= (allocmoe.load_model)")
    if method in K_BASE_METHODS:
        check_k_base(config.k_base, method, _fingerprint(profile, model)["k_orig"], budget, model, profile)
    substitute, refine = addons(method, config)
    if (substitute or refine) and method not in ADDON_METHODS:
        raise AllocMoeError(f"method {method!r} cannot take the substitute or the refinement (they need a "
                            f"budget-exact top-k allocation); use one of {', '.join(ADDON_METHODS)}")
    if (substitute or refine) and (model is None or tokenizer is None or calib_text is None):
        raise AllocMoeError(f"method {method!r} with the substitute or the refinement needs the model, its tokenizer "
                            "and calibration text (model=, tokenizer=, calib_text=); or turn them off "
                            "(--no-substitute --refine 0)")
    if target_ppl is not None and model is not None:
        from .target import check_target_reach

        check_target_reach(target_ppl, getattr(model.config, "vocab_size", None))
    if target_ppl is not None:      # after the method's own checks: the search scores a calibration pass first
        return _allocate_for_target(target_ppl, method, profile, model, tokenizer, calib_text, config)
    plan = _allocate_checked(budget, method, profile, model, tokenizer, calib_text, config, refine_memo)
    return _refitted(plan, model, tokenizer, calib_text, config)


def _allocate_checked(budget, method: str, profile, model, tokenizer, calib_text, config: AllocateConfig,
                      refine_memo=None, held_out: bool = False) -> Plan:
    """`method`'s plan for `budget`, once allocate's checks passed. Stand-ins that something is chosen
    with (auto's trials, a refinement; with `held_out`, the caller's own judging, a target's search) are
    cross-fitted: the plan carries those fitted on the even windows, and every choice is scored by
    `_judge` (calibrate/crossfit.py); the plan then records the split, and _refitted refits its
    stand-ins on all the windows."""
    substitute, refine = addons(method, config)
    fingerprint = _fingerprint(profile, model)
    if method == "auto":
        if not isinstance(budget, Budget):
            budget = Budget.parse(budget, fingerprint["num_moe_layers"], fingerprint["k_orig"])
        return _auto(budget, profile, model, _calibration_windows(model, tokenizer, calib_text, config), config,
                     refine_memo)
    if not substitute:          # nothing fitted: the refinement chooses on every window
        plan = _allocate_plain(budget, method, profile, model, tokenizer, calib_text, config)
        if not refine:
            return plan
        judge = _judge(model, _calibration_windows(model, tokenizer, calib_text, config), config, None)
        return _refined(plan, judge, config, refine, refine_memo)
    # the stand-ins are paid from the same budget: the activations get what they leave (core/budget.py)
    parsed = budget if isinstance(budget, Budget) else Budget.parse(budget, fingerprint["num_moe_layers"],
                                                                    fingerprint["k_orig"])
    experts = expert_budget(parsed, standin_per_slot(model, config), fingerprint["k_orig"])
    plan = _allocate_plain(experts, method, profile, model, tokenizer, calib_text, config)
    plan.budget = parsed.activations_per_token
    windows = _calibration_windows(model, tokenizer, calib_text, config)
    folds = _fold_means(model, windows, config) if refine or held_out else None
    plan.means = folds[0] if folds else _measure_means(model, windows, config)
    plan.standins = standin_costs(model, plan.means)
    if folds:
        plan.provenance = {**plan.provenance, "cross_fit": cross_fit_provenance(windows)}
    if not refine:
        return plan
    return _refined(plan, _judge(model, windows, config, folds), config, refine, refine_memo)


def _refitted(plan: Plan, model, tokenizer, calib_text, config: AllocateConfig) -> Plan:
    """`plan` with its stand-ins fitted for shipping, on all the calibration windows, for the same layers at
    the same cost: where they were fitted on half the windows (cross-fitting), refitted on all of them (calibrate/
    crossfit.py refit); then, with standin_fit "skipped", refitted on the slots the plan skips
    (calibrate/means.py fit_skipped_standins). The choices made stand: neither fit chooses anything."""
    if plan.means is None:
        return plan
    windows = _calibration_windows(model, tokenizer, calib_text, config)

    def costs(means):
        return standin_costs(model, means)

    if "cross_fit" in plan.provenance:
        plan = refit(plan, _measure_means(model, windows, config, plan.means.rank), windows, costs)
    if config.standin_fit == "skipped":
        from .means import fit_skipped_standins

        plan = refit(plan, fit_skipped_standins(model, windows, plan, config.windows_per_pass, config.progress),
                     windows, costs, record="standin_fit")
        plan.provenance["standin_fit"]["fit"] = SKIPPED_FIT
    return plan


SKIPPED_FIT = ("each expert on the slots the plan skips, weighted by gate^2, on the plan's inputs (bottom-up); "
               "an expert skipped on fewer than H slots keeps its fit on every routed token")


K_BASE_METHODS = ("alloc-moe", "alloc-t", "auto")      # the methods that read k_base (and pool)


def check_k_base(k_base: int, method: str, k_orig: int, budget, model, profile) -> None:
    """Refuse a k_base the plan could not keep: above the model's K, or (alloc-t, whose every layer gets
    B/L) above the experts per token a layer gets at a budget as typed. alloc-moe's layers get
    different k_l, so a layer whose k_l is below k_base keeps k_l (its policy records the k_base used)."""
    if k_base > k_orig:
        raise AllocMoeError(f"k_base (--k-base) {k_base} is above this model's K = {k_orig} experts per token; "
                            f"give a value in 1..{k_orig}")
    if method == "alloc-t" and budget is not None and not isinstance(budget, Budget):
        fingerprint = _fingerprint(profile, model)
        parsed = Budget.parse(budget, fingerprint["num_moe_layers"], k_orig)
        most = int(math.floor(parsed.per_layer + 1e-9))
        if k_base > most:
            raise AllocMoeError(f"k_base (--k-base) {k_base} is above the {most} expert(s) per token each MoE layer "
                                f"gets at budget {budget} with alloc-t; give a value in 1..{most}, or a larger budget")


def _check_arguments(budget, method, profile, model, tokenizer, calib_text, target_ppl, refine_memo):
    """allocate's arguments at the door (types, the text, the profile); returns the profile as a checked
    dict (a path is loaded, with `model` checked against it)."""
    import os
    from collections.abc import MutableMapping as Mutable

    from ..core.config import check_argument, check_model_argument, check_tokenizer_argument
    from ..models import ModelSpec
    from ..texts import check_text

    if not isinstance(budget, Budget):
        check_argument("allocate", "budget", budget, str | int | float | None,
                       "a fraction (0.5, '1/2', '50%'), a count (78) or a Budget", finite=False)
    check_argument("allocate", "method", method, str, f"one of {', '.join(METHODS)}")
    check_argument("allocate", "target_ppl", target_ppl, str | int | float | None, "'5%' or a perplexity like 157.0",
                   finite=False)
    if model is not None:
        check_model_argument("allocate", model, folder=(ModelSpec,))
    check_tokenizer_argument("allocate", tokenizer, optional=True)
    if calib_text is not None:
        check_text(calib_text, "allocate: calib_text")
    if refine_memo is not None and not isinstance(refine_memo, Mutable):
        raise AllocMoeError(f"allocate: refine_memo must be a dict-like mapping, got {type(refine_memo).__name__}; "
                            "give a dict (or leave it out)")
    if profile is None:
        return None
    from .profile import checked_profile, load_profile

    if isinstance(profile, (str, os.PathLike)):
        return load_profile(profile, model)
    if isinstance(profile, dict):
        return checked_profile(profile, "allocate: profile")
    raise AllocMoeError(f"allocate: profile must be a profile (the dict profile_sensitivity returns) or a profile "
                        f"file's path, got {type(profile).__name__}; run allocmoe.profile_sensitivity or give a path")


def addons(method: str, config: AllocateConfig) -> tuple[bool, int]:
    """(substitute on, refinement passes) as `method` runs them under `config`."""
    if method == "auto":
        return config.substitute is not False, AUTO_REFINE if config.refine is None else config.refine
    return bool(config.substitute), config.refine or 0


def _calib_ppl(model, plan: Plan, windows, config: AllocateConfig) -> float:
    with apply_plan(model, plan):
        return evaluate_perplexity(model, None, "", {"windows_per_pass": config.windows_per_pass, "progress": False},
                                   windows=windows).perplexity


def _judge(model, windows, config: AllocateConfig, fold_means: tuple | None) -> Callable[[Plan], float]:
    """How every choice scores a plan: its perplexity on all calibration `windows`, each window scored
    with stand-ins fitted on the other half where the plan carries them (`fold_means`, from _fold_means;
    calibrate/crossfit.py held_out_perplexity). None: nothing fitted, all windows at once."""
    def perplexity(plan: Plan, scored) -> float:
        return _calib_ppl(model, plan, scored, config)

    if fold_means is None:
        return lambda plan: perplexity(plan, windows)
    return lambda plan: held_out_perplexity(plan, fold_means, windows, perplexity)


def _fold_means(model, windows, config: AllocateConfig, rank: int | None = None) -> tuple:
    """(stand-ins fitted on the even calibration windows, on the odd ones), at `rank` (None: substitute_rank):
    the two folds (calibrate/crossfit.py)."""
    return tuple(_measure_means(model, part, config, rank) for part in split_windows(windows))


def _auto_menu_ranks(config: AllocateConfig, model) -> list[int]:
    """The stand-in ranks auto's (k, stand-in) menu offers a layer: menu_ranks with rank_menu, else
    substitute_rank alone."""
    if config.rank_menu:
        return menu_ranks(config.substitute_rank, int(model.config.hidden_size))
    return [config.substitute_rank]


def _fit_rank(method: str, config: AllocateConfig, model) -> int:
    """The rank the folds' stand-ins are fitted at, cut to each plan's ranks when scored: the largest of
    auto's menu where it runs (the substitute left to auto), else substitute_rank."""
    if method == "auto" and config.substitute is None:
        return max(_auto_menu_ranks(config, model))
    return config.substitute_rank


def standin_per_slot(model, config: AllocateConfig) -> float:
    """What one of `config`'s stand-ins (rank substitute_rank) costs per skipped slot on `model`, in
    activation-equivalents (core/budget.py)."""
    return standin_equivalent(int(model.config.hidden_size), expert_weights(model), config.substitute_rank)


def _measure_means(model, windows, config: AllocateConfig, rank: int | None = None):
    """The expert means on `windows` at `rank` (None: substitute_rank), measured once per outermost
    allocate() call (_MEANS_MEMO)."""
    from .means import measure_expert_means

    rank = config.substitute_rank if rank is None else rank
    memo = _MEANS_MEMO.get()
    key = (id(model), windows_digest(windows), config.windows_per_pass, rank)
    if memo is not None and key in memo:
        return memo[key]
    means = measure_expert_means(model, windows, config.windows_per_pass, progress=config.progress, rank=rank)
    if memo is not None:
        memo[key] = means
    return means


def _refined(plan: Plan, judge: Callable[[Plan], float], config: AllocateConfig, passes: int, memo) -> Plan:
    from .refine import refine_allocation

    def fits(ks: dict[int, float]) -> bool:       # a move between layers with and without stand-ins changes the cost
        return sum(plan_costs(ks, plan.k_orig, plan.standins or {}).values()) <= plan.budget + 1e-9

    refined, done = refine_allocation(plan, judge, passes,
                                      config.k_base, memo=memo, progress=config.progress, fits=fits)
    refined.provenance = {**plan.provenance, "details": {**plan.provenance.get("details", {}), "refine": done}}
    return refined


def _allocate_plain(budget, method: str, profile, model, tokenizer, calib_text, config: AllocateConfig) -> Plan:
    """The method's own plan, without add-ons."""
    fingerprint = _fingerprint(profile, model)
    num_layers, k_orig = fingerprint["num_moe_layers"], fingerprint["k_orig"]
    if not isinstance(budget, Budget):
        budget = Budget.parse(budget, num_layers, k_orig)
    total = int(math.floor(budget.activations_per_token + 1e-9))

    if method == "uniform":
        return _plan(fingerprint, [StaticTopK(k) for k in spread_evenly(total, num_layers)], method, budget)
    if method in ("ascending", "descending"):
        ks = linear_allocation(total, num_layers, k_orig, ascending=method == "ascending")
        return _plan(fingerprint, [StaticTopK(k) for k in ks], method, budget)
    if method == "alloc-t":
        policy = _alloc_t(budget.per_layer, config)
        return _plan(fingerprint, [policy] * num_layers, method, budget, k_base=policy.k_base)
    if method in PROFILE_METHODS:
        ks = solve_allocation(profile["sensitivity"], budget.activations_per_token)
        if method == "alloc-l":
            return _plan(fingerprint, [StaticTopK(k) for k in ks], method, budget)
        return _plan(fingerprint, [_alloc_t(k, config) for k in ks], method, budget, k_base=config.k_base)
    if method == "lexi":
        deviation = lexi_deviation(model, config.lexi_samples, config.seed, progress=config.progress)
        ks = solve_allocation(deviation, budget.activations_per_token)
        return _plan(fingerprint, [StaticTopK(k) for k in ks], method, budget, deviation=deviation)

    windows = _calibration_windows(model, tokenizer, calib_text, config)
    if method == "top-p":
        p, measured = calibrate_top_p(_candidate_tables(model, windows, config, desc="top-p"), budget)
        return _plan(fingerprint, [TopP(p=round(p, 6), k=None)] * num_layers, method, budget,
                     calibrated_activations_per_token=round(measured, 4))
    if method == "naee":
        tables = _candidate_tables(model, windows, config, desc="naee")
        policies = []
        for index in fingerprint["moe_layers"]:
            beta, measured = calibrate_naee(tables[index], budget.per_layer)
            policies.append(NaeeSkip(beta=round(beta, 6), k=round(measured, 4)))
        return _plan(fingerprint, policies, method, budget)
    raise AssertionError(method)


def _allocate_for_target(target_ppl, method: str, profile, model, tokenizer, calib_text,
                         config: AllocateConfig) -> Plan:
    """Bisect over whole total budgets (activations plus stand-ins, core/budget.py) for the smallest whose
    `method` plan meets the target on the calibration windows, cross-fitted where the plans carry
    stand-ins (calibrate/crossfit.py, calibrate/target.py)."""
    from .target import parse_target, smallest_budget, target_provenance

    if model is None:
        raise AllocMoeError("a perplexity target needs the model (and calibration text) to score plans; "
                            "pass model=, tokenizer= and calib_text=")
    windows = _calibration_windows(model, tokenizer, calib_text, config)
    fitted = addons(method, config)[0]            # stand-ins: judged on text they were not fitted on
    score = {"windows_per_pass": config.windows_per_pass, "progress": False}
    full_ppl = evaluate_perplexity(model, None, "", score, windows=windows).perplexity
    target = parse_target(target_ppl, full_ppl)
    fingerprint = _fingerprint(profile, model)
    num_layers, k_orig = fingerprint["num_moe_layers"], fingerprint["k_orig"]
    inner = replaced(config, progress=False)          # one bar for the search, none per step
    judge = _judge(model, windows, inner, _fold_means(model, windows, inner, _fit_rank(method, config, model))
                   if fitted else None)
    plans: dict[int, Plan] = {}
    steps = max(1, math.ceil(math.log2(num_layers * (k_orig - 1) + 1))) + 1
    bar = tqdm(total=steps, desc=f"target ppl {target:.4g}", unit="budget", disable=not config.progress)

    def plan_at(count: int) -> Plan:
        # a Budget, not the bare count: Budget.parse reads a count <= 1 as a fraction (1 -> the full budget)
        return _allocate_checked(Budget(float(count), num_layers * k_orig, num_layers), method, profile, model,
                                 tokenizer, calib_text, inner, held_out=True)

    def ppl_at(count: int) -> float:
        plans[count] = plan_at(count)
        return judge(plans[count])

    least = None
    if fitted and method != "auto":     # stand-ins on every layer: one expert each must fit
        least = math.ceil(num_layers * (1 + (k_orig - 1) * standin_per_slot(model, config)) - 1e-9)
    try:
        found, tried = smallest_budget(num_layers, k_orig, target, full_ppl, ppl_at,
                                       lambda count, ppl: (bar.update(1), bar.set_postfix_str(f"B={count}: {ppl:.4g}")),
                                       least=least)
    finally:
        bar.close()
    plan = _refitted(plans.get(found) or plan_at(found), model, tokenizer, calib_text, inner)
    plan.provenance = {**plan.provenance, "target": target_provenance(
        target_ppl, target, full_ppl, found, tried, scored_tokens(windows), plan.cost(),
        "all calibration windows, cross-fitted (calibrate/crossfit.py)" if fitted else "all calibration windows")}
    return plan


def _auto(budget: Budget, profile, model, windows, config: AllocateConfig, refine_memo=None) -> Plan:
    """Try alloc-moe, alloc-l and alloc-t (k_base 0..2), each with and without the substitute (its
    stand-ins paid from B), and the (k, stand-in rank) DP's allocation as alloc-l and alloc-moe; keep
    the best, then refine it. With stand-ins, cross-fitted (calibrate/crossfit.py): every choice (trial,
    move, remainder) is scored by `_judge`, each window with stand-ins fitted on the other half; the
    (k, rank) menu's profile is measured on the odd windows with those fitted on the even ones."""
    substitute, refine = addons("auto", config)
    candidates = [("alloc-l", None)]
    for k_base in sorted({0, 1, 2, config.k_base}):
        if k_base <= budget.per_layer:
            candidates += [("alloc-moe", k_base), ("alloc-t", k_base)]
    menu = substitute and config.substitute is None              # where stand-ins pay, per layer (at what rank)
    fold_means = _fold_means(model, windows, config, _fit_rank("auto", config, model)) if substitute else None
    means = fold_means[0].truncated({i: config.substitute_rank for i in fold_means[0].means}) if substitute else None
    judge = _judge(model, windows, config, fold_means)          # the plans carry fold 1's; the judge swaps per fold
    made = _auto_trials(budget, profile, model, config, means, candidates)
    if menu:
        made += [{"method": method, "k_base": k_base, "substitute": plan.means is not None, "menu": name,
                  "k_per_layer": [p.k for _, p in sorted(plan.layers.items())],
                  "standin_layers": sorted(plan.standins),
                  "standin_ranks": {str(i): r for i, r in sorted((plan.means.ranks if plan.means else {}).items())},
                  "plan": plan}
                 for name, method, k_base, plan in _menu_trials(budget, model, split_windows(windows)[1], config,
                                                                fold_means[0], _auto_menu_ranks(config, model),
                                                                candidates)]
    trials = _scored(made, judge, config)
    best = min(trials, key=lambda t: t["calibration_perplexity"])
    plan = best["plan"]
    plan.method = "auto"
    plan.provenance = {"details": {"chosen": {k: v for k, v in best.items() if k not in ("plan", "calibration_perplexity")},
                                   "trials": [{k: v for k, v in t.items() if k != "plan"} for t in trials]}}
    if substitute:
        plan.provenance["cross_fit"] = cross_fit_provenance(windows)
    if refine:
        chosen_config = AllocateConfig(**{**config.model_dump(), "k_base": config.k_base if best["k_base"] is None
                                          else best["k_base"]})
        plan = _refined(plan, judge, chosen_config, refine, refine_memo)
    scored = plan.provenance["details"].get("refine", best)        # the plan's own score, already taken
    return _filled(plan, judge, config, budget, scored["calibration_perplexity"])


def _filled(plan: Plan, judge: Callable[[Plan], float], config: AllocateConfig, budget: Budget,
            start: float) -> Plan:
    """auto's plan (scored `start` by `judge`) with the budget whole k left given to the layer where it
    helps most by `judge` (calibrate/refine.py fill_remainder); provenance.details.remainder says what
    was tried."""
    from .refine import fill_remainder

    filled, record = fill_remainder(plan, judge, budget.activations_per_token, config.pool, config.progress,
                                    start=start)
    filled.provenance = {**plan.provenance, "details": {**plan.provenance.get("details", {}), "remainder": record}}
    return filled


def _auto_trials(budget: Budget, profile, model, config: AllocateConfig, means, candidates) -> list[dict]:
    """auto's trials of each candidate (method, k_base): with stand-ins on every layer (`means`, paid
    from B), without, or both, as the config and B allow; each unscored."""
    substitute = means is not None
    modes = [False, True] if substitute and config.substitute is None else [bool(substitute)]
    budgets = {False: budget}
    if substitute:        # trials with stand-ins on every layer pay for them from B: the activations get the rest
        try:
            budgets[True] = expert_budget(budget, standin_per_slot(model, config), model_fingerprint(model)["k_orig"])
        except AllocMoeError:
            if config.substitute:
                raise
            modes = [False]   # B cannot hold one expert per layer and their stand-ins: try without
    made = []
    for method, k_base in candidates:
        trial_config = AllocateConfig(**{**config.model_dump(), "k_base": config.k_base if k_base is None else k_base,
                                         "substitute": False, "refine": 0})
        for with_means in modes:
            plan = allocate(budgets[with_means], method, profile=profile, model=model, config=trial_config)
            plan.budget = budget.activations_per_token
            plan.means = means if with_means else None
            plan.standins = standin_costs(model, means) if with_means else {}
            made.append({"method": method, "k_base": k_base, "substitute": with_means, "plan": plan})
    return made


def _scored(trials: list[dict], judge: Callable[[Plan], float], config: AllocateConfig) -> list[dict]:
    """auto's trials, each with its calibration perplexity by `judge` (a bar over them)."""
    with tqdm(total=len(trials), desc="auto", unit="trial", disable=not config.progress) as bar:
        for trial in trials:
            bar.set_postfix_str(trial["method"] + (f" k_base={trial['k_base']}" if trial["k_base"] is not None else "")
                                + (" +substitute" if trial["substitute"] else "")
                                + (f" ({trial['menu']})" if "menu" in trial else ""))
            trial["calibration_perplexity"] = round(judge(trial["plan"]), 6)
            bar.update(1)
    return trials


def menu_ranks(rank: int, hidden: int) -> list[int]:
    """The stand-in ranks auto's (k, rank) menu (rank_menu) offers a layer around `rank` (substitute_rank):
    the mean alone, half, the rank itself and twice it (at most the hidden size). On four small families
    at a third of the budget its pick beat every one-rank trial by 1.2-4.1 calibration perplexity on
    three of them, yet over the 20 quality cells it lost on test text (docs/quality.md): off by default."""
    return sorted({0, rank // 2, rank, min(2 * rank, hidden)})


def menu_choice(table: dict[str, Any], standins: dict[int, dict[int, float]], moe_layers: list[int], k_orig: int,
                budget: float) -> tuple[list[int], dict[int, int]]:
    """(k per MoE layer, {MoE layer given stand-ins: their rank}): the exact DP over each layer's menu of
    (k, no stand-in) and (k, rank r) for every rank r of the (k, rank) profile (calibrate/pairs.py:
    table["plain"], table["standin"][r]); costs k, plus K_orig - k stand-ins at the layer's per-slot cost
    at rank r (`standins[r][layer]`); the summed cost within `budget`."""
    from ..core.solver import solve_menu_allocation

    ranks = sorted(table["standin"])
    losses = [table["plain"][i] + [x for r in ranks for x in table["standin"][r][i]] for i in range(len(moe_layers))]
    costs = [[float(k) for k in range(1, k_orig + 1)]
             + [layer_cost(k, k_orig, standins[r].get(index, 0.0)) for r in ranks for k in range(1, k_orig + 1)]
             for index in moe_layers]
    choice = solve_menu_allocation(losses, costs, budget)
    ks = [j % k_orig + 1 for j in choice]
    return ks, {index: ranks[j // k_orig - 1] for index, j in zip(moe_layers, choice)
                if j >= k_orig and j % k_orig + 1 < k_orig}


def _menu_trials(budget: Budget, model, windows, config: AllocateConfig, means, ranks: list[int],
                 candidates) -> list[tuple]:
    """auto's trials from the (k, stand-in) DPs (`means` fitted at the largest of `ranks`, cut to each):
    (menu, method, k_base, plan) for alloc-l and each alloc-moe k_base of `candidates`, each allocation
    run as static top-k or with Alloc-T. Two menus, both from the one profile: stand-ins at
    substitute_rank or none ("k x stand-in"), and every rank of `ranks` ("k x stand-in rank"; skipped
    where it gives the same allocation). Both, because the profile scores each layer alone: the richer
    menu's pick is not always the better plan (Qwen3-MoE at half: 170.95 against 170.62 cross-fitted),
    and auto keeps whichever scores best."""
    from .pairs import pair_profile

    fingerprint = model_fingerprint(model)
    menu = {r: means.truncated({i: r for i in means.means}) for r in ranks}
    table = pair_profile(model, windows, menu, config.windows_per_pass, config.progress)
    prices = {r: standin_costs(model, m) for r, m in menu.items()}
    one_rank = {**table, "standin": {config.substitute_rank: table["standin"][config.substitute_rank]}}
    picks = {}
    for name, profile in (("k x stand-in", one_rank), ("k x stand-in rank", table)):
        pick = menu_choice(profile, prices, fingerprint["moe_layers"], fingerprint["k_orig"],
                           budget.activations_per_token)
        if pick not in picks.values():
            picks[name] = pick
    trials = []
    for name, (ks, given) in picks.items():
        for method, k_base in candidates:
            if method == "alloc-t":
                continue
            policies = ([StaticTopK(k) for k in ks] if method == "alloc-l"
                        else [_alloc_t(k, config, k_base) for k in ks])
            plan = _plan(fingerprint, policies, method, budget, menu=name, standin_layers=sorted(given))
            plan.means = means.truncated(given) if given else None
            plan.standins = standin_costs(model, plan.means)
            trials.append((name, method, k_base, plan))
    return trials
