"""`evaluate_model`: the eval command in one call (a model folder, an optional plan, a text, optional tasks)."""

from __future__ import annotations

import os
from typing import Any

from ...routing.apply import apply_plan, static_plan
from ...scoring.perplexity import (PerplexityConfig, check_batch_size, check_decode_batch, evaluate_perplexity,
                                   tokenize_windows, window_len)
from ...models import inspect_model
from ...core.plan import Plan
from ...routing.layout import check_plan, model_fingerprint
from ...errors import AllocMoeError
from ...texts import read_text


def evaluate_model(model: str | os.PathLike | None = None, plan: str | os.PathLike | Plan | None = None,
                   text: str | os.PathLike | None = None, seq_len: int | None = None,
                   eval_tokens: int | None = None, windows_per_pass: int = 4,
                   trust_remote_code: bool = False, tasks: list[str] | None = None,
                   task_options: dict[str, Any] | None = None, progress: bool = True,
                   decode_batch: int | None = None, *, config: PerplexityConfig | dict | None = None,
                   **deprecated: Any) -> dict[str, Any]:
    """Perplexity of a model folder (default: built-in) with an optional plan, on a text file
    (default: the built-in test split); with `tasks`, also lm-eval task metrics (the [eval] extra)
    and each item's scores, which `allocmoe compare` pairs up. Returns the JSON-ready result.

    `decode_batch` B scores the text as B sequences decoded side by side (PerplexityConfig), and adds
    what each decode step loads: `distinct_experts_per_step` (mean over steps and MoE layers),
    `max_distinct_experts_per_step` (the most any layer loaded in any step), per layer, and where a
    distinct-expert budget runs, how often a token's own top-1 fell outside the step's chosen set.
    Without a plan the model is counted under a full top-K_orig plan (the unmodified selection).

    The scoring settings come as keywords (`seq_len`, `eval_tokens`, `windows_per_pass`, `progress`,
    `decode_batch`) or as one `config` (a PerplexityConfig or its dict), not both; `max_tokens` and
    `batch_size` are the deprecated names of `eval_tokens` and `windows_per_pass`.

    Every input is checked before the weights load (text, plan file, model folder, the plan and
    `seq_len` against the model's layout, task names), and the text's length before the first pass."""
    from .harness import check_task_options

    _check_arguments(trust_remote_code, tasks, task_options)
    config = _scoring_config(config, {"seq_len": seq_len, "eval_tokens": eval_tokens,
                                      "windows_per_pass": windows_per_pass, "progress": progress,
                                      "decode_batch": decode_batch}, deprecated)
    decode_batch = config.decode_batch
    options = dict(task_options or {})
    check_task_options(tasks, **options)
    body, text_name = read_text(text, "test")
    if plan is not None:
        from ...routing.apply import as_plan

        plan = as_plan(plan, "evaluate_model")
    spec = inspect_model(model, trust_remote_code)
    windows, fill = _checked_against_model(spec, plan, body, tasks, options, config)
    net, tok = spec.load()
    fingerprint = model_fingerprint(net)
    full = float(fingerprint["num_moe_layers"] * fingerprint["k_orig"])
    counted = plan if plan is not None or decode_batch is None else \
        static_plan(net, [fingerprint["k_orig"]] * fingerprint["num_moe_layers"], method="full")
    handle = apply_plan(net, counted) if counted is not None else None
    try:
        result = evaluate_perplexity(net, tok, body, config, windows=windows)
        steps = _decode_steps(handle, decode_batch, fill) if decode_batch else {}
        if handle is None:
            measured, per_layer = full, {str(i): float(fingerprint["k_orig"]) for i in fingerprint["moe_layers"]}
            measured_cost = full
        else:
            measured = handle.activations_per_token()
            per_layer = {str(i): v for i, v in handle.layer_activations().items()}
            measured_cost = counted.measured_cost(handle.layer_activations())
        task_results = task_items = None
        if tasks:
            from .harness import score_tasks

            task_results, task_items = score_tasks(net, tok, tasks, batch_size=config.windows_per_pass, **options)
    finally:
        if handle is not None:
            handle.remove()
    extra = {"tasks": task_results, "task_items": task_items} if tasks else {}
    return {**result.to_dict(), **extra, "activations_per_token": measured, "full_activations_per_token": full,
            "budget_fraction_measured": measured / full, "activations_per_layer": per_layer, **steps,
            "cost_per_token": measured_cost,
            "plan": None if plan is None else {"method": plan.method, "budget": plan.budget, "cost": plan.cost()},
            "text": text_name, "model": fingerprint}


