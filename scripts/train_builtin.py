"""Train the built-in model: a DeepSeek-V2-Lite in miniature, on the built-in train split.

Not run by CI or tests; it rebuilds what ships in src/allocmoe/builtin/model. Seeded, time-bounded
(`--max-minutes`; rerun to continue), resumable from its last checkpoint, with a progress bar and
load-balancing loss on. The learning-rate schedule is fixed by `--steps`, not by the clock, so a
run stopped and resumed trains exactly as one that was not.

    python scripts/prepare_data.py          # once, if the splits are missing
    python scripts/train_builtin.py --steps 1000
    python scripts/train_builtin.py --steps 1250 --eval-every 50
    python scripts/train_builtin.py --steps 1250 --eval-every 50 --rescale-routed 4 --rescale-shared 0.25 \
        --rounds 7 --balance-steps 300 --balance-aux 1

The shipped model was made by exactly those three commands (about 60 + 10 + 75 minutes on 2 cores).
The first run's last fifth still improved validation perplexity by 3.7%, so it was resumed with the
schedule stretched to 1250 steps (the cosine restarts from 9.5% of the peak rate at step 1000).
Budget cuts then barely mattered (top-1 cost 5.7% perplexity on test): the routed experts did
little beside the always-on shared experts. So stage 2 shifts work to them, in 7 rounds of: routed
outputs x4, shared outputs x0.25, 200 steps of fine-tuning. Each round raised top-1's cost on
validation text (1.12x after round 1, 3.61x after round 7); full-K validation perplexity went from
55.7 to 53.3 (round 4) and back to 56.3 (round 7). But the last rounds starved experts: the
least-loaded one got 1% of the mean load on validation text. So a last stage fine-tunes 300 steps
with the balancing coefficient at 1 instead of 0.01: the least-loaded expert rose to 37.5% of the
mean, full-K validation perplexity improved to 53.1, and top-1 still costs 2.08x. Per-stage figures are in
training_curve.json.

The third command saves its state after stage 2 (work dir's stage2.pt) and, rerun, resumes after
it. The shipped run made that state once (the 7-round model of the previous release), then ran the
balancing stage. That stage draws batches from its own seeded stream and starts a fresh optimiser,
so resuming changes nothing it trains on (an uninterrupted run's curve would only add a load figure
to each round's last point).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import torch
from tqdm import tqdm

from training import (ROOT, add_pretrain_flags, batches, evaluate, min_expert_load, pretrain, read_split,
                      save_state, save_trained, token_ids, top1_over_full, train_step)

MODEL_OUT = ROOT / "src" / "allocmoe" / "builtin" / "model"

# The shape: DeepSeek-V2-Lite's design (first layer dense, MLA attention without a q LoRA, 2 shared
# experts, softmax routing, no top-k renormalisation, scaling factor 1) at a size 2 CPU cores train.
MODEL_SHAPE = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=512,       # the dense first layer's MLP
    moe_intermediate_size=64,
    num_hidden_layers=7,         # 1 dense + 6 MoE
    first_k_dense_replace=1,
    n_routed_experts=32,
    num_experts_per_tok=6,
    n_shared_experts=2,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    topk_method="greedy",
    num_attention_heads=4,
    kv_lora_rank=64,
    q_lora_rank=None,            # as in V2-Lite
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=True,    # keeps the shipped file under 40 MB
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
)


def train_tokenizer(out_dir: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([read_split("train")], vocab_size=MODEL_SHAPE["vocab_size"],
                            min_frequency=2, special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.model_max_length = MODEL_SHAPE["max_position_embeddings"]
    tok.save_pretrained(out_dir)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pretrain_flags(parser, steps=1000, max_minutes=90.0)
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "builtin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-out", type=Path, default=MODEL_OUT,
                        help="where the finished model goes (default: the package's built-in model folder)")
    parser.add_argument("--rescale-routed", type=float, default=None,
                        help="stage 2: multiply routed experts' down projections by this, then fine-tune")
    parser.add_argument("--rescale-shared", type=float, default=1.0,
                        help="stage 2: multiply the shared experts' down projections by this (shift work to routed)")
    parser.add_argument("--rounds", type=int, default=1, help="stage 2: rescale-and-fine-tune this many times")
    parser.add_argument("--finetune-steps", type=int, default=200, help="steps per stage-2 round (fresh cosine schedule)")
    parser.add_argument("--finetune-lr", type=float, default=1e-3)
    parser.add_argument("--balance-steps", type=int, default=0,
                        help="last stage: fine-tune this many steps with a strong load-balancing loss")
    parser.add_argument("--balance-aux", type=float, default=1.0,
                        help="last stage's load-balancing coefficient (revives experts the rounds starved)")
    args = parser.parse_args()

    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = args.work_dir / "tokenizer"
    tok = AutoTokenizer.from_pretrained(tok_dir) if (tok_dir / "tokenizer.json").exists() else train_tokenizer(tok_dir)

    train_ids, val_ids = token_ids(tok, args.work_dir)

    config = DeepseekV2Config(**MODEL_SHAPE)
    config.output_router_logits = True
    model = DeepseekV2ForCausalLM(config)
    gen = torch.Generator().manual_seed(args.seed)
    step, curve = 0, []
    ckpt = args.work_dir / "checkpoint.pt"
    after_rounds = args.work_dir / "stage2.pt"   # the model after stage 2: a rerun resumes from there

    def point(stage: int, **extra) -> dict:
        curve.append({"step": step, "tokens": step * args.batch_size * args.seq_len, "stage": stage,
                      "val_perplexity": evaluate(model, val_ids, args.seq_len), **extra})
        return curve[-1]

    def finetune(stage: int, steps: int, aux_coef: float, stream, desc: str, eval_every: int,
                 measure_load: bool = False):
        """`steps` steps on a fresh AdamW and a cosine from --finetune-lr to 0, a point every `eval_every`."""
        nonlocal step
        opt = torch.optim.AdamW(model.parameters(), lr=args.finetune_lr, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / steps)))
        load = (lambda: {"val_min_expert_load": min_expert_load(model, val_ids, args.seq_len)}) if measure_load else dict
        print(json.dumps(point(stage, **load())), flush=True)
        model.train()
        for s in tqdm(range(1, steps + 1), desc=desc):
            train_step(model, next(stream), opt, sched, aux_coef)
            step += 1
            if s % eval_every == 0 or s == steps:      # counted within the stage, so its end is a point
                print(json.dumps(point(stage, **load())), flush=True)
                model.train()
        curve[-1]["val_top1_over_full"] = top1_over_full(model, val_ids, args.seq_len)
        if not measure_load:                        # else the last point has it already
            curve[-1]["val_min_expert_load"] = min_expert_load(model, val_ids, args.seq_len)
        print(json.dumps(curve[-1]), flush=True)

    if args.rescale_routed and after_rounds.exists():
        state = torch.load(after_rounds, weights_only=True)
        model.load_state_dict(state["model"])
        step, curve = state["step"], state["curve"]
        print(f"stages 1 and 2 already done ({after_rounds}); resuming after them at step {step}")
    else:
        step, curve = pretrain(model, train_ids, val_ids, args, ckpt, gen, "train")
        if step < args.steps:
            return
        stream = batches(train_ids, args.seq_len, args.batch_size, gen)
        if args.rescale_routed:
            # Stage 2. A short training leaves the routed experts doing little beside the always-on
            # shared experts (switching all routed experts off cost only 1.4x perplexity), so budget
            # cuts barely matter. Each round scales the routed outputs up and the shared outputs
            # down, then fine-tunes, which makes the model lean on its routed experts, as large,
            # long-trained MoEs do. Rounds are numbered as stages 2, 3, ... in the curve. A stopped
            # stage 2 restarts from its first round; a finished one is saved and not redone.
            for round_ in range(args.rounds):
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        if name.endswith("mlp.experts.down_proj"):
                            param.mul_(args.rescale_routed)
                        elif name.endswith("mlp.shared_experts.down_proj.weight"):
                            param.mul_(args.rescale_shared)
                finetune(2 + round_, args.finetune_steps, args.aux_loss, stream, f"stage 2, round {round_ + 1}",
                         args.eval_every)
            save_state(after_rounds, {"model": model.state_dict(), "step": step, "curve": curve})

    if args.balance_steps:
        # Last stage. The rounds' final rescale starves some experts (layer 1's least-loaded expert
        # fell to 3.7% of the mean load on test), and the 0.01 balancing loss is too weak to revive
        # them. A strong one does; it also narrows what a budget cut costs (top-1 over full went
        # 3.6x -> 2.1x on validation). It draws batches from its own seeded stream and starts a
        # fresh optimiser, so it trains the same whether or not the run resumed after stage 2.
        stage = 1 + max(p.get("stage", 1) for p in curve)
        balance_stream = batches(train_ids, args.seq_len, args.batch_size, torch.Generator().manual_seed(args.seed + 1))
        # A point every tenth of the stage, so that its last fifth (the flattening gate) starts on one.
        finetune(stage, args.balance_steps, args.balance_aux, balance_stream, "balance",
                 max(1, args.balance_steps // 10), measure_load=True)
        for p in curve:
            if p.get("stage") == stage:
                p["phase"] = "balance"

    save_trained(model, tok, args.model_out, args, curve)


if __name__ == "__main__":
    main()
