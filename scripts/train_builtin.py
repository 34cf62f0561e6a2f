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
import io
import json
import lzma
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from allocmoe.core.files import atomic_write_bytes

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "allocmoe" / "builtin" / "data"
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


def read_split(name: str) -> str:
    return lzma.open(DATA / f"{name}.txt.xz", "rt", encoding="utf-8").read()


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


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], k: int) -> torch.Tensor:
    """Switch-style auxiliary loss, E * sum_e f_e * P_e, averaged over MoE layers.
    E = experts; f_e = share of the T*k routed slots given to expert e, P_e = its mean probability."""
    losses = []
    for logits in router_logits:                           # [T, E]
        probs = logits.float().softmax(-1)
        chosen = probs.topk(k, dim=-1).indices              # [T, k]
        share = F.one_hot(chosen, probs.size(-1)).float().sum(1).mean(0) / k   # [E]
        losses.append(probs.size(-1) * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def batches(ids: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, seq_len: int) -> float:
    model.eval()
    windows = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
    nll, count = 0.0, 0
    for chunk in windows.split(16):
        out = model(input_ids=chunk, labels=chunk)
        n = chunk.numel() - chunk.size(0)
        nll += out.loss.item() * n
        count += n
    model.train()
    return math.exp(nll / count)


@torch.no_grad()
def min_expert_load(model, ids: torch.Tensor, seq_len: int) -> float:
    """The least-loaded routed expert's share of the mean load (top-k slots), over all MoE layers."""
    model.eval()
    counts, k = None, model.config.num_experts_per_tok
    for chunk in ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len).split(16):
        logits = model(input_ids=chunk).router_logits                     # per MoE layer: [T, E]
        step = torch.stack([torch.bincount(lg.topk(k, -1).indices.flatten(), minlength=lg.size(-1))
                            for lg in logits]).float()                     # [layers, E]
        counts = step if counts is None else counts + step
    model.train()
    return float((counts.min(-1).values / counts.mean(-1)).min())


def top1_over_full(model, ids: torch.Tensor, seq_len: int) -> float:
    """How much uniform top-1 costs on validation text: its perplexity over the full model's."""
    from allocmoe import apply_plan, model_fingerprint, static_plan

    with apply_plan(model, static_plan(model, [1] * model_fingerprint(model)["num_moe_layers"])):
        top1 = evaluate(model, ids, seq_len)
    return top1 / evaluate(model, ids, seq_len)


def save_state(path: Path, state: dict) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def train_step(model, batch: torch.Tensor, opt, sched, aux_coef: float) -> tuple[float, float]:
    """One optimiser step on the LM loss plus aux_coef x the load-balancing loss; -> (LM loss, aux)."""
    out = model(input_ids=batch, labels=batch)
    aux = load_balancing_loss(out.router_logits, model.config.num_experts_per_tok)
    opt.zero_grad(set_to_none=True)
    (out.loss + aux_coef * aux).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return out.loss.item(), aux.item()


def pretrain(model, train_ids: torch.Tensor, val_ids: torch.Tensor, args, ckpt: Path, gen: torch.Generator,
             desc: str) -> tuple[int, list[dict]]:
    """Stage 1: AdamW at args.lr, warm-up then cosine over args.steps (fixed by the step count, not
    the clock), the load-balancing loss at args.aux_loss, a validation point every args.eval_every
    steps, each saved with the optimiser, schedule and sampler to `ckpt`, from which a rerun resumes.
    Stops after args.max_minutes. -> (steps done, curve); fewer than args.steps: not finished."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    step, curve = 0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        step, curve = state["step"], state["curve"]
        print(f"resumed at step {step}")

    def save_checkpoint():
        save_state(ckpt, {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                          "gen": gen.get_state(), "step": step, "curve": curve})

    stream = batches(train_ids, args.seq_len, args.batch_size, gen)
    deadline = time.time() + args.max_minutes * 60
    bar = tqdm(total=args.steps, initial=step, desc=desc)
    model.train()
    while step < args.steps and time.time() < deadline:
        lm_loss, aux = train_step(model, next(stream), opt, sched, args.aux_loss)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{lm_loss:.3f}", aux=f"{aux:.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            curve.append({"step": step, "tokens": step * args.batch_size * args.seq_len,
                          "val_perplexity": evaluate(model, val_ids, args.seq_len)})
            bar.write(json.dumps(curve[-1]))
            save_checkpoint()
    bar.close()
    save_checkpoint()
    if step < args.steps:
        print(f"stopped at step {step} of {args.steps}: rerun the same command to resume")
    return step, curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="total optimiser steps (fixes the LR schedule)")
    parser.add_argument("--max-minutes", type=float, default=90.0, help="stop after this long; rerun to resume")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--aux-loss", type=float, default=0.01, help="load-balancing loss coefficient")
    parser.add_argument("--eval-every", type=int, default=100)
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

    ids_path = args.work_dir / "train_ids.pt"
    if not ids_path.exists():
        ids = torch.tensor(tok(read_split("train"))["input_ids"], dtype=torch.long)
        torch.save(ids, ids_path)
    ids = torch.load(ids_path)
    val_tokens = 32_768                                      # held out from the end of the train split
    train_ids, val_ids = ids[:-val_tokens], ids[-val_tokens:]

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

    args.model_out.mkdir(parents=True, exist_ok=True)
    config.output_router_logits = False
    model.save_pretrained(args.model_out, safe_serialization=True)
    tok.save_pretrained(args.model_out)
    (args.model_out / "training_curve.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}, indent=1) + "\n")
    print(f"saved to {args.model_out}")


if __name__ == "__main__":
    main()
