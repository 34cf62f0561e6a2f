"""Random-weight models of real MoE shapes, for speed measurements only.

Dimensions follow the published configs (hidden size, attention layout, expert count and width,
top-k, shared experts, dense first layers, vocabulary). Weights are random: quality numbers on
these models are meaningless, and every output that uses them says so.
"""

from __future__ import annotations

import torch

from ..errors import AllocMoeError

SHAPES: dict[str, dict] = {
    # deepseek-ai/DeepSeek-V2-Lite: 27 layers (first dense), MLA without q LoRA, 64 routed experts of
    # 1408, top-6, 2 shared, softmax without renormalising.
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=4096),
    # Qwen/Qwen1.5-MoE-A2.7B: 24 layers, 60 experts of 1408, top-4, one gated shared expert of 5632.
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
        norm_topk_prob=False, decoder_sparse_step=1, max_position_embeddings=8192),
    # allenai/OLMoE-1B-7B-0924: 16 layers, 64 experts of 1024, top-8, no shared expert.
    "olmoe-1b-7b": dict(
        model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, max_position_embeddings=4096),
}
PREFIX = "synthetic:"


def synthetic_config(name: str, num_layers: int | None = None, overrides: dict | None = None):
    """The config of shape `name` (synthetic:<shape>), with `num_layers` and any field of `overrides`
    (e.g. a vocab_size that holds another tokenizer) changed; SHAPES itself is never changed."""
    from transformers import AutoConfig

    shape = SHAPES.get(name.removeprefix(PREFIX))
    if shape is None:
        raise AllocMoeError(f"unknown synthetic shape {name!r}; choose one of "
                            f"{', '.join(PREFIX + s for s in SHAPES)}")
    shape = {**shape, **(overrides or {})}
    model_type = shape.pop("model_type")
    if num_layers is not None:
        dense = shape.get("first_k_dense_replace", 0)
        if num_layers <= dense:
            raise AllocMoeError(f"--num-layers must be more than {dense} (the dense first layers) for {name}")
        shape["num_hidden_layers"] = num_layers
    return AutoConfig.for_model(model_type, **shape)


def parameter_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of weights a config builds, counted on the meta device (no memory used)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * torch.empty(0, dtype=dtype).element_size()


def build_synthetic(name: str, num_layers: int | None = None, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", seed: int = 0, overrides: dict | None = None):
    """A random-weight model of a real shape (synthetic_config's `overrides` changed); routers get
    realistic, non-degenerate logits."""
    from transformers import AutoModelForCausalLM

    config = synthetic_config(name, num_layers, overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():   # spread router logits like a trained router's, so routing is not all ties
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and param.dim() == 2 and "shared" not in name:
                param.normal_(0.0, 1.0 / config.hidden_size ** 0.5)
    return model.eval()
