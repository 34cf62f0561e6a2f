"""The benchmark's JSON, synthetic shapes against the published configs, experts on/off."""

import json
import math

import pytest
import torch

from allocmoe import AllocMoeError, distinct_plan, static_plan
from allocmoe.routing.adapters import adapter_for_model
from allocmoe.routing.apply import allocmoe_experts, apply_plan, routed_experts_off
from allocmoe.measure.bench import (BenchConfig, Generation, benchmark, distinct_plan_for, ideal_speedup,
                                    parse_max_distinct, prompt_ids, share_of_ideal_gain)
from allocmoe.cli import main
from allocmoe.calibrate.methods import allocate
from allocmoe.measure.synthetic import parameter_bytes, synthetic_config
from conftest import build_tiny


def test_benchmark_json_has_every_field():
    model = build_tiny("deepseek_v2")
    plan = allocate("0.5", "alloc-t", model=model)
    result = benchmark(model, plan, BenchConfig(input_len=8, output_len=3, sequences=2, repeats=2), progress=False)
    for key in ("prefill_speedup", "decode_speedup", "prefill_ideal_speedup", "decode_ideal_speedup",
                "timings_seconds", "peak_memory_bytes", "environment", "measured_activations_per_token",
                "distinct_experts_per_decode_step"):
        assert key in result, key
    for name in ("full", "plan", "off"):
        for phase in ("prefill", "decode"):
            stats = result["timings_seconds"][name][phase]
            assert 0 < stats["min"] <= stats["median"] <= stats["max"]
            assert len(stats["samples"]) == 2 and min(stats["samples"]) == stats["min"]   # the raw timings
    for phase, b in (("prefill", result["budget_fraction"]), ("decode", result["decode_fraction"])):
        t = {n: result["timings_seconds"][n][phase]["samples"] for n in ("full", "plan", "off")}   # per round, by hand
        shares = [share_of_ideal_gain(f, p, o, b) for f, p, o in zip(t["full"], t["plan"], t["off"])]
        shares = [x for x in shares if x is not None]
        assert result[f"{phase}_fraction_of_ideal_paired"] == (sum(shares) / 2 if len(shares) == 2 else
                                                                 (shares[0] if shares else None))
    assert {"device", "dtype", "threads", "torch", "transformers"} <= set(result["environment"])
    assert result["experts_kernel"] == "allocmoe grouped_mm, for full and plans alike"   # tiny experts
    assert result["measured_activations_per_token"] == pytest.approx(4.0)   # 2 layers x 4 experts x 0.5
    distinct = result["distinct_experts_per_decode_step"]
    assert 1 <= distinct["plan"] <= distinct["full"] <= 8
    assert result["decode_fraction"] == distinct["plan"] / distinct["full"]
    assert set(result["configurations"]) == {"full", "plan", "off"}      # not a distinct plan: no uniform beside it
    plan_row = result["configurations"]["plan"]
    t = {n: result["timings_seconds"][n]["decode"]["median"] for n in ("full", "plan", "off")}
    assert plan_row["decode_step_ms"] == pytest.approx(1000 * t["plan"])
    assert plan_row["decode_tokens_per_second"] == pytest.approx(2 / t["plan"])     # batch 2: two tokens a step
    assert plan_row["decode_ideal_speedup"] == pytest.approx(ideal_speedup(t["full"], t["off"], result["decode_fraction"]))
    assert plan_row["decode_ideal_speedup"] == result["decode_ideal_speedup"]
    assert all(result["configurations"][n]["counted_steps_match_timed"] for n in ("full", "plan"))


def _counted_by_hand(model, ids, steps, context) -> dict[int, list[int]]:
    """Per MoE layer, the distinct experts each decode step handed its experts module (prefill
    excluded), read from the module's own inputs: no allocmoe counter involved."""
    layers = adapter_for_model(model).moe_layers(model)
    num_experts = adapter_for_model(model).num_experts()
    seen: dict[int, list[int]] = {layer.index: [] for layer in layers}
    hooks = [layer.experts.register_forward_hook(
        lambda module, args, out, index=layer.index: seen[index].append(
            len({e for e in args[1].reshape(-1).tolist() if e < num_experts}))) for layer in layers]
    try:
        with context():
            gen = Generation(model, ids, steps)
            gen.prefill()
            for counts in seen.values():
                counts.clear()
            for _ in range(steps):
                gen.step()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@torch.no_grad()
