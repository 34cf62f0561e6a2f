"""apply_plan on tiny random models of every family, against the unpatched model."""

import math

import pytest
import torch

from allocmoe import AllocT, AllocMoeError, Plan, StaticTopK, apply_plan, model_fingerprint, static_plan
from conftest import build_tiny, experts_with_biases


def plan_of(model, policy_for_layer):
    fp = model_fingerprint(model)
    layers = {i: policy_for_layer(i) for i in fp["moe_layers"]}
    return Plan(model=fp, layers=layers, method="test", budget=sum(p.k for p in layers.values()))


@torch.no_grad()
def test_plan_at_k_orig_reproduces_the_unpatched_logits_and_removal_restores_them(family_model, ids):
    _, model = family_model
    fp = model_fingerprint(model)
    reference = model(ids).logits
    for policy in (StaticTopK(fp["k_orig"]), AllocT(fp["k_orig"], k_base=1)):
        with apply_plan(model, plan_of(model, lambda i: policy)) as handle:
            patched = model(ids).logits
            assert handle.activations_per_token() == pytest.approx(fp["k_orig"] * fp["num_moe_layers"])
        assert (patched - reference).abs().max() <= 1e-5
        assert torch.equal(model(ids).logits, reference)


@torch.no_grad()
def test_alloc_t_with_k_base_equal_to_k_is_static_top_k(family_model, ids):
    _, model = family_model
    with apply_plan(model, plan_of(model, lambda i: StaticTopK(1))):
        static = model(ids).logits
    with apply_plan(model, plan_of(model, lambda i: AllocT(1, k_base=1))):
        alloc_t = model(ids).logits
    assert (static - alloc_t).abs().max() <= 1e-6


@torch.no_grad()
def test_alloc_t_spends_round_k_times_t_per_layer_on_a_prefix_of_each_ranking(family_model, ids):
    _, model = family_model
    fp = model_fingerprint(model)
    k_orig, num_tokens = fp["k_orig"], ids.numel()
    ks = {i: 1 + (n * 0.7) % (k_orig - 1) for n, i in enumerate(fp["moe_layers"])}
    seen = {}
    handle = apply_plan(model, plan_of(model, lambda i: AllocT(ks[i], k_base=1)))
    handle.context.recorders.append(lambda layer, idx, cand, counts, valid: seen.setdefault(layer, (cand, counts)))
    model(ids)
    handle.remove()
    for index, k in ks.items():
        cand, counts = seen[index]
        assert int(counts.sum()) == math.floor(k * num_tokens + 0.5)
        assert counts.min() >= 1 and counts.max() <= k_orig
        assert torch.all(cand[:, :-1] >= cand[:, 1:])                      # candidates are the ranking, best first
    assert handle.layer_activations()[fp["moe_layers"][0]] == pytest.approx(
        math.floor(ks[fp["moe_layers"][0]] * num_tokens + 0.5) / num_tokens)


@torch.no_grad()
def test_fewer_experts_change_the_output_and_static_counts_are_exact(family_model, ids):
    _, model = family_model
    fp = model_fingerprint(model)
    reference = model(ids).logits
    with apply_plan(model, static_plan(model, [1] * fp["num_moe_layers"])) as handle:
        cut = model(ids).logits
        assert handle.activations_per_token() == fp["num_moe_layers"]
    assert (cut - reference).abs().max() > 1e-4


@torch.no_grad()
def test_generate_runs_under_a_plan_and_padding_is_not_counted():
    model = build_tiny("deepseek_v2")
    ids = torch.randint(1, 96, (2, 6))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0                                          # left padding in row 0
    fp = model_fingerprint(model)
    with apply_plan(model, plan_of(model, lambda i: AllocT(2.5, k_base=1))) as handle:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             pad_token_id=0)
        assert out.shape == (2, 10)
        real_tokens = int(mask.sum()) + 2 * 3                               # prompt + 3 decode steps of 2
        assert handle.tokens_seen() == real_tokens
        per_layer = handle.layer_activations()
    for index in fp["moe_layers"]:
        assert 1 <= per_layer[index] <= fp["k_orig"]


