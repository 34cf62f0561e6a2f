"""The benchmark's JSON, synthetic shapes against the published configs, experts on/off."""

import json

import pytest
import torch

from allocmoe import AllocMoeError, static_plan
from allocmoe.routing.apply import allocmoe_experts, apply_plan, routed_experts_off
from allocmoe.measure.bench import BenchConfig, Generation, benchmark, share_of_ideal_gain
from allocmoe.cli import main
from allocmoe.calibrate.methods import allocate
from allocmoe.measure.synthetic import parameter_bytes, synthetic_config
from conftest import build_tiny


def test_benchmark_json_has_every_field():
    model = build_tiny("deepseek_v2")
    plan = allocate("0.5", "alloc-t", model=model)
    result = benchmark(model, plan, BenchConfig(input_len=8, output_len=3, batch_size=2, repeats=2), progress=False)
    for key in ("prefill_speedup", "decode_speedup", "prefill_ideal_speedup", "decode_ideal_speedup",
                "timings_seconds", "peak_memory_bytes", "environment", "measured_activations_per_token",
                "distinct_experts_per_decode_step"):
        assert key in result, key
    for name in ("full", "plan", "off"):
        for phase in ("prefill", "decode"):
            stats = result["timings_seconds"][name][phase]
            assert 0 < stats["min"] <= stats["median"] <= stats["max"]
            assert len(stats["samples"]) == 2 and min(stats["samples"]) == stats["min"]   # the raw timings
    for phase in ("prefill", "decode"):    # per round from the raw timings, by hand
        t = {n: result["timings_seconds"][n][phase]["samples"] for n in ("full", "plan", "off")}
        shares = [share_of_ideal_gain(f, p, o, result["budget_fraction"]) for f, p, o in zip(t["full"], t["plan"], t["off"])]
        shares = [x for x in shares if x is not None]
        assert result[f"{phase}_fraction_of_ideal_paired"] == (sum(shares) / 2 if len(shares) == 2 else
                                                                 (shares[0] if shares else None))
    assert {"device", "dtype", "threads", "torch", "transformers"} <= set(result["environment"])
    assert result["experts_kernel"] == "allocmoe grouped_mm, for full and plan alike"   # tiny experts
    assert result["measured_activations_per_token"] == pytest.approx(4.0)   # 2 layers x 4 experts x 0.5
    distinct = result["distinct_experts_per_decode_step"]
    assert 1 <= distinct["plan"] <= distinct["full"] <= 8


@torch.no_grad()
def test_generations_taking_turns_match_generate_under_each_configuration():
    # the benchmark switches configuration before every call; each generation must still be the
    # greedy continuation its own configuration gives alone (its cache and mask its own)
    model = build_tiny("deepseek_v2")
    plan = allocate("0.5", "alloc-t", model=model)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    contexts = {"full": lambda: allocmoe_experts(model), "plan": lambda: apply_plan(model, plan),
                "off": lambda: routed_experts_off(model)}
    steps = 5
    gens = {name: Generation(model, ids, steps) for name in contexts}
    for call in ["prefill"] + ["step"] * steps:
        for name, context in contexts.items():
            with context():
                assert getattr(gens[name], call)() > 0
    for name, context in contexts.items():
        with context():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1,
                                      do_sample=False)[:, ids.size(1):]
        assert torch.equal(torch.cat(gens[name].tokens, dim=1), expected), name
    assert not torch.equal(torch.cat(gens["off"].tokens, 1), torch.cat(gens["full"].tokens, 1))


def test_share_of_the_ideal_gain_by_hand():
    # full 10 s, experts off 4 s, half budget: ideal 10 / (4 + 3) = 1.4286x
    assert share_of_ideal_gain(10.0, 7.0, 4.0, 0.5) == pytest.approx(1.0)      # saved all it could
    assert share_of_ideal_gain(10.0, 10.0, 4.0, 0.5) == pytest.approx(0.0)     # saved nothing
    assert share_of_ideal_gain(10.0, 8.0, 4.0, 0.5) == pytest.approx((10 / 8 - 1) / (10 / 7 - 1))
    assert share_of_ideal_gain(10.0, 8.0, 4.0, 1.0) is None                   # full budget: no gain to share


@torch.no_grad()
def test_switching_routed_experts_off_and_on_restores_outputs_exactly():
    model = build_tiny("qwen2_moe")
    ids = torch.randint(0, 96, (2, 10))
    reference = model(ids).logits
    with routed_experts_off(model):
        off = model(ids).logits
    assert not torch.allclose(off, reference)
    assert torch.equal(model(ids).logits, reference)


@pytest.mark.parametrize("name,expected", [
    ("deepseek-v2-lite", dict(hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
                              n_shared_experts=2, first_k_dense_replace=1, vocab_size=102400, num_hidden_layers=27,
                              kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64)),
    ("qwen1.5-moe-a2.7b", dict(hidden_size=2048, moe_intermediate_size=1408, num_experts=60, num_experts_per_tok=4,
                               shared_expert_intermediate_size=5632, num_hidden_layers=24, vocab_size=151936)),
    ("olmoe-1b-7b", dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                         num_hidden_layers=16, vocab_size=50304)),
])
def test_synthetic_shapes_match_the_published_configs(name, expected):
    config = synthetic_config("synthetic:" + name)
    for key, value in expected.items():
        assert getattr(config, key) == value, key
    assert config.norm_topk_prob is False


def test_deepseek_v2_lite_shape_has_about_16b_parameters():
    total = parameter_bytes(synthetic_config("synthetic:deepseek-v2-lite"), torch.float32) / 4
    assert 15.0e9 < total < 16.5e9                       # DeepSeek-V2-Lite: 15.7B parameters


def test_bench_cli_bad_inputs(capsys, tmp_path):
    from allocmoe.measure.bench import free_memory_bytes

    if free_memory_bytes(torch.device("cpu")) > 60 * 2**30:
        pytest.skip("the too-big cases assume a machine of at most 60 GiB free memory (the CI size is 24 GiB)")
    cases = [(["--input-len", "0"], "--input-len: must be above 0"), (["--output-len", "-3"], "--output-len: must be above 0"),
             (["--model", "synthetic:gpt-17"], "unknown synthetic shape"),
             (["--model", "synthetic:deepseek-v2-lite", "--num-layers", "27"], "GiB of weights"),
             (["--model", "synthetic:deepseek-v2-lite", "--num-layers", "2", "--batch-size", "100000",
               "--input-len", "4096"], "lower --batch-size")]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--budget", "0.5", *extra])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