def test_batched_decode_counts_distinct_experts_as_an_independent_count_does():
    model = build_tiny("deepseek_v2")
    config = BenchConfig(input_len=6, output_len=4, sequences=3, repeats=1, warmup=0)
    plan = distinct_plan(model, 3)
    result = benchmark(model, plan, config, progress=False)
    rows = result["configurations"]
    assert list(rows) == ["full", "plan", "uniform", "off"]
    ids = prompt_ids(model, config)
    uniform_k = int(rows["uniform"]["label"].removeprefix("uniform top-"))
    assert uniform_k == max(1, int(rows["plan"]["activations_per_token"] / 2 + 0.5))     # 2 MoE layers
    contexts = {"full": lambda: torch.no_grad(),            # the unmodified model, its own experts
                "plan": lambda: apply_plan(model, plan),
                "uniform": lambda: apply_plan(model, static_plan(model, [uniform_k] * 2))}
    for name, context in contexts.items():
        by_hand = _counted_by_hand(model, ids, config.output_len, context)
        row = rows[name]
        assert all(len(counts) == config.output_len for counts in by_hand.values())
        everything = [c for counts in by_hand.values() for c in counts]
        assert row["distinct_experts_per_step"] == pytest.approx(sum(everything) / len(everything)), name
        assert row["max_distinct_experts_per_step"] == max(everything), name
        for index, counts in by_hand.items():
            assert row["distinct_experts_per_layer"][str(index)]["mean"] == pytest.approx(sum(counts) / len(counts))
        assert row["counted_steps_match_timed"], name
    assert rows["plan"]["max_distinct_experts_per_step"] <= 3 < rows["full"]["max_distinct_experts_per_step"]
    b = rows["plan"]["distinct_experts_per_step"] / rows["full"]["distinct_experts_per_step"]
    t = {n: result["timings_seconds"][n]["decode"]["median"] for n in ("full", "plan", "off")}
    assert rows["plan"]["decode_ideal_speedup"] == pytest.approx(ideal_speedup(t["full"], t["off"], b))
    assert 0 <= rows["plan"]["top1_outside_chosen_rate"] <= 1


@torch.no_grad()
def test_distinct_plan_at_a_fraction_of_the_union_never_exceeds_its_m():
    model = build_tiny("deepseek_v2")
    config = BenchConfig(input_len=5, output_len=3, sequences=4, repeats=1, warmup=0)
    plan, union = distinct_plan_for(model, config, fraction=0.5)
    by_hand = _counted_by_hand(model, prompt_ids(model, config, seed=1), config.output_len, torch.no_grad)
    for index, counts in by_hand.items():     # the union: unmodified top-K, other prompts (seed 1)
        assert union[index] == pytest.approx(sum(counts) / len(counts))
        assert plan.layers[index].max_experts == max(1, int(0.5 * union[index] + 0.5))
    for batch in (1, 4, 7):                   # any batch, prefill columns included: never above M
        ids = prompt_ids(model, BenchConfig(input_len=5, sequences=batch))
        by_hand = _counted_by_hand(model, ids, 3, lambda: apply_plan(model, plan))
        for index, counts in by_hand.items():
            assert max(counts) <= plan.layers[index].max_experts
    assert distinct_plan_for(model, config, count=5)[0].layers[1].max_experts == 5


def test_distinct_budget_as_typed():
    assert parse_max_distinct("0.5", 64) == (0.5, None)
    assert parse_max_distinct("1/4", 64) == (0.25, None)
    assert parse_max_distinct("50%", 64) == (0.5, None)
    assert parse_max_distinct("1", 64) == (1.0, None)          # a number <= 1 is a fraction, as for budgets
    assert parse_max_distinct("32", 64) == (None, 32)
    for text, message in (("0", "must be positive"), ("abc", "is not a number"), ("65", "at most 64"),
                          ("2.5", "neither a fraction"), ("150%", "fraction above 1"), ("inf", "is not a number"),
                          ("nan", "is not a number"), ("-0.5", "must be positive")):
        with pytest.raises(AllocMoeError, match=message):
            parse_max_distinct(text, 64)


