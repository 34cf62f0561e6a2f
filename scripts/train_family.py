"""Train the two extra model families the quality comparison runs on: Qwen3-MoE style and OLMoE style.

Not run by CI or tests; it rebuilds what ships in examples/models/. Same corpus, tokenizer,
load-balancing loss and first-stage loop as the built-in model (scripts/training.py's `pretrain`,
which train_builtin.py runs too), a smaller shape, no stage 2:
these families have no shared experts, so the routed experts carry the work from the start and a
budget cut costs quality without any reshaping. Seeded and resumable (`--max-minutes`; rerun to go on).

    python scripts/train_family.py --family qwen3_moe     # renormalised top-k (norm_topk_prob=true)
    python scripts/train_family.py --family olmoe         # no renormalisation

Saved in fp16 (a few MB each): the comparison loads them in float32, as it does the built-in model.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from training import ROOT, add_pretrain_flags, min_expert_load, pretrain, save_trained, token_ids, top1_over_full

BUILTIN = ROOT / "src" / "allocmoe" / "builtin" / "model"
OUT = ROOT / "examples" / "models"

# Shared by both families: 4 MoE layers of 16 experts, K = 4, hidden 96, tied embeddings (the
# built-in tokenizer's 4,096 tokens), grouped-query attention. Qwen3-MoE's experts are 64 wide
# (moe_intermediate_size; 1.5 M parameters). OLMoE has no separate expert width: its experts take
# intermediate_size, 256 (5.2 M parameters); the shipped model was trained so.
SHAPE = dict(vocab_size=4096, hidden_size=96, intermediate_size=256, moe_intermediate_size=64,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=16,
             num_experts_per_tok=4, max_position_embeddings=512, tie_word_embeddings=True,
             bos_token_id=None, eos_token_id=0, pad_token_id=0, router_aux_loss_coef=0.0)
FAMILIES = {
    # Qwen3-MoE renormalises the kept top-k weights to sum to 1; per-head q/k norms.
    "qwen3_moe": dict(norm_topk_prob=True, head_dim=24, decoder_sparse_step=1, mlp_only_layers=[]),
    # OLMoE keeps the softmax weights of the chosen experts as they are.
    "olmoe": dict(norm_topk_prob=False),
}


def build(family: str):
    from transformers import OlmoeConfig, OlmoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cls, cfg = {"qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig), "olmoe": (OlmoeForCausalLM, OlmoeConfig)}[family]
    config = cfg(**SHAPE, **FAMILIES[family])
    config.output_router_logits = True
    return cls(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    add_pretrain_flags(parser, steps=600, max_minutes=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--work-dir", type=Path, default=None, help="checkpoints (default: runs/<family>)")
    parser.add_argument("--out", type=Path, default=None, help="the finished model (default: examples/models/<family>)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    work = args.work_dir or ROOT / "runs" / args.family
    work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(BUILTIN)
    train_ids, val_ids = token_ids(tok, work)

    model = build(args.family)
    gen = torch.Generator().manual_seed(args.seed)
    step, curve = pretrain(model, train_ids, val_ids, args, work / "checkpoint.pt", gen, f"train {args.family}")
    if step < args.steps:
        return
    curve[-1]["val_top1_over_full"] = top1_over_full(model, val_ids, args.seq_len)
    curve[-1]["val_min_expert_load"] = min_expert_load(model, val_ids, args.seq_len)
    print(json.dumps(curve[-1]))

    save_trained(model.half(), tok, args.out or OUT / args.family, args, curve)


if __name__ == "__main__":
    main()
