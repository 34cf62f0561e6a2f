"""Train the extra model families the comparisons run on: Qwen3-MoE, OLMoE, Granite-MoE and Mixtral style.

Not run by CI or tests; it rebuilds what ships in examples/models/. Same tokenizer (the built-in
model's), load-balancing loss and first-stage loop as the built-in model (scripts/training.py's
`pretrain`, which train_builtin.py runs too), a smaller shape, no stage 2:
these families have no shared experts, so the routed experts carry the work from the start and a
budget cut costs quality without any reshaping. Seeded and resumable (`--max-minutes`; rerun to go on).

    python scripts/train_family.py --family qwen3_moe     # renormalised top-k (norm_topk_prob=true)
    python scripts/train_family.py --family olmoe         # no renormalisation
    python scripts/train_family.py --family granitemoe    # top-k logits, then softmax over the k
    python scripts/train_family.py --family mixtral       # softmax over all, top-k, renormalised

The text (`--text`): qwen3_moe and olmoe train on the built-in train split (Brown + KJV), granitemoe
and mixtral on another text, the train part of Debian's fortune cookies (scripts/fortunes.py, which
writes examples/texts/fortunes/), so that they can be evaluated on held-out text of the kind they
learnt (its calibration.txt and test.txt) that is not the text the other families learnt:

    allocmoe sweep --model examples/models/granitemoe \\
        --calib-text examples/texts/fortunes/calibration.txt --text examples/texts/fortunes/test.txt

Saved in fp16 (a few MB each): the comparison loads them in float32, as it does the built-in model.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

import fortunes
from training import ROOT, add_pretrain_flags, min_expert_load, pretrain, save_trained, token_ids, top1_over_full

BUILTIN = ROOT / "src" / "allocmoe" / "builtin" / "model"
OUT = ROOT / "examples" / "models"

# Shared by every family: 4 MoE layers of 16 experts, K = 4, hidden 96, tied embeddings (the
# built-in tokenizer's 4,096 tokens), grouped-query attention (4 heads of 24, 2 KV heads), no shared
# experts, and no load-balancing loss inside the model (router_aux_loss_coef 0: `pretrain` adds its own).
COMMON = dict(vocab_size=4096, hidden_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=4, max_position_embeddings=512, tie_word_embeddings=True,
              bos_token_id=None, eos_token_id=0, pad_token_id=0, router_aux_loss_coef=0.0)
# Qwen3-MoE's experts are 64 wide (moe_intermediate_size; 1.5 M parameters). OLMoE has no separate
# expert width: its experts take intermediate_size, 256 (5.2 M parameters); the shipped model was
# trained so, and its config.json carries the unused moe_intermediate_size these kwargs give it, so they
# stay as they were.
SHAPE = dict(COMMON, intermediate_size=256, moe_intermediate_size=64, num_experts=16)
# Granite-MoE and Mixtral (transformers 5.24's GraniteMoeConfig, MixtralConfig) count experts in
# num_local_experts, and every decoder layer is MoE with no dense MLP, so intermediate_size is the
# experts' width and nothing else's: 64, as Qwen3-MoE's experts (about 1.5 M parameters each).
LOCAL_EXPERTS = dict(COMMON, intermediate_size=64, num_local_experts=16)
FAMILIES = {
    # Qwen3-MoE renormalises the kept top-k weights to sum to 1; per-head q/k norms.
    "qwen3_moe": dict(SHAPE, norm_topk_prob=True, head_dim=24, decoder_sparse_step=1, mlp_only_layers=[]),
    # OLMoE keeps the softmax weights of the chosen experts as they are.
    "olmoe": dict(SHAPE, norm_topk_prob=False),
    # Granite-MoE takes the top-k router logits, then a softmax over those k. Its multipliers
    # (embedding_multiplier, attention_multiplier, residual_multiplier, logits_scaling) stay at the
    # config's defaults, all 1.0; note attention_multiplier is the attention's whole scale, so the scores
    # are not divided by sqrt(head_dim) as in the other families (IBM's checkpoints set muP-style values).
    "granitemoe": dict(LOCAL_EXPERTS),
    # Mixtral: a softmax over all experts, the top-k kept and renormalised to sum to 1; no router noise.
    "mixtral": dict(LOCAL_EXPERTS, router_jitter_noise=0.0),
}
CLASSES = {"qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"), "olmoe": ("OlmoeForCausalLM", "OlmoeConfig"),
           "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig"),
           "mixtral": ("MixtralForCausalLM", "MixtralConfig")}
# The text a family trains on unless --text says otherwise.
DEFAULT_TEXT = {"qwen3_moe": "builtin", "olmoe": "builtin", "granitemoe": "fortunes", "mixtral": "fortunes"}


def build(family: str):
    import transformers

    cls, cfg = (getattr(transformers, name) for name in CLASSES[family])
    config = cfg(**FAMILIES[family])
    config.output_router_logits = True        # `pretrain`'s load-balancing loss reads each MoE layer's logits
    return cls(config)


def text_ids(tok, work: Path, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, validation ids) of the chosen train text, cached in `work` under a name per text
    (train_ids.pt for the built-in split, as before, so older work folders resume)."""
    if text == "builtin":
        return token_ids(tok, work)
    return token_ids(tok, work, fortunes.train_text, f"train_ids_{text}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    add_pretrain_flags(parser, steps=600, max_minutes=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--work-dir", type=Path, default=None, help="checkpoints (default: runs/<family>)")
    parser.add_argument("--out", type=Path, default=None, help="the finished model (default: examples/models/<family>)")
    parser.add_argument("--text", choices=("builtin", "fortunes"), default=None,
                        help="train text: the built-in train split, or the fortunes' train part (default: "
                             + ", ".join(f"{f}: {t}" for f, t in DEFAULT_TEXT.items()) + ")")
    args = parser.parse_args()
    args.text = args.text or DEFAULT_TEXT[args.family]
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    work = args.work_dir or ROOT / "runs" / args.family
    work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(BUILTIN)
    train_ids, val_ids = text_ids(tok, work, args.text)

    model = build(args.family)
    gen = torch.Generator().manual_seed(args.seed)
    step, curve = pretrain(model, train_ids, val_ids, args, work / "checkpoint.pt", gen,
                           f"train {args.family} on {args.text}")
    if step < args.steps:
        return
    curve[-1]["val_top1_over_full"] = top1_over_full(model, val_ids, args.seq_len)
    curve[-1]["val_min_expert_load"] = min_expert_load(model, val_ids, args.seq_len)
    print(json.dumps(curve[-1]))

    save_trained(model.half(), tok, args.out or OUT / args.family, args, curve)


if __name__ == "__main__":
    main()
