"""The four extra families shipped in examples/models load as their family, and a budget cut costs quality
on the held-out text of what each learnt (the built-in test split, or the fortunes' test part)."""

from __future__ import annotations

from pathlib import Path

import pytest

from allocmoe import apply_plan, evaluate_perplexity, load_model, model_fingerprint, read_text, static_plan

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models"
FORTUNES_TEST = ROOT / "examples" / "texts" / "fortunes" / "test.txt"


@pytest.mark.parametrize("family, renormalises, test_text", [
    ("qwen3_moe", True, None), ("olmoe", False, None),
    ("granitemoe", None, FORTUNES_TEST),          # softmax over the top-k logits: sums to 1 by construction
    ("mixtral", None, FORTUNES_TEST)])            # renormalises always (no flag in its config)
def test_each_family_loads_as_itself_and_top1_costs_quality(family, renormalises, test_text):
    folder = MODELS / family
    assert (folder / "model.safetensors").stat().st_size < 11 * 2**20         # a few MB, fp16
    model, tok = load_model(folder)
    fp = model_fingerprint(model)
    assert fp["model_type"] == family and getattr(model.config, "norm_topk_prob", None) is renormalises
    assert fp["k_orig"] == 4 and fp["num_moe_layers"] == 4
    text, _ = read_text(test_text, "test")
    score = {"seq_len": 512, "eval_tokens": 2048, "progress": False}
    full = evaluate_perplexity(model, tok, text, score).perplexity
    with apply_plan(model, static_plan(model, [1] * fp["num_moe_layers"])):
        top1 = evaluate_perplexity(model, tok, text, score).perplexity
    assert full < 400 and top1 > 1.2 * full          # trained (a random model scores ~4,096) and budget-sensitive
