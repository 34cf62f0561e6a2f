"""Profiling and sweeping on Ray (calibrate/distributed.py): a local Ray instance of two one-thread
workers gives the single-process table bit for bit, also when a worker is killed mid-run, with every
cell and row reported once; a killed driver resumes from the partial file; a sweep's lm-eval tasks
score the same on Ray; an error in a worker is one line, and workers that keep dying stop the run;
`--ray-workers` reaches the configs; Ray fields that cannot work are refused before any work; `--ray`
without Ray is refused."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from allocmoe.calibrate.profile import ProfileConfig, profile_cells, profile_sensitivity
from allocmoe.errors import AllocMoeError
from allocmoe.pipelines.sweep import SweepConfig, sweep
from conftest import KillAfter

ray = pytest.importorskip("ray")

TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(2000))
CFG = {"seq_len": 32, "calib_tokens": 1024, "windows_per_pass": 4, "progress": False}    # one thread, as the workers
RAY = {"ray": "local", "ray_workers": 2, "threads_per_worker": 1}
SWEEP = {"budgets": ("1/2", "2/3"), "methods": ("uniform", "alloc-moe", "top-p"), "eval_tokens": 256,
         "seq_len": 32, "windows_per_pass": 4, "progress": False, "profile": ProfileConfig(calib_tokens=256, progress=False)}


@pytest.fixture(scope="module")
def single(tiny_folder):
    assert torch.get_num_threads() == 1            # conftest: the reference uses the workers' thread count
    return profile_sensitivity(str(tiny_folder), None, TEXT, CFG)


def worker_processes(kind: str) -> dict[int, bytes]:
    """pid -> title of the live Ray workers of `kind` (Ray titles them `ray::SweepWorker`, and
    `ray::SweepWorker.run` while they run an item)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if title.split(b".")[0] == f"ray::{kind}".encode():
                found[int(entry.name)] = title
    return found


def kill_a_worker(kind: str) -> int:
    """SIGKILL one worker of `kind`, a busy one if one shows within two seconds (else any); its pid."""
    deadline = time.monotonic() + 2
    while True:
        workers = worker_processes(kind)
        busy = [pid for pid, title in workers.items() if title.endswith(b".run")]
        if busy or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    assert workers, f"no Ray {kind} process found"
    pid = (busy or sorted(workers))[0]
    os.kill(pid, signal.SIGKILL)
    return pid


def test_two_workers_give_the_single_process_table_even_when_one_is_killed(tiny_folder, single, tmp_path):
    configurations = profile_cells(single["num_layers"], single["k_orig"])
    reported, killed = [], []

    def kill_one_worker(layer, k):                 # after the first cell arrives: SIGKILL a busy worker
        reported.append((layer, k))
        if not killed:
            killed.append(kill_a_worker("ProfileWorker"))

    output = tmp_path / "profile.json"
    profile = profile_sensitivity(str(tiny_folder), None, TEXT, {**CFG, **RAY}, output=output,
                                  on_cell=kill_one_worker)
    assert not ray.is_initialized()                # the instance it started is shut down
    assert profile["sensitivity"] == single["sensitivity"]               # bit for bit
    assert killed and profile["provenance"]["ray"]["workers_replaced"] == 1
    assert len(reported) == len(configurations) == len(set(reported))   # every cell came back once
    assert profile["provenance"]["configurations_resumed"] == 0
    assert output.is_file() and not Path(f"{output}.partial.json").exists()


def test_a_ray_run_resumes_a_partial_file_and_recomputes_nothing_finished(tiny_folder, single, tmp_path):
    output = tmp_path / "profile.json"
    with pytest.raises(KeyboardInterrupt):         # the driver dies after writing three cells
        profile_sensitivity(str(tiny_folder), None, TEXT, CFG, output=output, on_cell=KillAfter(3))
    assert not ray.is_initialized()
    reported = []
    profile = profile_sensitivity(str(tiny_folder), None, TEXT, {**CFG, **RAY}, output=output,
                                  on_cell=lambda layer, k: reported.append((layer, k)))
    assert profile["sensitivity"] == single["sensitivity"]
    assert profile["provenance"]["configurations_resumed"] == 3
    assert len(reported) == profile["provenance"]["configurations_run"] - 3


