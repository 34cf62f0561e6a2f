"""Tiny random MoE models of every supported family, built in-test from transformers configs."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)   # tiny models gain nothing from more; keeps the suite steady on 2 shared cores

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

FAMILIES = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[0]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=16, norm_topk_prob=True,
                      head_dim=8),
    "olmoe": dict(num_experts=8, num_experts_per_tok=4, norm_topk_prob=False),
    "deepseek_v2": dict(n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=16,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, num_key_value_heads=4,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=1.5,
                        n_group=4, topk_group=2, topk_method="group_limited_greedy"),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=16,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, num_key_value_heads=4,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5,
                        n_group=4, topk_group=2, norm_topk_prob=True),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=4, head_dim=8, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=4),
    "granitemoeshared": dict(num_local_experts=8, num_experts_per_tok=4, shared_intermediate_size=24),
}


def build_tiny(model_type: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type], **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():   # random routers: spread the logits so rankings are far from ties
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and param.dim() == 2:
                param.normal_(0, 1.0)
            if name.endswith("e_score_correction_bias"):
                param.normal_(0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    return model


@torch.no_grad()
def experts_with_biases(model, gen: torch.Generator):
    """The model's first routed experts module, its biases (initialised to 0) made random so they count."""
    experts = [m for m in model.modules() if hasattr(m, "has_gate")][0]
    for name, param in experts.named_parameters():
        if name.endswith("bias"):
            param.copy_(torch.randn(param.shape, generator=gen))
    return experts


@pytest.fixture(params=sorted(FAMILIES))
def family_model(request):
    return request.param, build_tiny(request.param)


@pytest.fixture
def counted(monkeypatch):
    """Counts forward passes (any module) and weight loads while a test runs: a refusal must come
    before either (counted, never timed)."""
    from allocmoe.models import ModelSpec

    counts = {"forward": 0, "loads": 0}
    real_load = ModelSpec.load

    def load(self, *args, **kwargs):
        counts["loads"] += 1
        return real_load(self, *args, **kwargs)

    def forward(module, args):
        counts["forward"] += 1

    monkeypatch.setattr(ModelSpec, "load", load)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(forward)
    yield counts
    hook.remove()


@pytest.fixture
def ids():
    torch.manual_seed(1)
    return torch.randint(0, COMMON["vocab_size"], (2, 12))


def budget_sensitive_tiny(tiny_folder, model_type: str):
    """(model, tokenizer, calibration text): a tiny model of `model_type` with the tiny folder's
    tokenizer and its experts scaled up 8x, so the budget moves its perplexity."""
    from allocmoe import load_model, read_text

    _, tok = load_model(tiny_folder)
    model = build_tiny(model_type, vocab_size=len(tok), max_position_embeddings=256)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.mul_(8)
    text, _ = read_text(None, "calibration")
    return model, tok, text[:20000]


def windows_ppl(model, plan, windows, batch: int = 4) -> float:
    """`plan`'s perplexity on token `windows` [N, S], as one pass."""
    from allocmoe import apply_plan, evaluate_perplexity

    with apply_plan(model, plan):
        return evaluate_perplexity(model, None, "", {"windows_per_pass": batch, "progress": False},
                                   windows=windows).perplexity


def fit_at_ranks(model, windows, ranks: dict[int, int], batch: int = 4):
    """Stand-ins for the layers of `ranks`, each fitted on `windows` at its own rank (0: the mean alone)."""
    from allocmoe.calibrate.means import measure_expert_means
    from allocmoe.core.means import ExpertMeans

    means, linear = {}, {}
    for r in sorted(set(ranks.values())):
        got = measure_expert_means(model, windows, batch, rank=r, layers=[i for i in ranks if ranks[i] == r])
        means.update(got.means)
        linear.update(got.linear or {})
    return ExpertMeans(means=means, tokens=int(windows.numel()), linear=linear or None)