def test_bench_cli_times_a_distinct_budget_beside_uniform(tiny_folder, tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["bench", "--model", str(tiny_folder), "--max-distinct-experts", "2", "--sequences", "3",
          "--input-len", "8", "--output-len", "3", "--repeats", "1", "--warmup", "0", "--quiet", "--output", str(out)])
    result = json.loads(out.read_text())
    err = capsys.readouterr().err
    assert list(result["configurations"]) == ["full", "plan", "uniform", "off"]
    assert result["plan"]["max_distinct_experts"] == {"1": 2, "2": 2, "3": 2}
    assert result["configurations"]["plan"]["max_distinct_experts_per_step"] <= 2
    assert "| distinct (M 2) |" in err and "| uniform top-" in err and "decode tok/s" in err


def test_bench_times_a_plan_with_a_substitute_beside_its_twin_without_it(tiny_folder, tmp_path, capsys):
    plan_file, out = tmp_path / "half.json", tmp_path / "bench.json"
    # B = 9 of 12; a rank-8 stand-in costs u = (2*32*8 + 32) / (3*32*16 + 32) of an expert on this model (H 32,
    # I 16), so the plan's activations are the most a with a + (12 - a) u <= 9
    main(["allocate", "--model", str(tiny_folder), "--method", "uniform", "--budget", "0.75", "--substitute",
          "--refine", "0", "--seq-len", "64", "--calib-tokens", "256", "--output", str(plan_file), "--quiet"])
    u = 544 / 1568
    activations = math.floor((9 - 12 * u) / (1 - u))
    main(["bench", "--model", str(tiny_folder), "--plan", str(plan_file), "--batch-size", "2", "--input-len", "8",
          "--output-len", "3", "--repeats", "2", "--warmup", "0", "--quiet", "--output", str(out)])
    result, err = json.loads(out.read_text()), capsys.readouterr().err
    rows = result["configurations"]
    assert list(rows) == ["full", "plan", "twin", "off"]
    assert rows["twin"]["activations_per_token"] == rows["plan"]["activations_per_token"] == pytest.approx(activations)
    stated = activations + (12 - activations) * u
    assert result["plan"]["cost"]["total"] == pytest.approx(stated) and stated <= 9
    assert result["measured_cost_per_token"] == pytest.approx(stated)
    assert f"the plan's stated cost: {stated:.4g} per token" in err
    for phase in ("prefill", "decode"):
        t = result["timings_seconds"]
        cost = result["substitute_cost"][phase]
        assert cost["ratio"] == pytest.approx(t["plan"][phase]["median"] / t["twin"][phase]["median"])
        assert cost["rank"] == 8
    assert "without its substitute" in err and "substitute (rank 8): prefill" in err


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


def test_a_synthetic_config_takes_overrides_and_leaves_the_shapes_as_published():
    from allocmoe.measure.synthetic import SHAPES

    config = synthetic_config("synthetic:olmoe-1b-7b", 2, overrides={"vocab_size": 512})
    assert config.vocab_size == 512 and config.num_hidden_layers == 2
    assert SHAPES["olmoe-1b-7b"]["vocab_size"] == 50304 and synthetic_config("synthetic:olmoe-1b-7b").vocab_size == 50304


def test_deepseek_v2_lite_shape_has_about_16b_parameters():
    total = parameter_bytes(synthetic_config("synthetic:deepseek-v2-lite"), torch.float32) / 4
    assert 15.0e9 < total < 16.5e9                       # DeepSeek-V2-Lite: 15.7B parameters


def test_bench_cli_bad_inputs(capsys, tmp_path):
    from allocmoe.core.memory import available_memory_bytes

    if available_memory_bytes(torch.device("cpu")) > 60 * 2**30:
        pytest.skip("the too-big cases assume a machine of at most 60 GiB free memory (the CI size is 24 GiB)")
    cases = [(["--input-len", "0"], "--input-len: must be above 0"), (["--output-len", "-3"], "--output-len: must be above 0"),
             (["--model", "synthetic:gpt-17"], "unknown synthetic shape"),
             (["--model", "synthetic:deepseek-v2-lite", "--num-layers", "27"], "GiB of weights"),
             (["--model", "synthetic:deepseek-v2-lite", "--num-layers", "2", "--sequences", "100000",
               "--input-len", "4096"], "lower --sequences")]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--budget", "0.5", *extra])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
