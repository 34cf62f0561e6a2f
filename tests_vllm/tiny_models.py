"""Tiny random MoE model folders vLLM's CPU backend loads (2 layers, 8 experts, top-2), with a
byte-level BPE tokenizer trained in a second on the built-in calibration text."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
EXPERT_SCALE = 8.0
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      head_dim=64, decoder_sparse_step=1, mlp_only_layers=[]),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    # vLLM's CPU attention for MLA needs kv_lora_rank 512 and qk_rope_head_dim 64; plain top-k written
    # as grouped top-k with one group (how vLLM routes DeepSeek-V2), softmax, scaled weights
    "deepseek_v2": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=0, moe_layer_freq=1, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None, topk_method="greedy", n_group=1,
                        topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.0),
    # sigmoid scores, a correction bias (random below) and 4 groups of which 2 are kept; vLLM reads
    # topk_method and scoring_func from the config, as DeepSeek-V3's own config.json gives them
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=0, moe_layer_freq=1, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None, n_group=4, topk_group=2,
                        norm_topk_prob=True, routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid"),
}


def build(model_type: str, folder: Path) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from allocmoe.texts import read_text

    folder.mkdir(parents=True, exist_ok=True)
    text, _ = read_text(None, "calibration")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text[:200_000]], vocab_size=COMMON["vocab_size"], special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type], "vocab_size": len(tok)})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():     # spread router and output logits, so rankings and argmaxes are far from ties
        for name, param in model.named_parameters():
            if name.endswith("gate.weight") and param.dim() == 2 and param.size(0) == 8:
                param.normal_(0, 1.0)
            if ".experts." in name:
                param.mul_(EXPERT_SCALE)     # experts dominate the residual, so one expert less shows
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)      # steers the choice away from the scores' own order
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(folder)
    return folder


if __name__ == "__main__":          # python tests_vllm/tiny_models.py qwen3_moe OUT_DIR
    import sys

    print(build(sys.argv[1], Path(sys.argv[2])))
