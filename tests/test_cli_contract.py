"""Bad invocations, table-driven (issue 21's contract): each exits 2 with one error line naming the
problem, no traceback, before any forward pass (and, unless the row says the check needs them, before
the weights are read: both counted, never timed), and leaves nothing behind in any folder it was given or in
the working folder. The table grows with every refusal we add.
Every line says how to fix the problem, after "; ".
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest

from allocmoe.cli import main

try:
    import lm_eval  # noqa: F401
    UNKNOWN_TASK = "unknown lm-eval task"
except ImportError:         # without the [eval] extra the same line asks for it
    UNKNOWN_TASK = "needs lm-evaluation-harness"



class Row(NamedTuple):
    argv: list[str]
    message: str            # a substring of the one error line
    loads: bool = False     # the check needs the weights (it lives past the load, still before any pass)


def cases(root: Path, model: Path) -> list[Row]:
    """Every row, built from paths alone (collection builds it with placeholders for the ids)."""
    m = ["--model", str(model)]

    def f(name: str) -> str:
        return str(root / name)

    new = f("new/x.json")                 # its folder does not exist
    plan, other_plan, notjson = f("plan.json"), f("other_plan.json"), f("notjson.json")
    other_profile = f("other_profile.json")
    P = ["profile", *m]
    po = ["--output", f("p.json")]
    A = ["allocate", *m, "--output", f("p.json")]
    U = [*A, "--method", "uniform"]
    D = [*A, "--max-distinct-experts"]
    E = ["eval", *m]
    S = ["sweep", *m, "--output", f("sweep"), "--eval-tokens", "64", "--calib-tokens", "64", "--seq-len", "32"]
    B = ["bench", *m, "--input-len", "16", "--output-len", "4"]
    G = ["generate", *m, "--prompt", "hi"]
    V = ["serve", *m, "--port", "0"]      # port 0 is refused last: a missing check cannot start a server
    X = ["export", "--format", "vllm"]
    return [
        # -- profile ---------------------------------------------------------------------------------
        Row([*P, "--windows-per-pass", "0", *po], "--windows-per-pass: must be above 0"),
        Row([*P, "--batch-size", "0", *po], "--batch-size: must be above 0"),      # the deprecated spelling
        Row([*P, "--batch-size", "-3", *po], "must be above 0"),
        Row([*P, "--batch-size", "2.5", *po], "must be a whole number"),
        Row([*P, "--batch-size", "1e400", *po], "must be a whole number"),
        Row([*P, "--calib-tokens", "0", *po], "--calib-tokens: must be above 0"),
        Row([*P, "--calib-tokens", "1", *po], ">= 2, got 1"),
        Row([*P, "--calib-tokens", "5", *po], "too short"),
        Row([*P, "--seq-len", "nan", *po], "must be a whole number"),
        Row([*P, "--seq-len", "inf", *po], "must be a whole number"),
        Row([*P, "--seq-len", "1", *po], "seq_len (--seq-len) must be a whole number >= 2"),
        Row([*P, "--seq-len", "257", *po], "outside this model's context"),
        Row([*P, "--output", new], "does not exist"),
        Row([*P, "--output", f("a_dir")], "is a folder"),
        Row([*P, "--output", f("a_file/p.json")], "which is a file"),
        Row([*P, "--calib-text", f("latin1.txt"), *po], "UTF-8"),
        Row([*P, "--calib-text", f("empty.txt"), *po], "is empty"),
        Row([*P, "--calib-text", f("blank.txt"), *po], "is empty"),
        Row([*P, "--calib-text", f("short.txt"), *po], "too short"),
        Row([*P, "--calib-text", f("a_dir"), *po], "is a folder"),
        Row([*P, "--calib-text", f("missing.txt"), *po], "text file not found"),
        Row([*P, "--calib-text", "builtin:nope", *po], "unknown built-in split 'nope'"),
        Row(["profile", "--model", f("m_trunc"), *po], "truncated or corrupt"),
        Row(["profile", "--model", f("m_badjson"), *po], "is not JSON"),
        Row([*P, "--ray", "--max-memory", "300MiB", *po], "--ray and --max-memory cannot be combined yet"),
        Row([*P, "--ray-workers", "2", *po], "ray_workers (--ray-workers) is 2 but ray (--ray) is not given"),
        Row([*P, "--ray", "--ray-workers", "0", *po], "--ray-workers: must be above 0"),
        Row([*P, "--ray", "auto", "--ray-workers", "two", *po], "--ray-workers: must be a whole number"),
        # -- allocate: budgets (the tiny model: 3 MoE layers x K=4, full budget 12) -------------------
        Row([*U, "--budget", "nan"], "is not a number"),
        Row([*U, "--budget", "inf"], "is not a number"),
        Row([*U, "--budget", "nan%"], "is not a number"),
        Row([*U, "--budget", "abc"], "is not a number"),
        Row([*U, "--budget", "1/0"], "is not a number"),
        Row([*U, "--budget", ""], "is not a number"),
        Row([*U, "--budget", "-0.5"], "must be positive"),
        Row([*U, "--budget", "0"], "must be positive"),
        Row([*U, "--budget", "0%"], "must be positive"),
        Row([*U, "--budget", "1e-400"], "must be positive"),
        Row([*U, "--budget", "2"], "below 3, the minimum"),
        Row([*U, "--budget", "13"], "above the full budget 12"),
        Row([*U, "--budget", "150%"], "above the full budget"),
        Row([*U, "--budget", "1e400"], "is not a number"),
        # -- allocate: flags, profiles, calibration ---------------------------------------------------
        Row([*A, "--budget", "0.5", "--method", "bogus"], "invalid choice: 'bogus'"),
        Row([*A, "--budget", "0.5", "--method", "alloc-t", "--k-base", "0"], "--k-base: must be above 0"),
        Row([*A, "--budget", "0.5", "--method", "alloc-t", "--k-base", "-1"], "--k-base: must be above 0"),
        Row([*A, "--budget", "0.5", "--method", "alloc-t", "--pool", "nope"], "invalid choice: 'nope'"),
        Row([*A, "--budget", "0.5", "--meth", "uniform"], "unrecognized"),
        Row([*A, "--budget", "0.5", "--method", "alloc-l", "--profile", other_profile], "made for another model"),
        # a perplexity target instead of a budget: one of the two, a number, a value some budget could meet
        Row([*A, "--method", "uniform"], "no --budget was given; give --budget B (e.g. 0.5) or --target-ppl T"),
        Row([*A, "--budget", "0.5", "--target-ppl", "5%"], "both --budget and --target-ppl were given"),
        Row([*A, "--target-ppl", "abc"], "perplexity target 'abc' is not a number"),
        Row([*A, "--target-ppl=-3%"], "perplexity target '-3%' is out of range"),
        Row([*A, "--target-ppl", "0.5"], "perplexity target '0.5' is out of range"),
        Row([*A, "--target-ppl", "nan"], "perplexity target 'nan' is out of range"),
        Row([*A, "--budget", "0.5", "--method", "alloc-moe", "--profile", other_profile], "made for another model"),
        Row([*U, "--budget", "0.5", "--profile", other_profile], "made for another model"),
        Row([*A, "--budget", "0.5", "--method", "alloc-l", "--profile", f("missing.json")], "profile file not found"),
        Row([*A, "--budget", "0.5", "--method", "alloc-l", "--profile", notjson], "corrupt or truncated"),
        Row([*A, "--budget", "0.5", "--method", "alloc-l", "--profile", f("a_dir")], "is a folder"),
        Row([*A, "--budget", "0.5", "--method", "top-p", "--calib-text", f("short.txt")], "too short"),
        Row([*A, "--budget", "0.5", "--method", "top-p", "--calib-text", f("empty.txt")], "is empty"),
        Row([*A, "--budget", "0.5", "--method", "naee", "--calib-tokens", "8"], "too short"),
        Row([*A, "--budget", "0.5", "--method", "top-p", "--seq-len", "0"], "--seq-len: must be above 0"),
        Row([*A, "--budget", "0.5", "--method", "top-p", "--seq-len", "300"], "outside this model's context"),
        Row([*A, "--budget", "0.5", "--method", "alloc-l", "--seq-len", "300"], "outside this model's context"),
        Row([*A, "--budget", "0.5", "--method", "alloc-l", "--calib-text", f("short.txt")], "too short"),
        Row([*A, "--budget", "0.5", "--method", "alloc-l", "--calib-text", f("a_dir")], "is a folder"),
        # -- allocate: a latency budget (distinct experts per decode step; 8 experts, K=4) ---------------
        Row([*D, "abc"], "--max-distinct-experts 'abc' is not a number"),
        Row([*D, "nan"], "is not a number"),
        Row([*D, "0"], "must be positive"),
        Row([*D, "150%"], "is a fraction above 1"),
        Row([*D, "9"], "more than this model's 8 experts per layer"),
        Row([*D, "0.05"], "less than one distinct expert per layer"),
        Row([*D, "0.5", "--budget", "0.5"], "both --budget and --max-distinct-experts were given"),
        Row([*D, "0.5", "--target-ppl", "5%"], "both --target-ppl and --max-distinct-experts were given"),
        Row([*D, "0.5", "--method", "alloc-l"], "--method does not apply with --max-distinct-experts"),
        Row([*D, "0.5", "--profile", other_profile], "--profile does not apply with --max-distinct-experts"),
        Row([*D, "0.5", "--k-base", "2"], "--k-base does not apply"),
        Row([*D, "0.5", "--refine", "2"], "--refine does not apply"),
        Row([*D, "0.5", "--k-floor", "5"], "k_floor (--k-floor) 5 is above this model's K = 4"),
        Row([*D, "0.5", "--k-floor", "0"], "--k-floor: must be above 0"),
        Row([*D, "0.5", "--decode-batch", "0"], "--decode-batch: must be above 0"),
        Row([*D, "0.5", "--m-step", "0"], "--m-step: must be above 0"),
        Row([*D, "0.5", "--decode-batch", "64", "--calib-tokens", "64"], "fewer than 2 tokens per window"),
        Row([*D, "0.5", "--decode-batch", "16", "--seq-len", "64", "--calib-tokens", "512"],
            "needs at least 16 windows"),
        Row([*D, "0.5", "--calib-text", f("short.txt")], "too short"),
        Row([*D, "0.5", "--seq-len", "300"], "outside this model's context"),
        Row([*U, "--budget", "0.5", "--decode-batch", "16"], "--decode-batch applies only with --max-distinct-experts"),
        Row([*U, "--budget", "0.5", "--k-floor", "2"], "--k-floor applies only with --max-distinct-experts"),
        Row(["allocate", *m, "--budget", "0.5", "--method", "uniform", "--output", new], "does not exist"),
        Row(["allocate", *m, "--budget", "0.5", "--method", "uniform", "--output", f("a_dir")], "is a folder"),
        # -- model folders (refused before any weights are read) --------------------------------------
        *[Row(["allocate", "--model", f(folder), "--budget", "0.5", "--method", "uniform", "--output", f("p.json")],
              message) for folder, message in [
            ("m_badjson", "is not JSON"), ("m_emptycfg", "is not JSON"), ("m_listcfg", "is not a JSON object"),
            ("m_notype", "names no model_type"), ("m_llama", "unsupported architecture 'llama'"),
            ("m_phimoe", "sparsemixer"), ("m_unknown", "unsupported architecture 'gpt17'"),
            ("m_nocfg", "has no config.json"),
            ("m_trunc", "truncated or corrupt"), ("m_corrupt", "truncated or corrupt"),
            ("m_stub", "truncated or corrupt"), ("m_badheader", "truncated or corrupt"),
            ("m_shards", "names weight files that are missing"), ("m_badindex", "is corrupt"),
            ("missing_folder", "model folder not found"), ("a_file", "is a file")]],
        # config.json alone: uniform, ascending, descending and alloc-t plan from it (test_config_only.py);
        # a run that needs the weights is refused, naming the methods that do not
        *[Row(["allocate", "--model", f("m_noweights"), "--output", f("p.json"), *flags],
              f"has no weights (config.json alone), and {reason}") for flags, reason in [
            (["--budget", "0.5", "--method", "lexi"], "method lexi"),
            (["--budget", "0.5"], "method auto"),
            (["--budget", "0.5", "--method", "alloc-l"], "method alloc-l without a profile"),
            (["--budget", "0.5", "--method", "uniform", "--refine", "1"], "the refinement"),
            (["--max-distinct-experts", "0.5"], "a latency budget")]],
        Row(["profile", "--model", f("m_noweights"), *po], "has no weights (no model.safetensors)"),
        Row(["eval", "--model", f("m_noweights")], "has no weights (no model.safetensors)"),
        # -- eval --------------------------------------------------------------------------------------
        Row([*E, "--eval-tokens", "-1"], "--eval-tokens: must be above 0"),
        Row([*E, "--decode-batch", "0"], "--decode-batch: must be above 0"),
        Row([*E, "--decode-batch", "2.5"], "--decode-batch: must be a whole number"),
        Row([*E, "--decode-batch", "500", "--seq-len", "32", "--eval-tokens", "256"], "needs at least 500 windows"),
        Row([*E, "--eval-tokens", "3"], "too short"),
        Row([*E, "--limit", "0"], "--limit: must be above 0"),
        Row([*E, "--num-fewshot", "-1"], "--num-fewshot: must be at least 0"),
        Row([*E, "--num-fewshot", "2"], "applies only with tasks"),
        Row([*E, "--limit", "5"], "applies only with tasks"),
        Row([*E, "--include-path", f("a_dir")], "applies only with tasks"),
        Row([*E, "--tasks", "nosuchtask"], UNKNOWN_TASK),
        Row([*E, "--tasks", ","], "names no task"),
        Row([*E, "--tasks", "allocmoe_cloze", "--include-path", f("missing_dir")], "is not a folder"),
        Row([*E, "--tasks", "allocmoe_cloze", "--include-path", f("a_file")], "is not a folder"),
        Row([*E, "--text", f("missing.txt")], "not found"),
        Row([*E, "--text", f("a_dir")], "is a folder"),
        Row([*E, "--text", f("empty.txt")], "is empty"),
        Row([*E, "--text", f("short.txt")], "too short"),
        Row([*E, "--text", f("latin1.txt")], "not UTF-8"),
        Row([*E, "--plan", f("missing.json")], "not found"),
        Row([*E, "--plan", notjson], "corrupt or truncated"),
        Row([*E, "--plan", other_plan], "made for another model"),
        Row([*E, "--plan", f("a_dir")], "is a folder"),
        Row([*E, "--seq-len", "4096"], "outside this model's context of 1..256"),
        Row([*E, "--seq-len", "1"], "got 1"),
        Row([*E, "--batch-size", "0"], "--batch-size: must be above 0"),
        Row([*E, "--output", f("a_dir")], "is a folder"),
        Row([*E, "--output", new], "does not exist"),
        Row([*E, "--output", f("a_file/e.json")], "which is a file"),
        Row([*E, "--out", f("e.json")], "unrecognized arguments: --out"),
        Row(["eval", "--model", f("a_dir")], "config"),
        Row(["eval", "--model", f("m_corrupt")], "truncated or corrupt"),
        Row(["eval", "--model", f("m_notok")], "cannot load the tokenizer"),
        # -- sweep: everything before the weights, profiling or the first pass -------------------------
        Row([*S, "--budgets", "0.5,nan"], "is not a number"),
        Row([*S, "--budgets", "0.5,abc"], "is not a number"),
        Row([*S, "--budgets", "0.5,13"], "above the full budget"),
        Row([*S, "--budgets", "2"], "below 3, the minimum"),
        Row([*S, "--budgets", ""], "the sweep has no budget or no method"),
        Row([*S, "--budgets", "0.5,1e400"], "is not a number"),
        Row([*S, "--methods", "uniform,bogus"], "unknown method(s) ['bogus']"),
        Row([*S, "--methods", ","], "the sweep has no budget or no method"),
        Row([*S, "--profile", notjson], "corrupt or truncated"),
        Row([*S, "--profile", other_profile], "made for another model"),
        Row([*S, "--profile", f("a_dir")], "is a folder"),
        Row([*S, "--text", f("short.txt")], "too short"),
        Row([*S, "--text", f("empty.txt")], "is empty"),
        Row([*S, "--eval-tokens", "4"], "too short"),
        Row([*S, "--calib-text", f("short.txt"), "--methods", "uniform,top-p"], "too short"),
        Row([*S, "--calib-text", f("short.txt"), "--methods", "alloc-l"], "too short"),
        Row([*S, "--seq-len", "300"], "outside this model's context"),
        Row([*S, "--tasks", "nosuchtask"], UNKNOWN_TASK),
        Row([*S, "--num-fewshot", "1"], "applies only with tasks"),
        Row([*S, "--k-base", "0"], "--k-base: must be above 0"),
        Row([*S, "--limit", "-1"], "--limit: must be above 0"),
        Row(["sweep", *m, "--eval-tokens", "1e9999"], "must be a whole number"),
        Row(["sweep", *m, "--output", f("a_file")], "is a file"),
        Row(["sweep", *m, "--output", f("a_file/sweep")], "which is a file"),
        Row(["sweep", "--model", f("m_llama")], "unsupported architecture"),
        Row([*S, "--ray-workers", "2"], "ray_workers (--ray-workers) is 2 but ray (--ray) is not given"),
        Row([*S, "--ray", "--ray-workers=-1"], "--ray-workers: must be above 0"),
        # -- compare -----------------------------------------------------------------------------------
        Row(["compare", f("missing.json"), plan], "not found"),
        Row(["compare", notjson, plan], "corrupt or truncated"),
        Row(["compare", f("latin1.txt"), plan], "corrupt or truncated"),
        Row(["compare", plan, plan], "no per-item task scores"),
        Row(["compare", plan, plan, "--metric", "f1"], "invalid choice: 'f1'"),
        Row(["compare", plan, plan, "--output", new], "does not exist"),
        Row(["compare", plan, plan, "--output", f("a_dir")], "is a folder"),
        Row(["compare", f("a_dir"), plan], "is a folder"),
        # -- analyze -----------------------------------------------------------------------------------
        Row(["analyze", *m], "the following arguments are required: --plan"),
        Row(["analyze", *m, "--plan", f("missing.json")], "not found"),
        Row(["analyze", *m, "--plan", notjson], "corrupt or truncated"),
        Row(["analyze", *m, "--plan", other_plan], "made for another model"),
        Row(["analyze", *m, "--plan", plan, "--text", f("short.txt")], "too short"),
        Row(["analyze", *m, "--plan", plan, "--seq-len", "300"], "outside this model's context"),
        Row(["analyze", *m, "--plan", plan, "--eval-tokens", "0"], "--eval-tokens: must be above 0"),
        Row(["analyze", *m, "--plan", plan, "--output", f("a_file")], "is a file"),
        Row(["analyze", "--model", f("m_trunc"), "--plan", plan], "truncated or corrupt"),
        # -- bench -------------------------------------------------------------------------------------
        Row([*B, "--plan", plan, "--device", "cuda:7"], "device 'cuda:7'"),
        Row([*B, "--plan", plan, "--device", "tpu"], "not a device torch knows"),
        Row([*B, "--plan", plan, "--device", ""], "not a device torch knows"),
        Row([*B, "--plan", plan, "--device", "cpu:3"], "the CPU takes no index"),
        Row([*B, "--plan", plan, "--device", "meta"], "holds no data"),
        Row([*B, "--plan", plan, "--device", "hpu"], "no hpu device is available"),
        Row([*B, "--plan", plan, "--budget", "0.5"], "--plan and --budget were both given; give one of --plan"),
        Row([*B], "nothing to time; give one of --plan"),
        Row([*B, "--budget", "0.5", "--max-distinct-experts", "0.5"], "were both given"),
        Row([*B, "--plan", plan, "--budget", "0.5", "--max-distinct-experts", "4"], "were all given"),
        Row([*B, "--max-distinct-experts", "abc"], "--max-distinct-experts 'abc' is not a number"),
        Row([*B, "--max-distinct-experts", "nan"], "is not a number"),
        Row([*B, "--max-distinct-experts", "1e400"], "is not a number"),
        Row([*B, "--max-distinct-experts", "0"], "must be positive"),
        Row([*B, "--max-distinct-experts=-2"], "must be positive"),
        Row([*B, "--max-distinct-experts", "150%"], "is a fraction above 1"),
        Row([*B, "--max-distinct-experts", "2.5"], "neither a fraction <= 1 nor a whole count"),
        Row([*B, "--max-distinct-experts", "9"], "more than this model's 8 experts"),
        Row([*B, "--budget", "nan"], "is not a number"),
        Row([*B, "--budget", "0"], "must be positive"),
        Row([*B, "--budget", "1e400"], "is not a number"),
        Row([*B, "--budget", "0.5", "--method", "alloc-l"], "needs a profile or calibration"),
        Row([*B, "--budget", "0.5", "--method", "bogus"], "unknown method 'bogus'"),
        Row([*B, "--budget", "0.5", "--k-base", "0"], "--k-base: must be above 0"),
        Row([*B, "--plan", other_plan], "made for another model"),
        Row([*B, "--plan", notjson], "corrupt or truncated"),
        Row([*B, "--plan", f("a_dir")], "is a folder"),
        Row(["bench", *m, "--plan", plan, "--input-len", "4096"], "past this model's context of 256"),
        Row(["bench", *m, "--plan", plan, "--input-len", "250", "--output-len", "10"], "260 positions"),
        Row(["bench", *m, "--plan", plan], "288 positions"),        # the defaults, 256 + 32, do not fit
        Row([*B, "--plan", plan, "--repeats", "0"], "--repeats: must be above 0"),
        Row([*B, "--plan", plan, "--warmup", "-1"], "--warmup: must be at least 0"),
        Row([*B, "--plan", plan, "--input-len", "inf"], "must be a whole number"),
        Row([*B, "--plan", plan, "--batch-size", "0"], "--batch-size: must be above 0"),
        Row([*B, "--plan", plan, "--sequences", "1000000000"], "lower --sequences"),
        Row([*B, "--plan", plan, "--num-layers", "2"], "applies only to synthetic models"),
        Row([*B, "--plan", plan, "--seq-len", "300"], "--seq-len does not apply to bench"),
        Row([*B, "--plan", plan, "--dtype", "float64"], "invalid choice: 'float64'"),
        Row([*B, "--plan", plan, "--output", f("a_dir")], "is a folder"),
        Row(["bench", "--model", "synthetic:nope", "--budget", "0.5"], "unknown synthetic shape"),
        Row(["bench", "--model", f("m_trunc"), "--plan", plan], "truncated or corrupt"),
        Row(["bench", "--model", f("m_llama"), "--plan", plan], "unsupported architecture"),
        # -- generate ----------------------------------------------------------------------------------
        Row([*G, "--max-new-tokens", "0"], ">= 1, got 0"),
        Row([*G, "--max-new-tokens", "-1"], ">= 1, got -1"),
        Row([*G, "--max-new-tokens", "1e400"], "invalid int value"),
        Row([*G, "--max-new-tokens", "300"], "exceed the model's context of 256", loads=True),
        Row([*G, "--temperature", "nan"], "temperature must be a finite number"),
        Row([*G, "--temperature", "inf"], "temperature must be a finite number"),
        Row([*G, "--temperature", "1e400"], "temperature must be a finite number"),
        Row([*G, "--temperature", "-1"], "temperature must be a finite number"),
        Row([*G, "--top-p", "0"], "top_p must lie in (0, 1]"),
        Row([*G, "--top-p", "1.5"], "top_p must lie in (0, 1]"),
        Row([*G, "--top-p", "nan"], "top_p must lie in (0, 1]"),
        Row([*G, "--seed", "1.5"], "invalid int value"),
        Row([*G, "--stop", ""], "stop strings must be non-empty"),
        Row(["generate", *m, "--prompt", ""], "the prompt is empty"),
        Row(["generate", *m, "--prompt-file", f("empty.txt")], "the prompt is empty"),
        Row(["generate", *m, "--prompt-file", f("a_dir")], "is a folder"),
        Row(["generate", *m, "--prompt-file", f("latin1.txt")], "not UTF-8"),
        Row(["generate", *m, "--prompt-file", f("missing.txt")], "prompt file not found"),
        Row([*G, "--prompt-file", f("short.txt")], "not allowed with argument --prompt"),
        Row(["generate", *m], "one of the arguments --prompt --prompt-file is required"),
        Row([*G, "--plan", other_plan], "made for another model"),
        Row([*G, "--plan", notjson], "corrupt or truncated"),
        Row([*G, "--chat-template", f("missing.jinja"), "--chat"], "chat template file not found"),
        Row([*G, "--chat-template", f("short.txt")], "applies only with --chat"),
        Row([*G, "--chat"], "has no chat template", loads=True),
        Row(["generate", "--model", f("m_corrupt"), "--prompt", "hi"], "truncated or corrupt"),
        # -- serve -------------------------------------------------------------------------------------
        Row(["serve", *m, "--port", "70000"], "between 1 and 65535"),
        Row(["serve", *m, "--port", "abc"], "invalid int value"),
        Row([*V, "--host", "no such host"], "is not an address of this machine"),
        Row([*V, "--max-batch-size", "0"], "--max-batch-size must be >= 1"),
        Row([*V, "--max-queue", "-1"], "--max-queue must be >= 0"),
        Row([*V, "--max-model-len", "0"], "--max-model-len must be >= 1"),
        Row([*V, "--max-model-len", "100000"], "the model's context of 256"),
        Row([*V, "--num-threads", "0"], "--num-threads must be >= 1, got 0"),
        Row([*V, "--api-key", " "], "--api-key is empty"),
        Row([*V, "--plan", f"bad name={plan}"], "must be letters, digits"),
        Row([*V, "--plan", f"a={plan}", "--plan", f"a={plan}"], "two plans are named 'a'"),
        Row([*V, "--plan", f"a={f('missing.json')}"], "plan file not found"),
        Row([*V, "--plan", f"a={notjson}"], "corrupt or truncated"),
        Row([*V, "--plan", f"a={other_plan}"], "made for another model"),
        Row([*V, "--profile", other_profile], "made for another model"),
        Row([*V, "--profile", f("missing.json")], "profile file not found"),
        Row([*V, "--log-level", "loud"], "invalid choice: 'loud'"),
        Row([*V, "--chat-template", f("missing.jinja")], "chat template file not found"),
        Row(["serve", "--model", f("m_corrupt"), "--port", "0"], "truncated or corrupt"),
        Row(["serve", "--model", f("m_nocfg"), "--port", "0"], "has no config.json"),
        # -- export ------------------------------------------------------------------------------------
        Row(["export", "--format", "tensorrt", "--plan", plan], "invalid choice: 'tensorrt'"),
        Row([*X], "no plan given; give --plan PLAN.json"),
        Row([*X, "--plan", f("missing.json")], "plan file not found"),
        Row([*X, "--plan", notjson], "corrupt or truncated"),
        Row([*X, "--plan", f("a_dir")], "is a folder"),
        Row(["export", "--format", "sglang", "--plan", plan, "--request-plan", f"a={plan}"], "one engine-wide k"),
        Row([*X, "--plan", plan, "--request-plan", "noequals"], "give NAME=PLAN.json"),
        Row([*X, "--plan", plan, "--request-plan", f"a={other_plan}"], "made for different models"),
        Row([*X, "--plan", plan, "--output", new], "does not exist"),
        Row([*X, "--plan", plan, "--output", f("a_dir")], "is a folder"),
        Row([*X, "--plan", plan, "--arch", "llama"], "--arch applies only to --format llama.cpp"),
        Row(["export", "--format", "llama.cpp", "--plan", plan, "--arch", ""], "--arch is empty"),
        Row([*X, "--plan", plan, "--model", ""], "--model is empty"),
        # -- issue 39: flags and values --
        # a k_base the plan could not keep (the tiny model: K = 4, 3 MoE layers; 0.5 gives 2 per layer)
        Row([*A, "--budget", "0.5", "--method", "alloc-t", "--k-base", "5"], "above this model's K = 4"),
        Row([*A, "--budget", "0.5", "--method", "alloc-t", "--k-base", "3"], "give a value in 1..2"),
        Row([*A, "--budget", "0.5", "--method", "alloc-moe", "--k-base", "7"], "above this model's K = 4"),
        Row([*A, "--budget", "0.5", "--method", "auto", "--k-base", "5"], "above this model's K = 4"),
        # a flag the run would not read is refused, naming what reads it
        Row([*U, "--budget", "0.5", "--pool", "sequence"], "--pool does not apply to --method uniform"),
        Row([*U, "--budget", "0.5", "--k-base", "1"], "--k-base does not apply to --method uniform"),
        Row([*U, "--budget", "0.5", "--calib-tokens", "64"], "--calib-tokens does not apply to --method uniform"),
        Row([*U, "--budget", "0.5", "--calib-text", f("short.txt")], "--calib-text does not apply"),
        Row([*U, "--budget", "0.5", "--seq-len", "32"], "--seq-len does not apply to --method uniform"),
        Row([*U, "--budget", "0.5", "--windows-per-pass", "2"], "--windows-per-pass does not apply to --method uniform"),
        Row([*U, "--budget", "0.5", "--no-prefix-cache"], "--no-prefix-cache does not apply"),
        Row([*A, "--budget", "0.5", "--method", "ascending", "--k-base", "2"], "--k-base does not apply"),
        Row([*A, "--budget", "0.5", "--method", "lexi", "--calib-tokens", "64"], "does not apply to --method lexi"),
        Row([*A, "--budget", "0.5", "--method", "alloc-l", "--pool", "batch"], "--pool does not apply"),
        Row([*A, "--budget", "0.5", "--method", "top-p", "--k-base", "2"], "--k-base does not apply to --method top-p"),
        Row([*A, "--budget", "0.5", "--method", "naee", "--no-prefix-cache"], "--no-prefix-cache does not apply"),
        Row([*A, "--target-ppl", "5%", "--method", "uniform", "--pool", "batch"], "uniform with --target-ppl"),
        Row([*D, "0.5", "--windows-per-pass", "2"], "--windows-per-pass does not apply with --max-distinct-experts"),
        Row([*B, "--plan", plan, "--method", "uniform"], "--method does not apply to --plan"),
        Row([*B, "--plan", plan, "--k-base", "2"], "--k-base does not apply to --plan"),
        Row([*B, "--budget", "0.5", "--method", "uniform", "--k-base", "1"], "--k-base does not apply"),
        Row([*B, "--budget", "0.5", "--k-base", "5"], "above this model's K = 4"),
        Row([*B, "--max-distinct-experts", "0.5", "--method", "alloc-t"], "--method does not apply"),
        Row([*E, "--decode-batch", "2", "--windows-per-pass", "2"], "--windows-per-pass does not apply with --decode-batch"),
        Row([*S, "--methods", "uniform"], "--calib-tokens does not apply to --methods uniform"),
        Row([*S, "--methods", "uniform,top-p", "--k-base", "2"], "--k-base does not apply"),
        Row([*S, "--methods", "uniform,lexi", "--profile", other_profile], "made for another model"),
        Row([*S, "--methods", "top-p", "--no-prefix-cache"], "--no-prefix-cache does not apply"),
        Row([*S, "--methods", "alloc-t", "--k-base", "3", "--budgets", "1/2"], "give a value in 1..2"),
        # values past what the input allows, refused before any pass
        Row([*P, "--windows-per-pass", "1000000000", "--seq-len", "32", "--calib-tokens", "256", *po],
            "is more than the 8 window(s) of 32 tokens"),
        Row([*P, "--calib-tokens", "100000000000", *po], "tokens the text has"),
        Row([*A, "--budget", "0.5", "--method", "top-p", "--windows-per-pass", "1000000000"], "window(s) of"),
        Row([*A, "--budget", "0.5", "--method", "top-p", "--calib-tokens", "100000000000"], "tokens the text has"),
        Row([*E, "--windows-per-pass", "1000000000"], "window(s) of"),
        Row([*E, "--eval-tokens", "100000000000"], "tokens the text has"),
        Row([*A, "--target-ppl", "1e308", "--method", "uniform"], "times the perplexity of guessing uniformly"),
        Row([*A, "--target-ppl", "1e308%", "--method", "uniform"], "times the perplexity of guessing uniformly"),
        Row([*S, "--eval-tokens", "100000000000"], "tokens the text has"),
        Row([*S, "--calib-tokens", "100000000000", "--methods", "top-p"], "tokens the text has"),
        Row([*S, "--windows-per-pass", "1000000000"], "window(s) of 32 tokens"),
        Row(["analyze", *m, "--plan", plan, "--eval-tokens", "100000000000"], "tokens the text has"),
        Row(["analyze", *m, "--plan", plan, "--windows-per-pass", "1000000000"], "window(s) of"),
        # -- issue 39: outputs and files ---------------------------------------------------------------
        *outputs_and_files(m, f, plan, other_profile),
    ]


def outputs_and_files(m: list[str], f, plan: str, other_profile: str) -> list[Row]:
    """No output may be an input, a device, FIFO or socket, an empty path or a name too long; budgets
    are the documented ASCII forms only (more in tests/test_output_safety.py)."""
    also, device, long_name = "is also an input (", "is a device", "x" * 300 + ".json"
    short, means = f("short.txt"), f("plan.means.safetensors")
    A = ["allocate", *m, "--method", "uniform"]
    B = ["bench", *m, "--input-len", "16", "--output-len", "4"]
    return [
        Row([*A, "--budget", "0.5", "--profile", other_profile, "--output", other_profile], also + "--profile"),
        Row([*A, "--budget", "0.5", "--calib-text", short, "--output", short], also + "--calib-text"),
        Row(["profile", *m, "--calib-text", short, "--output", short], also + "--calib-text"),
        Row(["eval", *m, "--plan", plan, "--output", plan], also + "--plan"),
        Row(["eval", *m, "--plan", plan, "--output", means], also + "--plan's means file"),
        Row(["eval", *m, "--text", short, "--output", short], also + "--text"),
        Row(["eval", *m, "--output", str(Path(m[1]) / "config.json")], "inside an input folder (--model"),
        Row([*B, "--plan", plan, "--output", plan], also + "--plan"),
        Row(["export", "--format", "vllm", "--plan", plan, "--output", plan], also + "--plan"),
        Row(["compare", plan, plan, "--output", plan], also + "A "),
        Row(["sweep", *m, "--output", m[1]], "is also an input folder (--model"),
        Row(["profile", *m, "--output", "/dev/null"], device),
        Row([*A, "--budget", "0.5", "--output", "/dev/null"], device),
        Row(["eval", *m, "--output", "/dev/null"], device),
        Row([*B, "--plan", plan, "--output", "/dev/null"], device),
        Row(["export", "--format", "vllm", "--plan", plan, "--output", "/dev/null"], device),
        Row(["compare", plan, plan, "--output", "/dev/null"], device),
        Row(["sweep", *m, "--output", "/dev/null"], device),
        Row(["analyze", *m, "--plan", plan, "--output", "/dev/null"], device),
        Row(["profile", *m, "--output", ""], "--output is an empty path"),
        Row(["eval", *m, "--output", ""], "--output is an empty path"),
        Row(["sweep", *m, "--output", ""], "--output is an empty path"),
        Row(["profile", *m, "--output", f(long_name)], "too long"),
        Row(["eval", *m, "--plan", "/dev/null"], "is a device, not a regular file"),
        Row(["eval", *m, "--plan", f(long_name)], "too long"),
        Row([*A, "--budget", "1_0", "--output", f("p.json")], "is not a number"),
        Row([*A, "--budget", "50 %", "--output", f("p.json")], "is not a number"),
        Row([*A, "--budget", "\u0661", "--output", f("p.json")], "is not a number"),
        Row([*B, "--budget", "\u0665\u0660%"], "is not a number"),
        Row(["allocate", *m, "--max-distinct-experts", "1_0", "--output", f("p.json")], "is not a number"),
    ]


TABLE = cases(Path("R"), Path("M"))


def _id(index: int, row: Row) -> str:
    return f"{index:03d}-" + " ".join(a.replace("R/", "") for a in row.argv if a != "M")[:80]


PARAMS = [pytest.param(i, id=_id(i, row)) for i, row in enumerate(TABLE)]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_folder):
    """Every bad input the table points at, made once."""
    from conftest import build_tiny

    from allocmoe import allocate, load_model, profile_sensitivity, static_plan
    from allocmoe.core.files import atomic_write_json
    from allocmoe.texts import read_text

    root = tmp_path_factory.mktemp("contract")
    (root / "a_file").write_text("not a folder")
    (root / "a_dir").mkdir()
    (root / "short.txt").write_text("too short")
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("  \n\n\t ")
    (root / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 500)
    (root / "notjson.json").write_text('{"format_version": 1, "lay')
    model, tok = load_model(tiny_folder)
    allocate(0.5, "uniform", model=model).save(root / "plan.json")
    other = build_tiny("olmoe", vocab_size=len(tok))
    static_plan(other, [2, 2, 2]).save(root / "other_plan.json")
    text, _ = read_text(None, "calibration")
    atomic_write_json(root / "other_profile.json", profile_sensitivity(
        other, tok, text, {"seq_len": 16, "calib_tokens": 64, "windows_per_pass": 4, "progress": False}))

    weights = (tiny_folder / "model.safetensors").read_bytes()
    config = json.loads((tiny_folder / "config.json").read_text())

    def folder(name, config_text=None, weights_bytes=None, tokenizer=True, **files):
        path = root / name
        path.mkdir()
        if tokenizer:
            for tok_file in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tiny_folder / tok_file, path / tok_file)
        if config_text is not None:
            (path / "config.json").write_text(config_text)
        if weights_bytes is not None:
            (path / "model.safetensors").write_bytes(weights_bytes)
        for file_name, content in files.items():
            (path / file_name.replace("__", ".")).write_text(content)

    good = json.dumps(config)
    folder("m_badjson", "{oops", weights)
    folder("m_emptycfg", "", weights)
    folder("m_listcfg", "[1, 2]", weights)
    folder("m_notype", json.dumps({"hidden_size": 32}), weights)
    # refused families carry broken weights too: refused from config.json, before any weights are read
    folder("m_llama", json.dumps({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}),
           weights[: len(weights) // 2])
    folder("m_phimoe", json.dumps({**config, "model_type": "phimoe"}), weights[: len(weights) // 2])
    folder("m_unknown", json.dumps({**config, "model_type": "gpt17"}), weights)
    folder("m_nocfg", None, weights)
    folder("m_noweights", good)
    folder("m_trunc", good, weights[: len(weights) // 2])
    folder("m_corrupt", good, os.urandom(len(weights)))
    folder("m_stub", good, b"\x01\x02\x03\x04")
    folder("m_badheader", good, (16).to_bytes(8, "little") + b"not json, sorry!" + weights[8:])
    folder("m_shards", good, None, model__safetensors__index__json=json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    folder("m_badindex", good, None, model__safetensors__index__json="{")
    folder("m_notok", good, weights, tokenizer=False)
    return root


def _error_lines(err: str) -> list[str]:
    """stderr without argparse's usage lines and progress bars."""
    return [line for line in err.replace("\r", "\n").strip().splitlines()
            if line.strip() and not line.startswith(("usage:", " ")) and not re.search(r"\| *\d+/\d+ \[", line)]


