"""The training loop the scripts share: the built-in model (train_builtin.py) and the extra families
(train_family.py) train with the same corpus, batches, load-balancing loss, optimiser, schedule,
checkpoints and validation points, so a change to any of them reaches every model.

Not run by CI or tests. `pretrain` is stage 1 (resumable, time-bounded); `add_pretrain_flags` its
flags; `token_ids` the train text tokenised once and cut into train and validation ids;
`save_trained` writes a finished model with its tokenizer and training curve.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from allocmoe.core.files import atomic_write_bytes

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "allocmoe" / "builtin" / "data"
VAL_TOKENS = 32_768                                      # held out from the end of the train split


def add_pretrain_flags(parser: argparse.ArgumentParser, steps: int, max_minutes: float) -> None:
    """The flags `pretrain` reads (and the batch shape every stage uses), with a script's own defaults."""
    parser.add_argument("--steps", type=int, default=steps, help="total optimiser steps (fixes the LR schedule)")
    parser.add_argument("--max-minutes", type=float, default=max_minutes, help="stop after this long; rerun to resume")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--aux-loss", type=float, default=0.01, help="load-balancing loss coefficient")
    parser.add_argument("--eval-every", type=int, default=100)


def token_ids(tok, work_dir: Path, read_text=None, cache: str = "train_ids.pt") -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, validation ids): the train text (`read_text()`; default the built-in train split)
    tokenised once (cached in work_dir/`cache`), its last VAL_TOKENS held out for validation."""
    ids_path = work_dir / cache
    if not ids_path.exists():
        text = read_text() if read_text else read_split("train")
        torch.save(torch.tensor(tok(text)["input_ids"], dtype=torch.long), ids_path)
    ids = torch.load(ids_path)
    return ids[:-VAL_TOKENS], ids[-VAL_TOKENS:]


def save_trained(model, tok, out_dir: Path, args, curve: list[dict]) -> None:
    """The finished model (safetensors), its tokenizer and training_curve.json (the run's flags and curve)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / "training_curve.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}, indent=1) + "\n")
    print(f"saved to {out_dir}")


def read_split(name: str) -> str:
    return lzma.open(DATA / f"{name}.txt.xz", "rt", encoding="utf-8").read()


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