def dense_reference(experts, hidden, index, weights):
    """Every expert on every token, times a dense [T, E] weight matrix that is 0 where unselected."""
    num_experts = experts.gate_up_proj.size(0)
    dense_w = torch.zeros(hidden.size(0), num_experts + 1).scatter_add_(1, index, weights.float())[:, :num_experts]
    out = torch.zeros_like(hidden)
    for e in range(num_experts):
        gate, up = (hidden @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        out += (experts.act_fn(gate) * up) @ experts.down_proj[e].T * dense_w[:, e:e + 1]
    return out


@torch.no_grad()
def test_weights_first_path_inside_a_whole_model_matches_the_grouped_mm_path(family_model, ids, monkeypatch):
    """Tiny experts normally take grouped_mm; forcing the CPU weights-first path must not change logits."""
    import allocmoe.routing.experts

    _, model = family_model
    fp = model_fingerprint(model)
    plan = plan_of(model, lambda i: AllocT(max(fp["k_orig"] // 2, 1), k_base=1))
    with apply_plan(model, plan):
        grouped = model(ids).logits
        monkeypatch.setattr(allocmoe.routing.experts, "WEIGHTS_FIRST_MIN_ELEMENTS", 0)
        weights_first = model(ids).logits
    assert (weights_first - grouped).abs().max() <= 1e-5


def random_selection(num_tokens, num_experts, width, generator):
    """[T, W] distinct experts per token, about 40% of slots set to the sentinel E with weight 0."""
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:width] for _ in range(num_tokens)])
    index[torch.rand(num_tokens, width, generator=generator) < 0.4] = num_experts
    weights = torch.rand(num_tokens, width, generator=generator).masked_fill(index == num_experts, 0.0)
    return index, weights


@pytest.mark.parametrize("path", ["weights_first_experts_forward", "compacted_grouped_mm_forward"])
@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen3_moe", "mixtral"])
@torch.no_grad()
def test_compacted_execution_equals_a_dense_masked_reference(model_type, path):
    import allocmoe.routing.experts

    model = build_tiny(model_type)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")][0]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 32, generator=gen)
    index, weights = random_selection(10, experts.gate_up_proj.size(0), 3, gen)
    out = getattr(allocmoe.routing.experts, path)(experts, hidden, index, weights)
    assert torch.allclose(out, dense_reference(experts, hidden, index, weights), atol=1e-5)


def test_row_windows_round_up_to_whole_blocks_inside_the_operand():
    from allocmoe.routing.experts import _row_window

    assert _row_window(0, 11, 100) == (0, 11)        # below PAD_FROM_ROWS: exactly the expert's rows
    assert _row_window(5, 13, 100) == (5, 21)        # 13 -> 16 rows, borrowed from the next expert
    assert _row_window(90, 13, 103) == (87, 103)     # the last expert borrows from the one before
    assert _row_window(40, 24, 100) == (40, 64)      # already whole blocks
    assert _row_window(0, 13, 14) == (0, 13)         # 16 rows do not exist: no widening


@pytest.mark.parametrize("model_type", ["deepseek_v2", "gpt_oss"])
@torch.no_grad()
def test_weights_first_path_with_widened_row_windows_equals_the_dense_reference(model_type):
    """Many rows per expert, so most experts get a widened window (and the last one a shifted one);
    gpt_oss, whose transposed weights run tokens-first unwidened, adds biases."""
    from allocmoe.routing.experts import PAD_FROM_ROWS, ROW_BLOCK, weights_first_experts_forward

    model = build_tiny(model_type)
    gen = torch.Generator().manual_seed(2)
    experts = experts_with_biases(model, gen)
    num_experts = experts.num_experts
    hidden = torch.randn(97, model.config.hidden_size, generator=gen)
    index, weights = random_selection(97, num_experts, 3, gen)
    counts = torch.bincount(index.flatten(), minlength=num_experts + 1)[:num_experts]
    assert ((counts >= PAD_FROM_ROWS) & (counts % ROW_BLOCK != 0)).sum() >= 2    # the widening is exercised
    reference = torch.zeros_like(hidden)
    for t, e in (index < num_experts).nonzero().tolist():       # one (token, slot) pair at a time
        expert = index[t, e].item()
        single = torch.tensor([[expert]])
        reference[t] += weights_first_experts_forward(experts, hidden[t:t + 1], single, weights[t:t + 1, e:e + 1])[0]
    out = weights_first_experts_forward(experts, hidden, index, weights)
    assert torch.allclose(out, reference, atol=1e-5)


def test_tokens_first_product_in_slices_equals_one_product(monkeypatch):
    """From SLICED_FROM_ROWS rows the product runs W in slices of SLICE_ROWS output rows (here 5,
    so 23 rows make 4 whole slices in one batched matmul and a ragged slice of 3), a transposed
    view included; below, in one piece."""
    from allocmoe.routing import experts

    monkeypatch.setattr(experts, "SLICE_ROWS", 5)
    calls = []
    mm, matmul = torch.mm, torch.matmul
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(("mm", b.size(1))) or mm(a, b))
    monkeypatch.setattr(torch, "matmul", lambda a, b: calls.append(("batched", tuple(b.shape))) or matmul(a, b))
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(23, 16, generator=gen)
    for w in (weight, torch.randn(16, 23, generator=gen).t()):                  # [O, in], contiguous or not
        for rows in range(1, experts.TOKENS_FIRST_MAX_ROWS + 1):
            x = torch.randn(rows, 16, generator=gen)
            calls.clear()
            out = experts._tokens_first(x, w)
            assert torch.allclose(out, x @ w.t(), atol=1e-6)
            sliced = [("batched", (4, 16, 5)), ("mm", 3)]                    # [slices, in, slice rows], the tail
            assert calls == (sliced if rows >= experts.SLICED_FROM_ROWS else [("mm", 23)])


