"""The budget x method sweep: the paper's comparison table, for any model.

Profiles once (or reuses a profile), then for every budget and method makes a plan, applies it and
scores perplexity on the evaluation text with the activations actually spent. Writes
results.json, plans.json, results.md and PNG plots into the output folder.

Stopped at any point (Ctrl-C, SIGTERM, an error), a sweep leaves nothing half-written:
  * while profiling: only `profile.json.partial.json` in the output folder; a rerun with the same
    arguments resumes it, skipping the finished cells;
  * after profiling: only the finished `profile.json`; a rerun with the same model, calibration text
    and settings reuses it instead of profiling again;
  * the five result files appear together at the very end or not at all (earlier results in the
    folder stay whole), by report.written_together: written into a hidden temporary folder next to
    the output folder, then moved in with SIGINT/SIGTERM held off; that folder is removed on every
    exit path (only a SIGKILL or a power cut can leave a `.NAME.*.tmp` folder behind).
"""

from __future__ import annotations

import hashlib
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from .. import __version__
from ..routing.apply import apply_plan
from ..core.budget import Budget
from ..core.config import checked_config
from ..errors import AllocMoeError
from .evaluate.perplexity import window_len, evaluate_perplexity, tokenize_windows
from ..core.files import atomic_write_json
from ..calibrate.methods import METHODS, AllocateConfig, allocate
from ..core.plan import model_fingerprint
from ..calibrate.profile import ProfileConfig, load_profile, profile_sensitivity

DEFAULT_BUDGETS = ("1/3", "1/2", "2/3", "5/6")


@dataclass
class SweepConfig:
    budgets: tuple[str, ...] = DEFAULT_BUDGETS      # fractions or counts, as `--budget` takes them
    methods: tuple[str, ...] = METHODS              # every method by default
    eval_max_tokens: int | None = 16384             # test tokens scored per row (None = the whole text)
    seq_len: int | None = None                      # window for calibration and evaluation
    batch_size: int = 4                             # windows per forward pass
    k_base: int = 1                                 # Alloc-T's k_base for alloc-moe and alloc-t
    profile: ProfileConfig = field(default_factory=ProfileConfig)   # calibration for profiling
    progress: bool = True
    tasks: tuple[str, ...] = ()                     # lm-eval tasks scored per row (needs allocmoe[eval])
    task_limit: int | None = None                   # lm-eval: at most N examples per task
    num_fewshot: int | None = None
    include_path: str | None = None
    ray: str | None = None                          # rows (and the profile) on Ray: 'local', 'auto' or an address

    def __post_init__(self):
        if self.ray is not None:
            from ..calibrate.distributed import check_ray

            check_ray()
            raise AllocMoeError("sweep --ray is not available yet; run `allocmoe profile --ray` and pass --profile")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise AllocMoeError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        if not self.budgets or not self.methods:
            raise AllocMoeError("the sweep has no budget or no method; give at least one of each (--budgets, --methods)")


