"""Profiling and sweeping on Ray (calibrate/distributed.py): a local Ray instance of two one-thread
workers gives the single-process table bit for bit, also when a worker is killed mid-run, with every
cell reported once; a killed driver resumes from the partial file; `--ray` without Ray is refused."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from allocmoe.calibrate.profile import profile_cells, profile_sensitivity

ray = pytest.importorskip("ray")

TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(2000))
CFG = {"seq_len": 32, "max_tokens": 1024, "batch_size": 4, "progress": False}    # one thread, as the workers
RAY = {"ray": "local", "ray_workers": 2, "threads_per_worker": 1}


@pytest.fixture(scope="module")
def single(tiny_folder):
    assert torch.get_num_threads() == 1            # conftest: the reference uses the workers' thread count
    return profile_sensitivity(str(tiny_folder), None, TEXT, CFG)


def worker_pids() -> list[int]:
    """Processes of live profile workers (Ray titles them `ray::_ProfileWorker...`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if title.startswith(b"ray::_ProfileWorker"):
                found.append(int(entry.name))
    return found


def test_two_workers_give_the_single_process_table_even_when_one_is_killed(tiny_folder, single, tmp_path):
    configurations = profile_cells(single["num_layers"], single["k_orig"])
    reported, killed = [], []

    def kill_one_worker(layer, k):                 # after the first cell arrives: SIGKILL a busy worker
        reported.append((layer, k))
        if not killed:
            pids = worker_pids()
            assert pids, "no Ray profile worker process found"
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

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

    class Stop(Exception):
        pass

    def stop_after_three(layer, k, seen=[]):
        seen.append((layer, k))
        if len(seen) == 3:
            raise Stop

    with pytest.raises(Stop):                      # the driver dies after writing three cells
        profile_sensitivity(str(tiny_folder), None, TEXT, CFG, output=output, on_cell=stop_after_three)
    assert not ray.is_initialized()
    reported = []
    profile = profile_sensitivity(str(tiny_folder), None, TEXT, {**CFG, **RAY}, output=output,
                                  on_cell=lambda layer, k: reported.append((layer, k)))
    assert profile["sensitivity"] == single["sensitivity"]
    assert profile["provenance"]["configurations_resumed"] == 3
    assert len(reported) == profile["provenance"]["configurations_run"] - 3


def test_ray_refuses_a_loaded_model_and_max_memory(tiny_folder):
    from allocmoe.errors import AllocMoeError
    from allocmoe.models import load_model

    model, tok = load_model(tiny_folder)
    with pytest.raises(AllocMoeError, match="folder"):
        profile_sensitivity(model, tok, TEXT, {**CFG, **RAY})
    with pytest.raises(AllocMoeError, match="--max-memory"):
        profile_sensitivity(str(tiny_folder), None, TEXT, {**CFG, **RAY, "max_memory": "300MiB"})


def test_ray_flag_without_ray_is_refused_in_one_line_before_any_work(tmp_path):
    blocker = tmp_path / "noray"
    blocker.mkdir()
    (blocker / "ray.py").write_text("raise ImportError('no ray here')\n")
    (blocker / "sitecustomize.py").write_text(
        "import importlib.util, sys\n_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a, **k: None if name == 'ray' else _find(name, *a, **k)\n")
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    for argv in (["profile", "--output", str(tmp_path / "p.json"), "--ray"],
                 ["sweep", "--output", str(tmp_path / "s"), "--ray", "auto"]):
        done = subprocess.run([sys.executable, "-m", "allocmoe", *argv], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2
        assert done.stderr.strip() == "allocmoe: error: --ray needs Ray; pip install 'allocmoe[ray]'"
        assert not (tmp_path / "p.json").exists() and not (tmp_path / "s").exists()


def test_a_ray_sweep_gives_the_single_process_table(tiny_folder, tmp_path):
    from allocmoe.calibrate.profile import ProfileConfig
    from allocmoe.measure.sweep import sweep
    from allocmoe.models import load_model

    config = {"budgets": ("1/2", "2/3"), "methods": ("uniform", "alloc-moe", "top-p"), "eval_max_tokens": 256,
              "seq_len": 32, "batch_size": 4, "progress": False,
              "profile": ProfileConfig(max_tokens=256, progress=False)}
    model, tok = load_model(tiny_folder)
    single = sweep(model, tok, TEXT, TEXT, config)
    on_ray = sweep(str(tiny_folder), None, TEXT, TEXT, {**config, "ray": "local",
                   "profile": ProfileConfig(max_tokens=256, progress=False, ray_workers=2)}, output_dir=tmp_path / "s")
    assert not ray.is_initialized()
    assert on_ray["rows"] == single["rows"] and on_ray["full"] == single["full"]
    assert on_ray["calibration"] == single["calibration"]
    assert (tmp_path / "s" / "results.json").is_file()