def _check_arguments(trust_remote_code, tasks, task_options) -> None:
    """evaluate_model's arguments that are not the scoring config, by type."""
    from ...core.config import check_argument

    if isinstance(tasks, str):
        raise AllocMoeError(f"evaluate_model: tasks must be a list of task names, got the string {tasks!r}; give "
                            f"[{tasks!r}]")
    check_argument("evaluate_model", "trust_remote_code", trust_remote_code, bool)
    check_argument("evaluate_model", "tasks", tasks, list[str] | tuple[str, ...] | None, "a list of task names")
    check_argument("evaluate_model", "task_options", task_options, dict | None, "a dict of lm-eval options")


def _checked_against_model(spec, plan, body: str, tasks, options: dict, config: PerplexityConfig):
    """Before the weights load: the plan and --seq-len against the model's layout, the task names, the
    text cut into windows (long enough, and enough windows for --windows-per-pass or --decode-batch).
    Returns (windows, the top-up windows a decode batch adds)."""
    skeleton = spec.skeleton()
    window = window_len(skeleton, config.seq_len)
    if plan is not None:
        check_plan(plan, skeleton)
    if tasks:
        from .harness import check_tasks

        check_tasks(tasks, options.get("include_path"))
    windows = tokenize_windows(spec.tokenizer(), body, window, config.eval_tokens,  # too short: before the weights
                               beyond="eval_tokens (--eval-tokens)")
    if config.decode_batch is None:
        check_batch_size(windows, config.windows_per_pass)
    return windows, check_decode_batch(windows, config.decode_batch)


_DEFAULTS = {"seq_len": None, "eval_tokens": None, "windows_per_pass": 4, "progress": True, "decode_batch": None}


def _scoring_config(config, keywords: dict[str, Any], deprecated: dict[str, Any]) -> PerplexityConfig:
    """evaluate_model's PerplexityConfig: `config` as given, or one made of its keywords (those left at
    their defaults when `config` is given; the deprecated `max_tokens` / `batch_size` renamed, warning)."""
    from ...core.config import checked_config, renamed

    unknown = sorted(set(deprecated) - set(PerplexityConfig.__config_aliases__))
    if unknown:
        raise AllocMoeError(f"evaluate_model got unexpected keyword(s) {unknown}; see help(allocmoe.evaluate_model)")
    deprecated = renamed(PerplexityConfig, deprecated)
    given = {name: value for name, value in keywords.items() if value is not _DEFAULTS[name]}
    twice = sorted(set(given) & set(deprecated))
    if twice:
        raise AllocMoeError(f"evaluate_model got {twice} under the old and the new name; give the new name alone")
    given.update(deprecated)
    if config is not None:
        if given:
            raise AllocMoeError(f"evaluate_model got config= and {sorted(given)}; give the scoring settings in "
                                "config alone, or as keywords alone")
        return checked_config(PerplexityConfig, config)
    return PerplexityConfig(**{**keywords, **deprecated})


def _decode_steps(handle, decode_batch: int, fill: int) -> dict[str, Any]:
    """The decode-step counters of an `eval --decode-batch` pass, JSON-ready."""
    outside = handle.top1_outside_rate()
    return {"decode_batch": decode_batch, "top_up_windows": fill,
            "distinct_experts_per_step": handle.distinct_experts_per_step(),
            "max_distinct_experts_per_step": handle.max_distinct_experts_per_step(),
            "distinct_experts_per_layer": {str(i): v for i, v in handle.layer_distinct_experts().items()},
            "top1_outside_chosen_rate": sum(outside.values()) / len(outside) if outside else None,
            "top1_outside_chosen_per_layer": {str(i): v for i, v in outside.items()}}