def _state(folders) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for folder in folders for p in Path(folder).rglob("*")}


@pytest.mark.parametrize("index", PARAMS)
def test_a_bad_invocation_is_one_clear_line_exit_2_before_any_work(index, files, tiny_folder, tmp_path,
                                                                    monkeypatch, capsys, counted):
    row = cases(files, tiny_folder)[index]
    monkeypatch.chdir(tmp_path)                        # default output folders (allocmoe-sweep, ...) land here
    folders = (files, tiny_folder, tmp_path)
    before = _state(folders)
    with pytest.raises(SystemExit) as exc:
        main(list(row.argv))
        pytest.fail(f"accepted: {row.argv}")
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert exc.value.code == 2, (row.argv, err)
    assert "Traceback" not in err and len(lines) == 1, (row.argv, err)
    assert "error: " in lines[0] and row.message in lines[0], (row.argv, lines[0])
    said = lines[0].split("error: ", 1)[1]
    assert "; " in said, f"no '; <how to fix it>': {said}"
    assert counted["forward"] == 0, f"{counted['forward']} forward calls before refusing {row.argv}"
    assert row.loads or counted["loads"] == 0, f"weights read before refusing {row.argv}"
    assert _state(folders) == before, "written or changed: " + str(set(_state(folders)) ^ set(before))


