"""lm-eval on an offline task with and without a plan; task files reproducible; the analysis."""

import filecmp
import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from allocmoe import apply_plan, static_plan
from allocmoe.measure.analyze import js_divergence, spearman
from allocmoe.scoring import tokenize_windows
from allocmoe.models import load_model

ROOT = Path(__file__).resolve().parents[1]
has_lm_eval = importlib.util.find_spec("lm_eval") is not None


def test_offline_task_files_are_reproducible_byte_for_byte(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tasks.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    shipped = ROOT / "src" / "allocmoe" / "builtin" / "tasks"
    names = sorted(p.name for p in shipped.iterdir() if p.suffix in (".yaml", ".jsonl"))
    assert names and names == sorted(p.name for p in tmp_path.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(shipped, tmp_path, names, shallow=False)
    assert not mismatch and not errors


def test_dev_copy_comes_from_the_calibration_split_and_shares_no_item_with_the_shipped_tasks(tmp_path):
    import json

    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tasks.py"), "--split", "calibration",
                    "--out", str(tmp_path)], check=True, capture_output=True)
    shipped = ROOT / "src" / "allocmoe" / "builtin" / "tasks"
    for task in ("lastword", "cloze", "style", "nextword"):
        yaml = (tmp_path / f"allocmoe_dev_{task}.yaml").read_text()
        assert f"task: allocmoe_dev_{task}\n" in yaml and f"{tmp_path.resolve()}/allocmoe_dev_{task}.jsonl" in yaml
        dev = {json.loads(line)["context"] for line in (tmp_path / f"allocmoe_dev_{task}.jsonl").open()}
        test = {json.loads(line)["context"] for line in (shipped / f"allocmoe_{task}.jsonl").open()}
        assert len(dev) >= 300 and not dev & test, task
    if has_lm_eval:      # lm-eval finds the copy by --include-path and reads its data from where it was written
        from allocmoe.measure.evaluate.harness import _task_manager

        for name, task in _task_manager(str(tmp_path)).load(["allocmoe_dev_cloze"])["tasks"].items():
            lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
            assert len(list(task.test_docs())) == len(lines)


@pytest.mark.skipif(not has_lm_eval, reason='needs the [eval] extra: pip install "allocmoe[eval]"')
def test_offline_tasks_run_through_lm_eval_and_a_plan_changes_their_metrics(tiny_folder):
    from allocmoe.measure.evaluate.harness import run_tasks

    model, tok = load_model(tiny_folder)
    tasks = ["allocmoe_lastword", "allocmoe_nextword"]          # multiple choice, open vocabulary
    full = run_tasks(model, tok, tasks, limit=12, batch_size=4)
    with apply_plan(model, static_plan(model, [1, 1, 1])):
        cut = run_tasks(model, tok, tasks, limit=12, batch_size=4)
    choice, word = full["allocmoe_lastword"], full["allocmoe_nextword"]
    assert set(choice) >= {"acc", "acc_norm", "brier_score"} and set(word) >= {"acc", "perplexity"}
    assert 0 <= choice["acc"] <= 1 and 0 <= choice["brier_score"] <= 2
    assert 0 <= word["acc"] <= 1 and word["perplexity"] > 1
    # both are continuous in the log-likelihoods, so any change of the model moves them
    assert choice["brier_score"] != cut["allocmoe_lastword"]["brier_score"]
    assert word["perplexity"] != cut["allocmoe_nextword"]["perplexity"]
    hits = round(word["acc"] * 12)                      # the standard error of 12 0/1 scores, by statistics
    scores = [1.0] * hits + [0.0] * (12 - hits)
    assert word["sample_len"] == 12
    assert word["acc_stderr"] == pytest.approx(statistics.stdev(scores) / 12 ** 0.5 if 0 < hits < 12 else 0.0)


def test_right_padding_mask_by_hand():
    from allocmoe.measure.evaluate.harness import right_padding_mask

    ids = torch.tensor([[5, 0, 7, 0, 0], [0, 0, 0, 0, 0], [3, 4, 5, 6, 7]])
    assert right_padding_mask(ids).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


