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
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(folder)
    return folder


if __name__ == "__main__":          # python tests_vllm/tiny_models.py qwen3_moe OUT_DIR
    import sys

    print(build(sys.argv[1], Path(sys.argv[2])))