@pytest.mark.parametrize("model_type", ["deepseek_v2", "gpt_oss"])
@torch.no_grad()
def test_weights_first_path_with_sliced_tokens_first_experts_equals_transformers_grouped_mm(model_type, monkeypatch):
    """Experts of 4-14 rows run tokens-first in slices (SLICE_ROWS made small so a tiny model's
    projections are cut, raggedly); gpt_oss adds transposed weights, which run tokens-first at
    every row count, and biases."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from allocmoe.routing import experts as kernel

    monkeypatch.setattr(kernel, "SLICE_ROWS", 7)
    model = build_tiny(model_type)
    gen = torch.Generator().manual_seed(4)
    experts = experts_with_biases(model, gen)
    num_experts = experts.num_experts
    hidden = torch.randn(3 * num_experts, model.config.hidden_size, generator=gen)
    index, weights = random_selection(3 * num_experts, num_experts, 2, gen)
    counts = torch.bincount(index.flatten(), minlength=num_experts + 1)[:num_experts]
    assert ((counts >= kernel.SLICED_FROM_ROWS) & (counts <= kernel.TOKENS_FIRST_MAX_ROWS)).sum() >= 2
    reference = grouped_mm_experts_forward(experts, hidden, index.clamp(max=num_experts - 1), weights)
    assert torch.allclose(kernel.weights_first_experts_forward(experts, hidden, index, weights), reference, atol=1e-5)


@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen2_moe", "olmoe", "gpt_oss"])
@torch.no_grad()
def test_cpu_weights_first_path_equals_transformers_grouped_mm(model_type):
    """Every layout (gpt_oss: transposed weights, biases, its own gate) against transformers' own
    experts function, which sees the sentinel slots as a real expert with routing weight 0."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from allocmoe.routing.experts import weights_first_experts_forward

    model = build_tiny(model_type)
    gen = torch.Generator().manual_seed(1)
    experts = experts_with_biases(model, gen)
    hidden = torch.randn(12, model.config.hidden_size, generator=gen)
    num_experts = experts.num_experts
    index, weights = random_selection(12, num_experts, 3, gen)
    reference = grouped_mm_experts_forward(experts, hidden, index.clamp(max=num_experts - 1), weights)
    assert torch.allclose(weights_first_experts_forward(experts, hidden, index, weights), reference, atol=1e-5)


def test_a_plan_for_another_model_is_refused():
    small = build_tiny("qwen3_moe")
    other = build_tiny("olmoe")
    plan = static_plan(small, [2, 2, 2])
    with pytest.raises(AllocMoeError, match="made for another model: model_type"):
        apply_plan(other, plan)


def test_unsupported_architecture_is_refused_with_the_supported_list():
    from transformers import AutoConfig, AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(AllocMoeError, match=r"unsupported architecture 'llama'.*supported: deepseek_v2"):
        apply_plan(dense, static_plan(build_tiny("olmoe"), [2, 2, 2]))


