"""Train the two extra model families the quality comparison runs on: Qwen3-MoE style and OLMoE style.

Not run by CI or tests; it rebuilds what ships in examples/models/. Same corpus, tokenizer,
load-balancing loss and first-stage loop as the built-in model (scripts/train_builtin.py's
`pretrain`), a smaller shape, no stage 2:
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

from train_builtin import ROOT, min_expert_load, pretrain, read_split, top1_over_full

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
    parser.add_argument("--steps", type=int, default=600, help="total optimiser steps (fixes the LR schedule)")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="stop after this long; rerun to resume")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--aux-loss", type=float, default=0.01, help="load-balancing loss coefficient")
    parser.add_argument("--eval-every", type=int, default=100)
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
    ids_path = work / "train_ids.pt"
    if not ids_path.exists():
        torch.save(torch.tensor(tok(read_split("train"))["input_ids"], dtype=torch.long), ids_path)
    ids = torch.load(ids_path)
    val_tokens = 32_768
    train_ids, val_ids = ids[:-val_tokens], ids[-val_tokens:]

    model = build(args.family)
    gen = torch.Generator().manual_seed(args.seed)
    step, curve = pretrain(model, train_ids, val_ids, args, work / "checkpoint.pt", gen, f"train {args.family}")
    if step < args.steps:
        return
    curve[-1]["val_top1_over_full"] = top1_over_full(model, val_ids, args.seq_len)
    curve[-1]["val_min_expert_load"] = min_expert_load(model, val_ids, args.seq_len)
    print(json.dumps(curve[-1]))

    out_dir = args.out or OUT / args.family
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.half().save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / "training_curve.json").write_text(json.dumps(
        {"args": {k_: str(v) for k_, v in vars(args).items()}, "curve": curve}, indent=1) + "\n")
    print(f"saved to {out_dir}")


if __name__ == "__main__":
    main()
