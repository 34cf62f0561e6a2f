"""Every long job shows a tqdm bar on stderr with work done of the total (and time left), and none
when its `progress` switch (the CLI's --quiet) is off."""

import re

import pytest
import torch

from allocmoe.calibrate.methods import allocate
from allocmoe.calibrate.profile import profile_sensitivity
from allocmoe.measure.analyze import analyze_plan
from allocmoe.measure.bench import BenchConfig, benchmark
from allocmoe.scoring import tokenize_windows
from allocmoe.pipelines.sweep import sweep
from allocmoe.models import load_model

TEXT = " ".join(f"word{i % 37} and thing{i % 11}." for i in range(200))
SMALL = {"seq_len": 32, "calib_tokens": 128, "windows_per_pass": 4}


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    model, tok = load_model(tiny_folder)
    profile = profile_sensitivity(model, tok, TEXT, {**SMALL, "progress": False})
    return model, tok, profile


def _allocation(method, budget="0.5"):
    def run(model, tok, profile, progress):
        allocate(budget, method, profile=profile, model=model, tokenizer=tok, calib_text=TEXT,
                 config={"seq_len": 32, "calib_tokens": 128, "lexi_samples": 16, "progress": progress})
    return run


def _profile(model, tok, profile, progress):
    profile_sensitivity(model, tok, TEXT, {**SMALL, "progress": progress})


def _sweep(model, tok, profile, progress):
    sweep(model, tok, TEXT, TEXT, {"budgets": ("1/2",), "methods": ("uniform", "alloc-l"), "eval_tokens": 128,
                                   "seq_len": 32, "progress": progress}, profile=profile)


def _analyze(model, tok, profile, progress):
    plan = allocate("0.5", "uniform", model=model)
    analyze_plan(model, tok, plan, tokenize_windows(tok, TEXT, 32, 128), progress=progress)


def _bench(model, tok, profile, progress):
    plan = allocate("0.5", "alloc-t", model=model)
    benchmark(model, plan, BenchConfig(input_len=8, output_len=2, repeats=1, warmup=1), progress=progress)


# job -> (runs it, the bar's label, its total on the tiny model: 3 MoE layers, K = 4)
JOBS = {
    "lexi": (_allocation("lexi"), "lexi", 3 * 4),                 # a pass per layer and k
    "top-p": (_allocation("top-p"), "top-p", 1),                  # batches of the calibration pass
    "naee": (_allocation("naee"), "naee", 1),
    # alloc-l, alloc-moe and alloc-t at k_base 0, 1, 2, each with and without the substitute, and the (k, stand-in)
    # DP's allocation as alloc-l and alloc-moe at k_base 0, 1, 2 (at 3/4: at 1/2 this model's rank-8 stand-ins, 0.35
    # of an expert each, leave too little for one expert per layer)
    "auto": (_allocation("auto", "0.75"), "auto", 14 + 4),
    "profile": (_profile, "profile", 3 * 4 - 2),                  # cells
    "sweep": (_sweep, "sweep", 2),                                # rows
    "analyze": (_analyze, "perplexity", 1),                       # a bar per pass (cleared when done)
    "bench": (_bench, "bench", 2 * 3),                            # rounds x (prefill + decode steps)
}


@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_bar_with_done_and_total_on_stderr_unless_progress_is_off(tiny, capfd, job):
    run, label, total = JOBS[job]
    model, tok, profile = tiny
    torch.manual_seed(0)
    capfd.readouterr()
    run(model, tok, profile, True)
    out, err = capfd.readouterr()
    assert out == ""                                              # bars never go to stdout
    # done/total, elapsed<left; a bar that stays shows its last state (analyze's bars clear themselves)
    done = "0" if job == "analyze" else str(total)
    assert re.search(rf"{re.escape(label)}: +\d+%\|[^|]*\| {done}/{total} \[\d\d:\d\d<(\d\d:\d\d|\?)", err), err
    run(model, tok, profile, False)
    out, err = capfd.readouterr()
    assert out == "" and err == "", err