def test_a_ray_sweep_gives_the_single_process_table_even_when_a_worker_is_killed(tiny_folder, tmp_path, capsys):
    from allocmoe.models import load_model

    model, tok = load_model(tiny_folder)
    single = sweep(model, tok, TEXT, TEXT, SWEEP)
    reported, killed = [], []

    def kill_one_worker(method, budget):           # after the first row arrives: SIGKILL a busy row worker
        reported.append((method, budget))
        if not killed:
            killed.append(kill_a_worker("SweepWorker"))

    on_ray = sweep(str(tiny_folder), None, TEXT, TEXT, {**SWEEP, "ray": "local", "ray_workers": 2, "progress": True},
                   output_dir=tmp_path / "s", on_row=kill_one_worker)
    assert not ray.is_initialized()
    assert on_ray["rows"] == single["rows"] and on_ray["full"] == single["full"]      # bit for bit, in order
    assert on_ray["calibration"] == single["calibration"]
    assert killed and on_ray["ray"]["workers_replaced"] == 1 and on_ray["ray"]["workers"] == 2
    assert sorted((method, round(budget, 6)) for method, budget in reported) == sorted(
        (row["method"], row["budget"]) for row in single["rows"])                     # each row reported once
    assert (tmp_path / "s" / "results.json").is_file()
    err = capsys.readouterr().err
    assert "workers busy 2/2" in err                  # the bars show the workers at work


def test_a_ray_sweep_scores_lm_eval_tasks_as_the_single_process(tiny_folder, tmp_path):
    pytest.importorskip("lm_eval")
    from allocmoe.models import load_model

    config = {**SWEEP, "budgets": ("1/2",), "methods": ("uniform",), "tasks": ("allocmoe_cloze",),
              "task_limit": 4}
    model, tok = load_model(tiny_folder)
    single = sweep(model, tok, TEXT, TEXT, config)
    # one worker: lm-eval's start costs each worker seconds, and spreading is tested above
    on_ray = sweep(str(tiny_folder), None, TEXT, TEXT, {**config, "ray": "local", "ray_workers": 1})
    assert on_ray["rows"] == single["rows"] and on_ray["full"] == single["full"]
    assert set(on_ray["full"]["tasks"]) == {"allocmoe_cloze"} and all("tasks" in row for row in on_ray["rows"])


def test_an_error_in_a_worker_is_one_line_and_workers_that_keep_dying_stop_the_run(tiny_folder, monkeypatch):
    """The pool both runs share: a worker's own refusal arrives as it was, another error as one line
    naming it, and a job whose workers keep dying stops after the replacements allowed."""
    from tqdm import tqdm

    from allocmoe.calibrate import distributed
    from allocmoe.models import inspect_model

    class Job:                                     # local, so Ray sends it by value
        def run(self, model, tokenizer, item):
            if item == "refuse":
                raise AllocMoeError("this item is refused; give another")
            if item == "fail":
                raise ValueError("first line\nsecond line")
            os._exit(1)                            # the worker process dies
            yield

    spec, settings = inspect_model(tiny_folder), distributed.RaySettings(workers=1)
    started, _ = distributed.connect(settings)
    monkeypatch.setattr(distributed, "MAX_REPLACEMENTS", 1)
    try:
        def run(item):
            pool = distributed.RayPool(distributed.SweepWorker, spec, Job(), settings, 1, "rerun it")
            list(pool.results([item], lambda item, back: item, tqdm(disable=True)))

        with pytest.raises(AllocMoeError) as refused:
            run("refuse")
        assert str(refused.value) == "this item is refused; give another"
        with pytest.raises(RuntimeError) as failed:
            run("fail")
        assert str(failed.value) == "a Ray worker failed (ValueError: first line)"
        with pytest.raises(AllocMoeError) as dying:        # replaced once, then it dies again
            run("die")
        assert str(dying.value).startswith("Ray workers keep dying (2 replaced; last: ")
        assert str(dying.value).endswith("); rerun it") and "\n" not in str(dying.value)
    finally:
        if started:
            ray.shutdown()


def test_ray_refuses_a_loaded_model_and_max_memory(tiny_folder):
    from allocmoe.models import load_model

    model, tok = load_model(tiny_folder)
    with pytest.raises(AllocMoeError, match="folder"):
        profile_sensitivity(model, tok, TEXT, {**CFG, **RAY})
    with pytest.raises(AllocMoeError, match="folder"):
        sweep(model, tok, TEXT, TEXT, {**SWEEP, "ray": "local"})
    with pytest.raises(AllocMoeError, match="--max-memory"):
        profile_sensitivity(str(tiny_folder), None, TEXT, {**CFG, **RAY, "max_memory": "300MiB"})