def test_applying_twice_is_refused():
    model = build_tiny("olmoe")
    plan = static_plan(model, [2, 2, 2])
    with apply_plan(model, plan):
        with pytest.raises(AllocMoeError, match="already applied"):
            apply_plan(model, plan)


@torch.no_grad()
def test_a_handle_that_has_exited_cannot_be_entered_again(ids):
    model = build_tiny("olmoe")
    plan = static_plan(model, [1, 1, 1])
    full = model(ids).logits
    with apply_plan(model, plan) as handle:
        cut = model(ids).logits
    assert not torch.equal(cut, full) and handle.activations_per_token() == 3.0   # counters stay readable
    with pytest.raises(AllocMoeError, match="was removed"):
        with handle:
            pass
    with pytest.raises(AllocMoeError, match="was removed"):
        handle.add_plan(plan)
    assert torch.equal(model(ids).logits, full)                                 # still the unmodified model


@torch.no_grad()
def test_alloc_t_on_a_single_token_is_static_top_round_k():
    model = build_tiny("deepseek_v2")
    ids = torch.randint(0, 96, (1, 1))
    with apply_plan(model, plan_of(model, lambda i: StaticTopK(3))):
        static = model(ids).logits
    with apply_plan(model, plan_of(model, lambda i: AllocT(2.5, k_base=1))) as handle:
        alloc_t = model(ids).logits
        assert handle.activations_per_token() == 3 * 2                      # round_half_up(2.5) in 2 layers
    assert (static - alloc_t).abs().max() <= 1e-6


def test_weights_first_kernel_is_chosen_only_for_large_fp32_experts_on_cpu():
    from types import SimpleNamespace

    from allocmoe.routing.experts import WEIGHTS_FIRST_MIN_ELEMENTS, _prefers_weights_first

    def experts(rows):
        return SimpleNamespace(has_gate=True, gate_up_proj=torch.empty(2, rows, 1024), _is_expert_parallel=False)

    large, tiny = experts(WEIGHTS_FIRST_MIN_ELEMENTS // 1024), experts(WEIGHTS_FIRST_MIN_ELEMENTS // 1024 - 1)
    hidden = torch.empty(3, 1024)
    assert _prefers_weights_first(large, hidden)
    assert not _prefers_weights_first(tiny, hidden)
    assert not _prefers_weights_first(large, hidden.to(torch.bfloat16))
    assert not _prefers_weights_first(SimpleNamespace(**{**vars(large), "_is_expert_parallel": True}), hidden)



def test_a_plan_runs_through_accelerates_device_hooks_and_removes_cleanly(ids):
    """device_map="auto" over several GPUs, or offload, puts accelerate's hook (an instance forward that
    moves weights and inputs) on routers and experts too. The plan runs inside the hook (as the
    _old_forward the hook calls), so routing equals the plain model's under the same plan, and removal
    leaves every hook as it was. Every device is the CPU here, with hooks forced onto the MoE modules."""
    accelerate = pytest.importorskip("accelerate")
    from conftest import build_tiny

    plain, hooked = build_tiny("olmoe"), build_tiny("olmoe")
    plan = static_plan(plain, [1, 2, 3])
    with torch.no_grad(), apply_plan(plain, plan) as handle:
        expected, expected_acts = plain(input_ids=ids).logits, handle.activations_per_token()
    names = [name for name, _ in hooked.named_modules() if name.endswith((".mlp.gate", ".mlp.experts"))]
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
                  **{name: "cpu" for name in names},
                  **{f"model.layers.{i}.{part}": "cpu" for i in range(3) for part in
                     ("self_attn", "input_layernorm", "post_attention_layernorm")}}
    hooked = accelerate.dispatch_model(hooked, device_map=device_map, main_device="cpu", force_hooks=True)
    modules = [hooked.get_submodule(name) for name in names]
    before = [(m.__dict__["forward"], m.__dict__["_old_forward"]) for m in modules]
    with torch.no_grad(), apply_plan(hooked, plan) as handle:
        got = hooked(input_ids=ids).logits
        assert handle.activations_per_token() == expected_acts
    assert torch.equal(got, expected)
    assert [(m.__dict__["forward"], m.__dict__["_old_forward"]) for m in modules] == before
    with torch.no_grad():
        assert torch.equal(hooked(input_ids=ids).logits, plain(input_ids=ids).logits)