@pytest.mark.skipif(not has_lm_eval, reason='needs the [eval] extra: pip install "allocmoe[eval]"')
@torch.no_grad()
def test_lm_eval_padding_stays_out_of_the_plan_and_leaves_real_tokens_alone(tiny_folder):
    """lm-eval right-pads a batch of requests and calls the model without a mask. Under allocmoe's
    wrapper the pads neither enter Alloc-T's pool nor count as activations, and (static plan)
    every request scores as it does alone in a batch of one."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from allocmoe import AllocT, Plan, model_fingerprint
    from allocmoe.measure.evaluate.harness import _padding_aware

    model, tok = load_model(tiny_folder)
    assert 0 in tok.all_special_ids
    texts = [("The man said", " that"), ("In the beginning God created the heaven", " and"),
             ("It was", " a"), ("Then the people of the city went out to see what was done", " there")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(texts)]
    real_tokens = sum(len(tok(c + t)["input_ids"]) - 1 for c, t in texts)   # the last target token is not fed
    fp = model_fingerprint(model)
    alloc_t = Plan(model=fp, layers={i: AllocT(1.5, k_base=1) for i in fp["moe_layers"]}, method="t", budget=4.5)
    padded = _padding_aware(HFLM)(pretrained=model, tokenizer=tok, batch_size=4, device="cpu")
    with apply_plan(model, alloc_t) as handle:
        padded.loglikelihood(requests, disable_tqdm=True)
        assert handle.tokens_seen() == real_tokens
        assert handle.activations_per_token() == pytest.approx(4.5, abs=0.02)    # rounding per layer only
    alone = _padding_aware(HFLM)(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    with apply_plan(model, static_plan(model, [2, 2, 2])):
        batched = [ll for ll, _ in padded.loglikelihood(requests, disable_tqdm=True)]
        single = [ll for ll, _ in alone.loglikelihood(requests, disable_tqdm=True)]
    assert batched == pytest.approx(single, abs=1e-4)


@pytest.mark.skipif(not has_lm_eval, reason='needs the [eval] extra: pip install "allocmoe[eval]"')
@torch.no_grad()
def test_lm_eval_padding_that_cannot_be_told_from_text_is_warned_about(tiny_folder, monkeypatch):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from allocmoe.measure.evaluate.harness import _padding_aware

    model, tok = load_model(tiny_folder)
    monkeypatch.setattr(type(tok), "all_special_ids", property(lambda self: [1]))   # token 0 an ordinary token
    lm = _padding_aware(HFLM)(pretrained=model, tokenizer=tok, batch_size=2, device="cpu")
    pairs = [("It was", " a"), ("And God said", " let")]                       # 4 and 12 tokens fed
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    with apply_plan(model, static_plan(model, [2, 2, 2])) as handle, pytest.warns(UserWarning, match="--windows-per-pass 1"):
        lm.loglikelihood(requests, disable_tqdm=True)
    longest = max(len(tok(c + t)["input_ids"]) - 1 for c, t in pairs)
    assert handle.tokens_seen() == 2 * longest                                  # the pads were counted


@pytest.mark.skipif(not has_lm_eval, reason='needs the [eval] extra: pip install "allocmoe[eval]"')
def test_every_offline_request_scores_a_whole_spaced_word_or_sentence(tiny_folder):
    # lm-eval joins context and target with nothing between for loglikelihood tasks: a target without
    # its space glues onto the context's last word ("seeds" + "and"), or tokenizes to nothing.
    from lm_eval.models.huggingface import HFLM

    from allocmoe.measure.evaluate.harness import _task_manager
    from allocmoe.texts import OFFLINE_TASKS

    model, tok = load_model(tiny_folder)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")
    for name, task in _task_manager(None).load(list(OFFLINE_TASKS))["tasks"].items():
        task.build_all_requests(limit=None, rank=0, world_size=1)
        for request in task.instances:
            context, target = request.args
            assert target.startswith(" ") and not context.endswith(" "), (name, context[-30:], target)
            context_ids, target_ids = lm._encode_pair(context, target)
            assert target_ids and tok.decode(target_ids) == target, (name, target)


@pytest.mark.skipif(not has_lm_eval, reason='needs the [eval] extra: pip install "allocmoe[eval]"')
def test_eval_json_carries_item_scores_that_compare_pairs_up(tiny_folder, tmp_path, capsys):
    import json

    from allocmoe.measure.evaluate import run as api
    from allocmoe.cli import main

    model, _ = load_model(tiny_folder)
    plan_path = tmp_path / "plan.json"
    static_plan(model, [1, 1, 1]).save(plan_path)
    runs = {"full": api.evaluate_model(tiny_folder, max_tokens=256, tasks=["allocmoe_cloze"],
                                       task_options={"limit": 10})}
    (tmp_path / "full.json").write_text(json.dumps(runs["full"]))
    main(["eval", "--model", str(tiny_folder), "--plan", str(plan_path), "--eval-tokens", "256",
          "--tasks", "allocmoe_cloze", "--limit", "10", "--output", str(tmp_path / "cut.json")])
    runs["cut"] = json.loads((tmp_path / "cut.json").read_text())
    printed = json.loads(capsys.readouterr().out)      # the screen gets the summary, the file the items too
    assert "task_items" not in printed and printed["tasks"] == runs["cut"]["tasks"]
    assert len(runs["cut"]["task_items"]["allocmoe_cloze"]["acc"]) == 10
    items = runs["full"]["task_items"]["allocmoe_cloze"]
    assert len(items["acc"]) == 10 and set(items["acc"]) <= {0.0, 1.0}
    # the per-item scores average to lm-eval's own aggregate
    assert sum(items["acc"]) / 10 == pytest.approx(runs["full"]["tasks"]["allocmoe_cloze"]["acc"])
    main(["compare", str(tmp_path / "full.json"), str(tmp_path / "cut.json"), "--output",
          str(tmp_path / "cmp.json")])
    row = json.loads((tmp_path / "cmp.json").read_text())["tasks"]["allocmoe_cloze"]
    expected = runs["full"]["tasks"]["allocmoe_cloze"]["acc"] - runs["cut"]["tasks"]["allocmoe_cloze"]["acc"]
    assert row["difference"] == pytest.approx(expected) and row["items"] == 10
    assert "| allocmoe_cloze | 10 |" in capsys.readouterr().out


def test_missing_extra_or_unknown_task_is_a_clear_error(tiny_folder, monkeypatch):
    from allocmoe import AllocMoeError
    from allocmoe.measure.evaluate import harness

    model, tok = load_model(tiny_folder)
    if has_lm_eval:
        with pytest.raises(AllocMoeError, match="unknown lm-eval task"):
            harness.run_tasks(model, tok, ["no_such_task"], limit=1)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(AllocMoeError, match=r'pip install "allocmoe\[eval\]"'):
        harness.run_tasks(model, tok, ["allocmoe_lastword"])


@pytest.mark.skipif(not has_lm_eval, reason='needs the [eval] extra: pip install "allocmoe[eval]"')
def test_an_unknown_task_is_refused_before_any_scoring_or_profiling(tiny_folder, monkeypatch):
    import importlib

    from allocmoe import AllocMoeError
    from allocmoe.measure.evaluate import run as api
    from allocmoe.texts import read_text

    sweep_module = importlib.import_module("allocmoe.pipelines.sweep")

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the task names were checked")

    for module, name in ((api, "evaluate_perplexity"), (sweep_module, "evaluate_perplexity"),
                         (sweep_module, "profile_sensitivity")):
        monkeypatch.setattr(module, name, no_work)
    with pytest.raises(AllocMoeError, match="unknown lm-eval task"):
        api.evaluate_model(tiny_folder, tasks=["no_such_task"])
    model, tok = load_model(tiny_folder)
    text = read_text(None, "test")[0]
    with pytest.raises(AllocMoeError, match="unknown lm-eval task"):
        sweep_module.sweep(model, tok, text, text, {"tasks": ("no_such_task",)})


def test_statistics_against_hand_computed_cases():
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([4.0, 3, 2, 1])) == pytest.approx(-1.0)
    assert spearman(torch.tensor([1.0, 1, 2]), torch.tensor([1.0, 2, 3])) == pytest.approx(0.8660254, rel=1e-6)
    assert js_divergence(torch.tensor([1.0, 0]), torch.tensor([0.0, 1])) == pytest.approx(0.6931472, rel=1e-6)
    assert js_divergence(torch.tensor([2.0, 3]), torch.tensor([4.0, 6])) == pytest.approx(0.0, abs=1e-12)


def test_analysis_of_an_alloc_t_plan(tiny_folder, tmp_path):
    from allocmoe.measure.analyze import analyze_plan, write_analysis
    from allocmoe.calibrate.methods import allocate
    from allocmoe.texts import read_text

    model, tok = load_model(tiny_folder)
    windows = tokenize_windows(tok, read_text(None, "test")[0], 32, 1024)
    plan = allocate("0.5", "alloc-t", model=model)
    result = analyze_plan(model, tok, plan, windows)
    for layer in result["per_layer"].values():
        assert layer["measured_k"] == pytest.approx(2.0, abs=0.01)
        assert -1 <= layer["load_spearman"] <= 1 and layer["load_js_divergence"] >= 0
    assert result["experts_vs_entropy"]["spearman"] is not None
    same = analyze_plan(model, tok, static_plan(model, [4, 4, 4]), windows)
    assert same["load_js_divergence_max"] == pytest.approx(0.0, abs=1e-12)
    assert same["load_spearman_range"] == [pytest.approx(1.0), pytest.approx(1.0)]
    paths = write_analysis(result, tmp_path)
    assert all(p.stat().st_size > 100 for p in paths)
