"""Task accuracy through lm-evaluation-harness (optional extra: pip install "allocmoe[eval]").

`run_tasks` wraps the live model, with whatever plan is applied, in lm-eval's HFLM (taught to
mask its right-padding, so pads never reach a plan's routers) and runs the given tasks; the offline
suite shipped in builtin/tasks is always on the include path. Importing
this module also registers the lm-eval model name "allocmoe" (`pretrained=...,plan=...`).

The shipped task YAMLs name their data as ${TASK_DIR}/file.jsonl; `offline_task_dir` writes copies
with the real folder filled in, so the suite works wherever allocmoe is installed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from ...errors import AllocMoeError
from ...texts import BUILTIN_TASKS as TASKS_DIR
from ...texts import OFFLINE_TASKS


def _lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise AllocMoeError('task evaluation needs lm-evaluation-harness: pip install "allocmoe[eval]"') from None
    return lm_eval, HFLM


def offline_task_dir() -> str:
    """A folder of the offline task YAMLs with their data paths filled in."""
    out = Path(tempfile.mkdtemp(prefix="allocmoe-tasks-"))
    for yaml_path in sorted(TASKS_DIR.glob("*.yaml")):
        text = yaml_path.read_text(encoding="utf-8").replace("${TASK_DIR}", str(TASKS_DIR))
        (out / yaml_path.name).write_text(text, encoding="utf-8")
    return str(out)


@functools.lru_cache(maxsize=None)
def _task_manager(include_path: str | None):
    """lm-eval's task index over the offline suite (and include_path); built once per process."""
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return TaskManager(include_path=[offline_task_dir()] + ([include_path] if include_path else []))


TASK_OPTIONS = {"num_fewshot": "--num-fewshot", "limit": "--limit", "include_path": "--include-path"}


def check_task_options(tasks, **options: Any) -> None:
    """Refuse lm-eval options that would be silently ignored: unknown ones, any given without tasks,
    and an include path that is not a folder. Cheap: neither lm-eval nor its task index is loaded."""
    unknown = sorted(set(options) - set(TASK_OPTIONS))
    if unknown:
        raise AllocMoeError(f"unknown task option(s) {unknown}; known: {', '.join(TASK_OPTIONS)}")
    for name, value in options.items():
        if value is not None and not tasks:
            raise AllocMoeError(f"{name} ({TASK_OPTIONS[name]}) applies only with tasks (--tasks); add tasks "
                                "or leave it out")
    include_path = options.get("include_path")
    if include_path is not None and not Path(include_path).is_dir():
        raise AllocMoeError(f"include path (--include-path) {include_path} is not a folder; give the folder "
                            "of your task YAMLs")


def check_tasks(tasks: list[str] | tuple[str, ...], include_path: str | None = None) -> None:
    """Fail before any work if the [eval] extra is missing or a task name is unknown."""
    check_task_options(tasks, include_path=include_path)
    _lm_eval()
    unknown = [t for t in tasks if t not in _task_manager(include_path).all_tasks]
    if unknown:
        raise AllocMoeError(f"unknown lm-eval task(s) {unknown}; offline tasks: {', '.join(OFFLINE_TASKS)} "
                            "(or pass --include-path DIR with your own YAML)")


def run_tasks(model, tokenizer, tasks: list[str], num_fewshot: int | None = None, limit: int | None = None,
              include_path: str | None = None, batch_size: int = 8) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} for `tasks` on the live model (apply a plan before calling)."""
    out = _simple_evaluate(model, tokenizer, tasks, num_fewshot, limit, include_path, batch_size, log_samples=False)
    return _task_metrics(out)


def score_tasks(model, tokenizer, tasks: list[str], num_fewshot: int | None = None, limit: int | None = None,
                include_path: str | None = None, batch_size: int = 8) -> tuple[dict, dict]:
    """As `run_tasks`, and also each item's 0/1 scores, for paired comparisons (evaluate.paired):
    ({task: {metric: value}}, {task: {"acc": [...], "acc_norm": [...], "items_digest": str}}), items
    in lm-eval's doc order; the digest names the items scored, so two runs can be checked alike."""
    out = _simple_evaluate(model, tokenizer, tasks, num_fewshot, limit, include_path, batch_size, log_samples=True)
    return _task_metrics(out), {task: _item_scores(samples) for task, samples in out["samples"].items()}