def two_fold_ppl(model, plan, windows, batch: int = 4) -> float:
    """Brute force for cross-fitting's score (calibrate/crossfit.py): `plan`'s perplexity over every token
    of the calibration `windows`, the odd windows scored with stand-ins fitted by the test on the even
    ones, the even windows with those fitted on the odd ones, each layer fitted at its own rank in the
    plan (not cut from a larger fit); a plan without stand-ins on all the windows in their order
    (Alloc-T's pool shares k in a batch)."""
    import math
    from dataclasses import replace

    if plan.means is None:
        return windows_ppl(model, plan, windows, batch)
    even, odd = windows[0::2], windows[1::2]
    nll = tokens = 0.0
    for fitted, scored in ((even, odd), (odd, even)):
        folded = fit_at_ranks(model, fitted, plan.means.ranks, batch)
        count = scored.numel() - scored.size(0)
        nll += count * math.log(windows_ppl(model, replace(plan, means=folded), scored, batch))
        tokens += count
    return math.exp(nll / tokens)


def train_tiny_tokenizer(folder, vocab_size: int = 300):
    """A byte-level BPE trained in a second on the built-in calibration text."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from allocmoe.texts import read_text

    text, _ = read_text(None, "calibration")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text[:200_000]], vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.save_pretrained(folder)
    return tok


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The tiny byte-level BPE of `train_tiny_tokenizer`, trained once for the session."""
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def relative_difference(a, b) -> float:
    """The largest relative difference between two sensitivity tables (lists of rows)."""
    return max(abs(x - y) / abs(y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


class KillAfter:
    """An `on_cell` callback that raises `error` (Ctrl-C by default) when the `count`-th cell is
    reported, as a kill of the profiling process would land; `cells` lists the cells reported."""

    def __init__(self, count: int, error: type[BaseException] = KeyboardInterrupt):
        self.count, self.error, self.cells = count, error, []

    def __call__(self, layer: int, k: int) -> None:
        self.cells.append((layer, k))
        if len(self.cells) == self.count:
            raise self.error


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny deepseek_v2 model folder with a tokenizer, as a user would point --model at."""
    folder = tmp_path_factory.mktemp("tiny_deepseek")
    tok = train_tiny_tokenizer(folder)
    model = build_tiny("deepseek_v2", vocab_size=len(tok), num_hidden_layers=4, max_position_embeddings=256)
    model.save_pretrained(folder)
    return folder


def policy_from_layer_entry(entry, k_orig: int):
    """A plan file's layer entry read the public way, through Plan.from_dict (a one-layer plan of a model
    with `k_orig`, at the full budget so any entry's spend fits): its policy, or the AllocMoeError."""
    from allocmoe.core.plan import Plan
    from allocmoe.core.policies import StaticTopK

    model = {"model_type": "qwen2_moe", "num_moe_layers": 1, "num_experts": 8, "k_orig": k_orig, "moe_layers": [0]}
    data = Plan(model=model, layers={0: StaticTopK(1)}, method="uniform", budget=float(k_orig)).to_dict()
    data["layers"]["0"] = entry
    data.pop("cost", None)      # the cost block describes the StaticTopK(1) layer replaced above; it is optional
    return Plan.from_dict(data).layers[0]


def expert_inputs(model, windows, layer_index: int, plan=None):
    """(inputs [T, H], top-K experts [T, K]) that MoE layer `layer_index`'s experts receive over
    `windows`, from the unmodified model or under `plan`, recorded by a hook on the experts."""
    import contextlib

    import torch

    from allocmoe import apply_plan

    seen = []
    experts = model.model.layers[layer_index].mlp.experts
    hook = experts.register_forward_pre_hook(lambda m, args: seen.append((args[0], args[1])))
    try:
        with torch.no_grad(), (apply_plan(model, plan) if plan is not None else contextlib.nullcontext()):
            for batch in windows.split(4):
                model(batch)
    finally:
        hook.remove()
    return torch.cat([h for h, _ in seen]), torch.cat([i for _, i in seen])


def olmoe_expert_output(experts, x, e):
    """OLMoE's expert e, written out: down(silu(gate x) * up x)."""
    import torch

    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])
