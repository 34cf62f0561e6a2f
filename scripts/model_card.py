"""Measure the built-in model's card: test perplexity at uniform K = 1..K_orig, expert load per layer,
determinism, and the training curve's last-fifth improvement. Writes builtin/model/card.json and
prints the Markdown for docs/builtin-model.md.

    python scripts/model_card.py
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from allocmoe import apply_plan, evaluate_perplexity, load_model, model_fingerprint, read_text, static_plan
from allocmoe.scoring import tokenize_windows
from allocmoe.core.files import atomic_write_json
from allocmoe.models import BUILTIN_MODEL


def last_fifth_improvement(curve: list[dict], stage: int | None = None) -> tuple[float, int, int]:
    """Validation improvement over (at least) the last fifth of one training stage (default: the
    final one): from the last measured point at or before 80% of the stage's steps to its end.
    Stage 1 counts from step 0. Returns (gain, from_step, to_step)."""
    stage = curve[-1].get("stage", 1) if stage is None else stage
    points = [p for p in curve if p.get("stage", 1) == stage]
    start, end = (0 if stage == 1 else points[0]["step"]), points[-1]["step"]
    fifth = [p for p in points if p["step"] <= start + 0.8 * (end - start)][-1]
    return fifth["val_perplexity"] / points[-1]["val_perplexity"] - 1, fifth["step"], end


def _stage1(curve: list[dict]) -> dict:
    """Stage 1's own last-fifth figure, when a second stage followed it."""
    if curve[-1].get("stage", 1) == 1:
        return {}
    gain, fifth_step, end = last_fifth_improvement(curve, stage=1)
    return {"stage1_last_fifth_improvement": gain, "stage1_last_fifth_steps": [fifth_step, end]}


def main() -> None:
    started = time.time()
    model, tok = load_model()
    fp = model_fingerprint(model)
    text, _ = read_text(None, "test")
    windows = tokenize_windows(tok, text, 512)
    cfg = {"batch_size": 8, "progress": False}
    ppl = {}
    load = {}
    for k in range(1, fp["k_orig"] + 1):
        plan = static_plan(model, [k] * fp["num_moe_layers"])
        with apply_plan(model, plan) as handle:
            if k == fp["k_orig"]:
                counts = {i: torch.zeros(fp["num_experts"]) for i in fp["moe_layers"]}

                def record(layer, cand_idx, cand_probs, n, valid):
                    counts[layer] += torch.bincount(cand_idx[:, : int(n.max())][valid].flatten(),
                                                    minlength=fp["num_experts"]).float()

                handle.context.recorders.append(record)
            ppl[k] = evaluate_perplexity(model, tok, "", cfg, windows=windows).perplexity
        if k == fp["k_orig"]:
            load = {i: (c / c.mean()).tolist() for i, c in counts.items()}
    first, _ = load_model()
    again, _ = load_model()
    plain = [evaluate_perplexity(m, tok, "", cfg, windows=windows).perplexity for m in (first, again)]
    curve = json.loads((BUILTIN_MODEL / "training_curve.json").read_text())["curve"]
    last_fifth_gain, fifth_step, end = last_fifth_improvement(curve)
    # stage 2's rounds' last points and the balancing stage's points, when there are any
    rounds = [p for p in curve if "val_top1_over_full" in p and p.get("phase") != "balance"]
    balanced = [p for p in curve if p.get("phase") == "balance"]
    card = {
        "test_tokens_scored": int(windows.numel() - windows.size(0)), "seq_len": 512,
        "uniform_perplexity": {str(k): v for k, v in ppl.items()},
        "top1_over_full": ppl[1] / ppl[fp["k_orig"]], "top3_over_full": ppl[3] / ppl[fp["k_orig"]],
        "min_expert_load_over_mean": min(min(v) for v in load.values()),
        "min_expert_load_over_mean_per_layer": {str(i): min(v) for i, v in load.items()},
        "deterministic": plain[0] == plain[1], "unpatched_perplexity": plain[0],
        "validation_last_fifth_improvement": last_fifth_gain,
        "last_fifth_steps": [fifth_step, end],
        **_stage1(curve),
        "stage2_rounds_val_top1_over_full": [p["val_top1_over_full"] for p in rounds],
        **({"balancing_val_top1_over_full": balanced[-1]["val_top1_over_full"],
            "balancing_val_min_expert_load": [p["val_min_expert_load"] for p in balanced]} if balanced else {}),
        "parameters": sum(p.numel() for p in model.parameters()),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "seconds": round(time.time() - started, 1),
    }
    atomic_write_json(BUILTIN_MODEL / "card.json", card)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from allocmoe.measure.report import save_png

    fig, axes = plt.subplots(1, 2 if rounds else 1, figsize=(10 if rounds else 6, 3.5), squeeze=False)
    ax = axes[0, 0]
    for stage in sorted({p.get("stage", 1) for p in curve}):
        points = [p for p in curve if p.get("stage", 1) == stage]
        label = ("stage 1" if stage == 1 else "balancing" if points[0].get("phase") == "balance"
                 else f"stage 2, round {stage - 1}")
        ax.plot([p["tokens"] / 1e6 for p in points], [p["val_perplexity"] for p in points], marker=".", label=label)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    if rounds:
        ax = axes[0, 1]
        ax.plot([p["stage"] - 1 for p in rounds], [p["val_top1_over_full"] for p in rounds], marker="o")
        if balanced:
            ax.plot([len(rounds) + 1], [balanced[-1]["val_top1_over_full"]], marker="s", ls="", label="after balancing")
            ax.legend(fontsize=7)
        ax.set_xlabel("stage 2 round")
        ax.set_ylabel("top-1 / full perplexity (validation)")
        ax.set_title("what a budget cut costs, round by round", fontsize=9)
    save_png(fig, Path(__file__).resolve().parents[1] / "docs" / "training_curve.png")
    print("| K (uniform) | " + " | ".join(str(k) for k in ppl) + " |")
    print("|---|" + "---|" * len(ppl))
    print("| test perplexity | " + " | ".join(f"{v:.2f}" for v in ppl.values()) + " |")
    print(json.dumps({k: v for k, v in card.items() if k != "uniform_perplexity"}, indent=1))


if __name__ == "__main__":
    main()