def _simple_evaluate(model, tokenizer, tasks, num_fewshot, limit, include_path, batch_size, log_samples: bool) -> dict:
    lm_eval, HFLM = _lm_eval()
    check_tasks(tasks, include_path)
    manager = _task_manager(include_path)
    device = str(next(model.parameters()).device)
    lm = _padding_aware(HFLM)(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    try:
        return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                       task_manager=manager, log_samples=log_samples, bootstrap_iters=0)
    except (FileNotFoundError, ConnectionError, OSError) as exc:
        raise AllocMoeError(f"lm-eval could not load a task's data offline ({str(exc).splitlines()[0]}); "
                            "hub tasks need their datasets in the local Hugging Face cache") from None
    except AssertionError as exc:
        raise AllocMoeError(f"lm-eval refused a request of {', '.join(tasks)} ({str(exc) or 'an internal check'}); "
                            "most often a target that tokenizes to nothing: does it start with its space?") from None


def right_padding_mask(ids: torch.Tensor) -> torch.Tensor:
    """[B, L] ids right-padded with 0 -> [B, L] 1 up to each row's last non-zero token (the first
    token always counts)."""
    real = (ids != 0).flip(-1).cummax(-1).values.flip(-1)               # [B, L]
    real[:, 0] = True
    return real.long()


@functools.lru_cache(maxsize=None)
def _padding_aware(HFLM):
    """HFLM that tells the model which tokens of a loglikelihood batch are padding.

    lm-eval calls a causal model as model(ids) on batches right-padded with token 0, with no
    attention mask. Causal attention keeps the real tokens' logits from seeing the pads, but a plan's
    router would take the pads for tokens: they would enter Alloc-T's pool and the measured
    activations. When token 0 is a special token of the tokenizer (so never a request's last real
    token), the trailing 0s are the padding: the model gets that mask, which its causal attention
    makes a no-op for the real tokens, and the plan leaves the pads out.
    """

    class PaddingAwareHFLM(HFLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            if attn_mask is not None or labels is not None:
                return super()._model_call(inps, attn_mask, labels)
            if 0 not in self.tokenizer.all_special_ids:
                if not getattr(self, "_warned_padding", False):
                    self._warned_padding = True
                    warnings.warn("token 0 is an ordinary token of this tokenizer, so lm-eval's right-padding "
                                  "cannot be told from text: pads count as tokens for Alloc-T's pool and the "
                                  "measured activations; --windows-per-pass 1 avoids padding", stacklevel=2)
                return super()._model_call(inps, attn_mask, labels)
            with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                                 enabled=self.mixed_precision_dtype is not None):
                return self.model(input_ids=inps, attention_mask=right_padding_mask(inps)).logits

    return PaddingAwareHFLM


def _task_metrics(out: dict) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    for task, metrics in out["results"].items():
        results[task] = {key.split(",")[0]: float(value) for key, value in metrics.items()
                         if isinstance(value, (int, float)) and "stderr" not in key}
        results[task].update(_accuracy_stderrs(results[task]))
    return results


def _item_scores(samples: list[dict]) -> dict:
    samples = sorted(samples, key=lambda s: s["doc_id"])
    scores: dict = {name: [float(s[name]) for s in samples] for name in ("acc", "acc_norm")
                    if samples and name in samples[0]}
    # the documents and the prompts (few-shot examples included) scored, in order
    scored = "".join(s["doc_hash"] + s["prompt_hash"] for s in samples)
    scores["items_digest"] = hashlib.sha256(scored.encode()).hexdigest()[:16]
    return scores


def _accuracy_stderrs(metrics: dict[str, float]) -> dict[str, float]:
    """Standard errors of the accuracy metrics, means of 0/1 over `sample_len` items: sqrt(p(1-p)/(n-1)),
    lm-eval's own closed form, computed here because its bootstrap for the other metrics is slow."""
    n = metrics.get("sample_len", 0)
    return {f"{name}_stderr": (metrics[name] * (1 - metrics[name]) / (n - 1)) ** 0.5
            for name in ("acc", "acc_norm") if name in metrics and n > 1}


def _register() -> None:
    """Register the lm-eval model name "allocmoe": pretrained=<folder|builtin>,plan=<plan.json>."""
    try:
        from lm_eval.api.registry import register_model
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        return

    @register_model("allocmoe")
    class AllocMoeLM(_padding_aware(HFLM)):
        def __init__(self, pretrained: str = "builtin", plan: str | None = None, **kwargs: Any):
            from ...routing.apply import apply_plan
            from ...models import load_model
            from ...routing.layout import load_plan

            model, tokenizer = load_model(None if pretrained == "builtin" else pretrained)
            self.plan_handle = apply_plan(model, load_plan(plan, model)) if plan else None
            kwargs.pop("tokenizer", None)
            super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)


_register()