def environment() -> dict[str, Any]:
    return {"allocmoe": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": __import__("os").cpu_count(), "torch_threads": torch.get_num_threads()}


def sweep(model, tokenizer, calib_text: str, eval_text: str, config: SweepConfig | dict | None = None,
          output_dir: str | Path | None = None, profile: dict | None = None,
          text_names: tuple[str, str] = ("calibration", "test")) -> dict[str, Any]:
    """Run every (budget, method) pair; returns the results dict (and writes files to output_dir)."""
    config = checked_config(SweepConfig, config)
    started = time.time()
    fingerprint = model_fingerprint(model)
    num_layers, k_orig = fingerprint["num_moe_layers"], fingerprint["k_orig"]
    budgets = [Budget.parse(b, num_layers, k_orig) for b in config.budgets]      # fail fast on a bad one
    if config.tasks:
        from .evaluate.harness import check_tasks

        check_tasks(config.tasks, config.include_path)          # fail before profiling, not after
    seq_len = window_len(model, config.seq_len)
    eval_windows = tokenize_windows(tokenizer, eval_text, seq_len, config.eval_max_tokens)
    needs_profile = any(m in ("alloc-moe", "alloc-l", "auto") for m in config.methods)
    if profile is None and needs_profile:
        profile_config = ProfileConfig(**{**asdict(config.profile), "seq_len": seq_len,
                                          "batch_size": config.batch_size, "progress": config.progress})
        saved = Path(output_dir) / "profile.json" if output_dir else None
        profile = _finished_profile(saved, model, calib_text, profile_config, text_names[0]) if saved else None
        if profile is not None and config.progress:
            print(f"reusing {saved}: same model, calibration text and settings", file=sys.stderr)
        if profile is None:
            profile = profile_sensitivity(model, tokenizer, calib_text, profile_config, output=saved,
                                          calib_name=text_names[0])
    ppl_config = {"batch_size": config.batch_size, "progress": False}
    if config.tasks:
        from .evaluate.harness import run_tasks

        def score_tasks():
            return run_tasks(model, tokenizer, list(config.tasks), config.num_fewshot, config.task_limit,
                             config.include_path, batch_size=config.batch_size)
    full = evaluate_perplexity(model, tokenizer, "", ppl_config, windows=eval_windows)
    full_tasks = score_tasks() if config.tasks else None
    alloc_config = AllocateConfig(k_base=config.k_base, calib_max_tokens=config.profile.max_tokens,
                                  seq_len=seq_len, batch_size=config.batch_size,
                                  progress=False)      # the sweep's own bar counts the rows
    rows, plans = [], {}
    with tqdm(total=len(budgets) * len(config.methods), desc="sweep", unit="run", disable=not config.progress) as bar:
        for budget in budgets:
            for method in config.methods:
                bar.set_postfix(budget=f"{budget.activations_per_token:g}", method=method)
                plan = allocate(budget, method, profile=profile, model=model, tokenizer=tokenizer,
                                calib_text=calib_text, config=alloc_config)
                with apply_plan(model, plan) as handle:
                    result = evaluate_perplexity(model, tokenizer, "", ppl_config, windows=eval_windows)
                    measured = handle.activations_per_token()
                    task_scores = score_tasks() if config.tasks else None
                row = {"method": method, "budget": round(budget.fraction, 6),
                       "budget_activations": budget.activations_per_token, "perplexity": result.perplexity,
                       "relative_change": result.perplexity / full.perplexity - 1,
                       "activations_per_token": measured,
                       "k_per_layer": [plan.layers[i].k for i in fingerprint["moe_layers"]]}
                if task_scores is not None:
                    row["tasks"] = task_scores
                if method == "auto":
                    row["auto_choice"] = plan.provenance["details"]["chosen"]
                rows.append(row)
                plans[f"{method}@{budget.activations_per_token:g}"] = plan.to_dict()
                bar.update(1)
    results = {
        "model": {**fingerprint, "name": getattr(model.config, "_name_or_path", "")},
        "full": {"perplexity": full.perplexity, "activations_per_token": float(num_layers * k_orig),
                 **({"tasks": full_tasks} if config.tasks else {})},
        "evaluation": {"text": text_names[1], "tokens": full.tokens, "windows": full.windows, "seq_len": full.seq_len,
                       "batch_size": config.batch_size},
        "calibration": profile["calibration"] if profile else {"text": text_names[0]},
        "rows": rows,
        "environment": environment(),
        "seconds": round(time.time() - started, 1),
    }
    if output_dir:
        from .report import write_report, written_together

        with written_together(Path(output_dir)) as folder:   # all five files, or none of them
            atomic_write_json(folder / "results.json", results)
            atomic_write_json(folder / "plans.json", plans)
            write_report(results, folder)
    return results


def _finished_profile(path: Path, model, calib_text: str, config: ProfileConfig, calib_name: str) -> dict | None:
    """The profile an earlier (killed) sweep finished in `path`, if it is of this model and was made
    from the same calibration text and settings; None otherwise (then it is profiled again)."""
    if not path.is_file():
        return None
    try:
        saved = load_profile(path, model)
    except AllocMoeError:
        return None
    calibration = saved.get("calibration") or {}
    wanted = {"text": calib_name, "sha256": hashlib.sha256(calib_text.encode()).hexdigest()[:16],
              "seq_len": config.seq_len, "max_tokens": config.max_tokens, "batch_size": config.batch_size}
    return saved if all(calibration.get(key) == value for key, value in wanted.items()) else None