@pytest.mark.parametrize("config_class, fields, message", [
    (ProfileConfig, {"ray_workers": 2}, "ray_workers (--ray-workers) is 2 but ray (--ray) is not given; add --ray"),
    (ProfileConfig, {"threads_per_worker": 2}, "ProfileConfig.threads_per_worker is 2 but ray (--ray) is not given"),
    (ProfileConfig, {"ray": "local", "ray_workers": 0}, "ray_workers (--ray-workers) must be a whole number >= 1"),
    (ProfileConfig, {"ray": "local", "ray_workers": True}, "ray_workers (--ray-workers) must be a whole number"),
    (ProfileConfig, {"ray": "local", "threads_per_worker": 0}, "threads_per_worker (ProfileConfig.threads_per_worker) must be a whole number >= 1"),
    (ProfileConfig, {"ray": "local", "max_memory": "1GiB"}, "--ray and --max-memory cannot be combined yet"),
    (SweepConfig, {"ray_workers": 2}, "ray_workers (--ray-workers) is 2 but ray (--ray) is not given"),
    (SweepConfig, {"ray": "local", "ray_workers": 1.5}, "ray_workers (--ray-workers) must be a whole number"),
    (SweepConfig, {"ray": "local", "ray_workers": 0}, "ray_workers (--ray-workers) must be a whole number >= 1"),
    (SweepConfig, {"threads_per_worker": 3}, "SweepConfig.threads_per_worker is 3 but ray (--ray) is not given"),
    (SweepConfig, {"ray": "local", "profile": {"max_memory": "1GiB"}}, "ray cannot be combined with profile.max_memory"),
    (SweepConfig, {"profile": {"ray": "local"}}, "give ray (and ray_workers, threads_per_worker) on SweepConfig"),
])
def test_ray_fields_that_cannot_work_are_refused_before_any_work(config_class, fields, message):
    with pytest.raises(AllocMoeError) as refused:
        config_class(**fields)
    assert message in str(refused.value) and "; " in str(refused.value)
    assert not ray.is_initialized()


def test_ray_workers_on_the_command_line_reach_the_profile_and_sweep_configs(tiny_folder, tmp_path, monkeypatch):
    import allocmoe.calibrate.profile as profile_module
    import allocmoe.pipelines.sweep as sweep_module
    from allocmoe.cli import main

    seen = {}

    def stop(name):
        def capture(model, tokenizer, *args, **kwargs):
            seen[name] = args[2] if name == "sweep" else args[1]
            raise SystemExit(0)                      # captured: no need to run it
        return capture

    monkeypatch.setattr(profile_module, "profile_sensitivity", stop("profile"))
    monkeypatch.setattr(sweep_module, "sweep", stop("sweep"))
    common = ["--model", str(tiny_folder), "--seq-len", "32", "--calib-tokens", "64", "--quiet"]
    for argv in (["profile", *common, "--output", str(tmp_path / "p.json"), "--ray", "--ray-workers", "3"],
                 ["sweep", *common, "--output", str(tmp_path / "s"), "--eval-tokens", "64", "--ray", "auto",
                  "--ray-workers", "3"]):
        with pytest.raises(SystemExit):
            main(argv)
    assert (seen["profile"].ray, seen["profile"].ray_workers) == ("local", 3)
    assert (seen["sweep"].ray, seen["sweep"].ray_workers) == ("auto", 3)


def test_ray_flag_without_ray_is_refused_in_one_line_before_any_work(tmp_path):
    blocker = tmp_path / "noray"
    blocker.mkdir()
    (blocker / "ray.py").write_text("raise ImportError('no ray here')\n")
    (blocker / "sitecustomize.py").write_text(
        "import importlib.util, sys\n_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a, **k: None if name == 'ray' else _find(name, *a, **k)\n")
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    for argv in (["profile", "--output", str(tmp_path / "p.json"), "--ray"],
                 ["sweep", "--output", str(tmp_path / "s"), "--ray", "auto", "--ray-workers", "2"]):
        done = subprocess.run([sys.executable, "-m", "allocmoe", *argv], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2
        assert done.stderr.strip() == "allocmoe: error: --ray needs Ray; pip install 'allocmoe[ray]'"
        assert not (tmp_path / "p.json").exists() and not (tmp_path / "s").exists()
