"""The budget x method sweep: the paper's comparison table, for any model.

Profiles once (or reuses a profile), then for every budget and method makes a plan, applies it and
scores perplexity on the evaluation text with the activations actually spent. Writes
results.json, plans.json, results.md and PNG plots into the output folder.

Stopped at any point (Ctrl-C, SIGTERM, an error), a sweep leaves nothing half-written:
  * while profiling: only `profile.json.partial.json` in the output folder; a rerun with the same
    arguments resumes it, skipping the finished cells;
  * after profiling: the finished `profile.json`; a rerun with the same model, calibration text
    and settings reuses it instead of profiling again;
  * every row (and the full model's score) as it finishes, in `rows.partial.json`, written
    atomically under a key of what the numbers depend on (`rows_key`: the model, calibration text,
    the exact evaluation tokens, allocation settings, tasks, allocmoe version; a row of a method that
    reads the profile is named with the profile's hash too). A rerun with the same key takes the
    kept rows instead of scoring them again (a different list of budgets or methods reuses the rows it
    shares); one with another key says so in one warning line and scores every row. The file goes
    once the results are written. The interrupted line names what was kept ("profile done, 7 of 40
    rows kept in DIR/rows.partial.json", or the profile's cells while profiling);
  * the five result files appear together at the very end or not at all (earlier results in the
    folder stay whole), by report.written_together: written into a hidden temporary folder next to
    the output folder, then moved in with SIGINT/SIGTERM held off; that folder is removed on every
    exit path (only a SIGKILL or a power cut can leave a `.NAME.*.tmp` folder behind).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import time
from contextlib import closing
from pydantic import Field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from tqdm import tqdm

from ..version import __version__
from ..routing.apply import apply_plan
from ..core.budget import Budget
from ..core.config import Config, check_counts, checked_config
from ..errors import AllocMoeError, Interrupted
from ..scoring.perplexity import check_batch_size, window_len, evaluate_perplexity, tokenize_windows
from ..core.files import atomic_write_json, json_safe, read_json
from ..calibrate.methods import METHODS, AllocateConfig, allocate
from ..routing.layout import model_fingerprint
from ..calibrate.profile import (ProfileConfig, check_ray_fields, load_profile, model_folder, profile_sensitivity,
                                 why_not_resumed, with_weights)

DEFAULT_BUDGETS = ("1/3", "1/2", "2/3", "5/6")
READS_PROFILE = ("alloc-moe", "alloc-l", "auto")     # the methods that read the profile
ROWS_FILE = "rows.partial.json"                     # finished rows of a sweep not yet written out


class SweepConfig(Config):
    """The sweep's table (budgets x methods), how rows are scored, the profile's settings, where it runs."""
    __config_aliases__ = {"eval_max_tokens": "eval_tokens", "batch_size": "windows_per_pass"}   # deprecated
    __config_flags__ = {"task_limit": "--limit", "threads_per_worker": "SweepConfig.threads_per_worker"}

    budgets: tuple[str, ...] | list[str] = DEFAULT_BUDGETS   # "1/2", "0.5", "78": as `--budget` takes them
    methods: tuple[str, ...] | list[str] = METHODS  # the table's rows per budget: every method by default
    eval_tokens: int | None = 16384                 # test tokens scored per row (None = the whole text)
    seq_len: int | None = None                      # window for calibration and evaluation
    windows_per_pass: int = 4                       # windows per forward pass
    k_base: int = 1                                 # Alloc-T's k_base for alloc-moe and alloc-t
    profile: ProfileConfig | dict = Field(default_factory=ProfileConfig)   # calibration for profiling
    progress: bool = True                           # one bar over the rows (stderr); False for scripts and logs
    tasks: tuple[str, ...] | list[str] = ()         # lm-eval tasks scored per row (needs allocmoe[eval])
    task_limit: int | None = None                   # lm-eval: at most N examples per task
    num_fewshot: int | None = None                  # lm-eval: few-shot examples (None: each task's own default)
    include_path: str | None = None                 # lm-eval: a folder of extra task YAMLs
    ray: str | None = None                          # rows (and the profile) on Ray: 'local', 'auto' or an address
    ray_workers: int | None = None                  # Ray actors holding the model; None = the cluster's CPUs // threads
    threads_per_worker: int = 1                     # torch threads (and Ray CPUs) per actor

    def __post_init__(self):        # types are checked by Config.__init__ before this runs
        self.budgets, self.methods, self.tasks = tuple(self.budgets), tuple(self.methods), tuple(self.tasks)
        check_counts(self, {"eval_tokens": 1, "seq_len": 2, "windows_per_pass": 1, "k_base": 0, "task_limit": 1,
                            "num_fewshot": 0})           # the Ray fields: check_ray_fields below
        self.profile = checked_config(ProfileConfig, self.profile)
        if self.profile.ray is not None:
            raise AllocMoeError("SweepConfig.profile.ray is set; give ray (and ray_workers, threads_per_worker) on "
                                "SweepConfig itself: the sweep's Ray settings cover its profile")
        if self.ray is not None and self.profile.max_memory is not None:
            raise AllocMoeError("ray cannot be combined with profile.max_memory yet; profile a model bigger than "
                                "memory in one process (allocmoe profile --max-memory) and pass that profile, or "
                                "drop max_memory to profile on Ray")
        check_ray_fields(self, "SweepConfig")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise AllocMoeError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        if not self.budgets or not self.methods:
            raise AllocMoeError("the sweep has no budget or no method; give at least one of each (--budgets, "
                                "--methods)")


def environment() -> dict[str, Any]:
    return {"allocmoe": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": __import__("os").cpu_count(), "torch_threads": torch.get_num_threads()}


def sweep(model, tokenizer, calib_text: str, eval_text: str, config: SweepConfig | dict | None = None,
          output_dir: str | Path | None = None, profile: dict | None = None,
          text_names: tuple[str, str] = ("calibration", "test"),
          on_row: Callable[[str, float], None] | None = None) -> dict[str, Any]:
    """Run every (budget, method) pair; returns the results dict (and writes files to output_dir).
    `on_row(method, budget fraction)` is called as each row finishes.

    `model` is a loaded model or its folder (a path or ModelSpec; `tokenizer` None takes the folder's).
    With `config.ray` it must be the folder: the profile's cells and then the rows run on Ray actors
    that each load it once (calibrate/distributed.py), to the same table, in whatever order they
    finish; the results then say how the rows were spread (`ray`)."""
    config = checked_config(SweepConfig, config)
    run = _SweepRun(model, tokenizer, eval_text, config, output_dir)
    run.score(calib_text, profile, text_names[0], on_row)
    results = run.results(text_names)
    if output_dir:
        from ..measure.report import write_report, written_together

        with written_together(Path(output_dir)) as folder:   # all five files, or none of them
            atomic_write_json(folder / "results.json", results)
            atomic_write_json(folder / "plans.json", run.plans)
            write_report(results, folder)
        run.kept.discard()                             # the results hold every row now
    return results


class _SweepRun:
    """One sweep from its checked inputs to its results: the model (or its folder, on Ray), the rows to
    score (`items`: "full" first, then every (budget, method) pair), the checkpoint of finished rows."""

    def __init__(self, model, tokenizer, eval_text: str, config: SweepConfig, output_dir):
        """Everything checked before profiling: the budgets, the tasks, the evaluation text's windows."""
        self.config, self.output_dir, self.started = config, output_dir, time.time()
        self.on_ray, self.pool = config.ray is not None, None
        self.spec = model_folder(model, ProfileConfig(ray=config.ray))
        if self.spec is not None:
            tokenizer = tokenizer if tokenizer is not None else self.spec.tokenizer()
            model = self.spec.skeleton() if self.on_ray else self.spec.load()[0]      # on Ray the workers load it
        self.model, self.tokenizer = model, tokenizer
        self.fingerprint = model_fingerprint(model)
        num_layers, k_orig = self.fingerprint["num_moe_layers"], self.fingerprint["k_orig"]
        budgets = [Budget.parse(b, num_layers, k_orig) for b in config.budgets]      # fail fast on a bad one
        if config.tasks:
            from ..measure.evaluate.harness import check_tasks

            check_tasks(config.tasks, config.include_path)          # fail before profiling, not after
        self.seq_len = window_len(model, config.seq_len)
        self.eval_windows = tokenize_windows(tokenizer, eval_text, self.seq_len, config.eval_tokens)
        check_batch_size(self.eval_windows, config.windows_per_pass)   # the CLI's refusal, before the profile's hours
        pairs = [(budget, method) for budget in budgets for method in config.methods]
        self.items = [("full",)] + [(index, budget, method) for index, (budget, method) in enumerate(pairs)]
        self.results_of: dict[Any, Any] = {}                # "full" or a row's index -> its result
        self.kept = RowCheckpoint(Path(output_dir) / ROWS_FILE) if output_dir else None
        self.profile = None

    def score(self, calib_text: str, profile: dict | None, calib_name: str, on_row) -> None:
        """Profile if a method needs it, then score every row not kept from an earlier run, in this
        process or on Ray; a Ctrl-C says what a rerun picks up (`_interrupted`)."""
        config, ray_started, given_profile = self.config, False, profile is not None
        self.profile = profile
        try:
            if self.on_ray:
                from ..calibrate.distributed import RaySettings, connect

                settings = RaySettings(address=config.ray, workers=config.ray_workers,
                                       threads_per_worker=config.threads_per_worker)
                ray_started, workers = connect(settings)
            self.profile = _sweep_profile(self.spec if self.on_ray else self.model, self.tokenizer, calib_text,
                                          config, self.seq_len, self.output_dir, profile, calib_name)
            work = self._work(calib_text)
            todo = [item for item in self.items if item[0] not in self.results_of]
            resumed = sum(1 for item in self.items if item[0] != "full" and item[0] in self.results_of)
            with tqdm(total=len(self.items) - 1, initial=resumed, desc="sweep", unit="run",
                      disable=not config.progress) as bar:
                if self.on_ray:
                    from ..calibrate.distributed import RayPool, SweepWorker

                    self.pool = RayPool(SweepWorker, self.spec, work, settings, workers, "rerun the sweep")
                    arrivals = self.pool.results(todo, lambda item, back: None if back else item, bar)
                else:
                    arrivals = work.in_order(self.model, self.tokenizer, todo, bar)
                with closing(arrivals):                    # its workers stop before Ray does
                    for item, result in arrivals:
                        self._arrived(item, result, bar, on_row)
        except KeyboardInterrupt as exc:
            self._interrupted(exc, given_profile)
        finally:
            if ray_started:
                import ray

                ray.shutdown()

    def _work(self, calib_text: str) -> "_RowWork":
        """What each row needs (one process or every Ray worker), with the kept rows taken in."""
        config = self.config
        ppl_config = {"windows_per_pass": config.windows_per_pass, "progress": False}
        alloc_config = AllocateConfig(k_base=config.k_base, calib_tokens=config.profile.calib_tokens,
                                      seq_len=self.seq_len, windows_per_pass=config.windows_per_pass,
                                      progress=False)      # the sweep's own bar counts the rows
        work = _RowWork(self.profile, calib_text, alloc_config, self.eval_windows, ppl_config, config)
        if self.kept is not None:
            self.kept.open(rows_key(with_weights(self.fingerprint, self.spec if self.on_ray else self.model),
                                    calib_text, self.eval_windows, alloc_config, config))
            for item in self.items:
                earlier = self.kept.get(_item_name(item, self.profile))
                if earlier is not None:
                    self.results_of[item[0]] = earlier
        return work

    def _arrived(self, item: tuple, result, bar, on_row) -> None:
        self.results_of[item[0]] = result
        if self.kept is not None:
            self.kept.keep(_item_name(item, self.profile), result)
        if item[0] != "full":
            bar.update(1)
            if on_row:
                on_row(item[2], item[1].fraction)

    def _interrupted(self, exc: KeyboardInterrupt, given_profile: bool) -> None:
        """Re-raise a Ctrl-C as Interrupted naming what was kept (the profile, rows), when anything was."""
        kept = self.kept
        if kept is None or isinstance(exc, Interrupted):
            raise exc                                  # nothing kept to name, or the profile named its cells
        saved = Path(self.output_dir) / "profile.json"
        profiled = not given_profile and (kept.key is not None and self.profile is not None or
                                          saved.is_file() and saved.stat().st_mtime >= self.started - 1)
        if kept.key is None and not profiled:
            raise exc
        total = len(self.items) - 1
        if kept.path.is_file():
            resume = (f"{'profile done, ' if profiled else ''}{kept.count(exclude='full')} of {total} rows kept in "
                      f"{kept.path}")
        else:
            resume = f"profile done, kept in {saved}; 0 of {total} rows scored"
        raise Interrupted(resume) from exc

    def results(self, text_names: tuple[str, str]) -> dict[str, Any]:
        """The results dict (every row with its change against the full model); `plans` is set beside it."""
        config, fingerprint = self.config, self.fingerprint
        full, full_tasks = self.results_of.pop("full")
        done = [self.results_of[index] for index in range(len(self.items) - 1)]
        for row, _, _ in done:
            row["relative_change"] = relative_change(row["perplexity"], full)
        self.plans = {key: plan for _, key, plan in done}
        return {
            "model": {**fingerprint, "name": getattr(self.model.config, "_name_or_path", "")},
            "full": {"perplexity": full["perplexity"],
                     "activations_per_token": float(fingerprint["num_moe_layers"] * fingerprint["k_orig"]),
                     **({"tasks": full_tasks} if config.tasks else {})},
            "evaluation": {"text": text_names[1], "tokens": full["tokens"], "windows": full["windows"],
                           "seq_len": full["seq_len"],
                           "batch_size": config.windows_per_pass},
            "calibration": self.profile["calibration"] if self.profile else {"text": text_names[0]},
            "rows": [row for row, _, _ in done],
            "environment": environment(),
            "seconds": round(time.time() - self.started, 1),
            **({"ray": self.pool.provenance()} if self.pool is not None else {}),
        }


def _sweep_profile(model, tokenizer, calib_text: str, config: SweepConfig, seq_len: int, output_dir, profile,
                   calib_name: str) -> dict | None:
    """The profile the methods need: the one given, one an earlier run of this sweep finished, or a new
    one (on Ray when the sweep is); None when no method needs one."""
    needs_profile = any(m in READS_PROFILE for m in config.methods)
    if profile is not None or not needs_profile:
        return profile
    profile_config = ProfileConfig(**{**config.profile.model_dump(), "seq_len": seq_len, "windows_per_pass": config.windows_per_pass,
                                      "progress": config.progress, "ray": config.ray,
                                      "ray_workers": config.ray_workers,
                                      "threads_per_worker": config.threads_per_worker})
    saved = Path(output_dir) / "profile.json" if output_dir else None
    profile = _finished_profile(saved, model, calib_text, profile_config, calib_name) if saved else None
    if profile is not None and config.progress:
        print(f"reusing {saved}: same model, calibration text and settings", file=sys.stderr)
    if profile is None:
        profile = profile_sensitivity(model, tokenizer, calib_text, profile_config, output=saved,
                                      calib_name=calib_name)
    return profile


def relative_change(perplexity: float, full: dict[str, Any]) -> float:
    return perplexity / full["perplexity"] - 1


class _RowWork:
    """What one row needs besides the model, and how it is scored: the same code in one process and on
    every Ray worker, so a row's numbers do not depend on where it ran."""

    def __init__(self, profile, calib_text: str, alloc_config: AllocateConfig, eval_windows, ppl_config: dict,
                 config: SweepConfig):
        self.profile, self.calib_text, self.alloc_config = profile, calib_text, alloc_config
        self.eval_windows, self.ppl_config, self.config = eval_windows, ppl_config, config

    def tasks(self, model, tokenizer):
        from ..measure.evaluate.harness import run_tasks

        config = self.config
        return run_tasks(model, tokenizer, list(config.tasks), config.num_fewshot, config.task_limit,
                         config.include_path, batch_size=config.windows_per_pass)

    def full(self, model, tokenizer) -> tuple[dict[str, Any], Any]:
        """The unmodified model's perplexity facts (and task scores)."""
        result = evaluate_perplexity(model, tokenizer, "", self.ppl_config, windows=self.eval_windows)
        facts = {"perplexity": result.perplexity, "tokens": result.tokens, "windows": result.windows,
                 "seq_len": result.seq_len}
        return facts, self.tasks(model, tokenizer) if self.config.tasks else None

    def run(self, model, tokenizer, item: tuple):
        """The result of one item, ("full",) or (index, budget, method): what a Ray worker streams back."""
        yield self.full(model, tokenizer) if item[0] == "full" else self.row(model, tokenizer, *item[1:])

    def in_order(self, model, tokenizer, items: list[tuple], bar):
        """(item, result) for every item, one after another in this process."""
        for item in items:
            if item[0] != "full":
                bar.set_postfix(budget=f"{item[1].activations_per_token:g}", method=item[2])
            for result in self.run(model, tokenizer, item):
                yield item, result

    def row(self, model, tokenizer, budget: Budget, method: str):
        """(row, plan key, plan dict) of one (budget, method) pair; the caller fills in relative_change
        (`relative_change`) once the full model's perplexity is known, wherever each ran."""
        fingerprint = model_fingerprint(model)
        plan = allocate(budget, method, profile=self.profile, model=model, tokenizer=tokenizer,
                        calib_text=self.calib_text, config=self.alloc_config)
        with apply_plan(model, plan) as handle:
            result = evaluate_perplexity(model, tokenizer, "", self.ppl_config, windows=self.eval_windows)
            measured = handle.activations_per_token()
            measured_cost = plan.measured_cost(handle.layer_activations())
            task_scores = self.tasks(model, tokenizer) if self.config.tasks else None
        row = {"method": method, "budget": round(budget.fraction, 6),
               "budget_activations": budget.activations_per_token, "perplexity": result.perplexity,
               "relative_change": None,
               "activations_per_token": measured,
               "cost_per_token": measured_cost,
               "k_per_layer": [plan.layers[i].k for i in fingerprint["moe_layers"]]}
        if task_scores is not None:
            row["tasks"] = task_scores
        if method == "auto":
            row["auto_choice"] = plan.provenance["details"]["chosen"]
        return row, f"{method}@{budget.activations_per_token:g}", plan.to_dict()


def _finished_profile(path: Path, model, calib_text: str, config: ProfileConfig, calib_name: str) -> dict | None:
    """The profile an earlier (killed) sweep finished in `path`, if it is of this model (shape and
    weights) and was made from the same calibration text and settings; None otherwise (then it is
    profiled again, after one warning line saying why it was not reused). `model` is the model or
    its folder's ModelSpec (on Ray)."""
    if not path.is_file():
        return None
    skeleton = model.skeleton() if hasattr(model, "skeleton") else model
    try:
        saved = load_profile(path)
    except AllocMoeError as exc:
        print(f"allocmoe: warning: {path} was not reused ({exc}); profiling again", file=sys.stderr)
        return None
    wanted_model = with_weights(model_fingerprint(skeleton), model)
    found_model = {key: value for key, value in saved["model"].items() if value is not None}
    calibration = saved.get("calibration") or {}
    wanted = {"text": calib_name, "sha256": hashlib.sha256(calib_text.encode()).hexdigest()[:16],
              "seq_len": config.seq_len, "max_tokens": config.calib_tokens, "batch_size": config.windows_per_pass}
    found = {key: calibration.get(key) for key in wanted}
    if found_model != wanted_model or found != wanted:
        why = why_not_resumed({"model": found_model, "calibration": found},
                              {"model": wanted_model, "calibration": wanted})
        print(f"allocmoe: warning: {path} was not reused: it was made with {why}; profiling again", file=sys.stderr)
        return None
    return saved


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _item_name(item: tuple, profile: dict | None) -> str:
    """A row's name in the checkpoint, the same whatever budgets and methods the sweep lists: "full",
    or "METHOD@ACTIVATIONS" with the budget's activations per token exactly, and for the methods that
    read the profile "#" and a hash of the profile's table and calibration (another profile: another
    row)."""
    if item[0] == "full":
        return "full"
    name = f"{item[2]}@{float(item[1].activations_per_token)!r}"
    if item[2] in READS_PROFILE and profile is not None:
        name += "#" + _sha(json.dumps([profile["sensitivity"], profile.get("calibration")], sort_keys=True).encode())
    return name


def rows_key(fingerprint: dict[str, Any], calib_text: str, eval_windows: torch.Tensor,
             alloc_config: AllocateConfig, config: SweepConfig) -> dict[str, Any]:
    """What every row's numbers depend on besides its method, budget and profile (`_item_name`): the
    model, the calibration text (auto's stand-ins, top-p and NAEE thresholds read it), the exact
    evaluation tokens, the allocation settings, the tasks and the allocmoe version. A checkpoint with
    another key is not resumed."""
    sha = _sha
    windows = eval_windows.contiguous()
    return {"model": fingerprint,
            "calibration_sha256": sha(calib_text.encode()),
            "evaluation": {"sha256": sha(windows.numpy().tobytes()), "shape": list(windows.shape)},
            "allocate": alloc_config.model_dump(),
            "tasks": {"tasks": list(config.tasks), "limit": config.task_limit, "num_fewshot": config.num_fewshot,
                      "include_path": config.include_path},
            "allocmoe": __version__}


class RowCheckpoint:
    """The sweep's finished rows (and its full-model score), written atomically to `path` as each
    finishes, under the key of what produced them; a rerun with the same key takes them instead of
    scoring them again. A row with a value that is not finite is not kept (JSON has no NaN): a rerun
    scores it again."""

    def __init__(self, path: Path):
        self.path, self.key, self.rows = path, None, {}

    def open(self, key: dict[str, Any]) -> None:
        self.key, self.rows = json.loads(json.dumps(key)), {}     # as it reads back from the file
        if not self.path.is_file():
            return
        try:
            saved = read_json(self.path, "sweep checkpoint")
            rows = saved["rows"]
            if not (isinstance(rows, dict) and all(isinstance(v, list) for v in rows.values())):
                raise TypeError
            if saved.get("key") != self.key:
                print(f"allocmoe: warning: {self.path} was not resumed: its rows were made with "
                      f"{why_not_resumed(saved.get('key'), self.key)}; scoring every row again", file=sys.stderr)
                return
            self.rows = rows
        except (AllocMoeError, KeyError, TypeError, AttributeError):
            print(f"allocmoe: warning: {self.path} is damaged; scoring every row again", file=sys.stderr)

    def get(self, name: str):
        return self.rows.get(name)

    def count(self, exclude: str) -> int:
        return sum(1 for name in self.rows if name != exclude)

    def keep(self, name: str, result) -> None:
        clean, where = json_safe(result)
        if where:
            return
        self.rows[name] = clean
        atomic_write_json(self.path, {"key": self.key, "rows": self.rows})

    def discard(self) -> None:
        if self.path.exists():
            self.path.unlink()