def test_the_table_covers_every_command_and_category():
    commands = {row.argv[0] for row in TABLE}
    assert commands == {"profile", "allocate", "eval", "sweep", "compare", "analyze", "bench", "generate", "serve",
                        "export"}
    assert len(TABLE) >= 110 and len({tuple(row.argv) for row in TABLE}) == len(TABLE)   # no row twice
    text = "\n".join(" ".join(row.argv) + " -> " + row.message for row in TABLE)
    for needed in ("nan", "inf", "1e400", "-0.5", "a_dir", "empty.txt", "short.txt", "latin1.txt", "m_badjson",
                   "m_llama", "m_trunc", "m_corrupt", "m_nocfg", "cuda:7", "tpu", "--seq-len 300", "--limit 0",
                   "--num-fewshot", "--k-base 0", "--batch-size 0", "other_profile", "other_plan", "new/x.json",
                   "a_file/", "--tasks nosuchtask", "--methods uniform,bogus"):
        assert needed in text, needed


def test_allocate_checks_a_profile_against_the_model_without_loading_the_weights(files, tiny_folder, tmp_path,
                                                                              monkeypatch, capsys):
    """alloc-l needs only the profile, so the weights never load; the profile of another model is still
    refused, from the model's config alone, and a matching one still makes the plan."""
    from allocmoe import load_model, profile_sensitivity
    from allocmoe.core.files import atomic_write_json
    from allocmoe.models import ModelSpec
    from allocmoe.texts import read_text

    model, tok = load_model(tiny_folder)
    text, _ = read_text(None, "calibration")
    own = tmp_path / "profile.json"
    atomic_write_json(own, profile_sensitivity(model, tok, text, {"seq_len": 16, "calib_tokens": 64, "progress": False}))

    def no_weights(self, *args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(ModelSpec, "load", no_weights)
    argv = ["allocate", "--model", str(tiny_folder), "--budget", "0.5", "--method", "alloc-l", "--output",
            str(tmp_path / "plan.json")]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--profile", str(files / "other_profile.json")])
    assert exc.value.code == 2 and "made for another model" in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()
    main([*argv, "--profile", str(own)])
    assert json.loads((tmp_path / "plan.json").read_text())["method"] == "alloc-l"
