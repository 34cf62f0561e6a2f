"""Turn sweep results into a Markdown table and PNG plots (quality vs measured activations; the
per-layer allocation each method chose); write a command's set of result files all together or not
at all."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

from ..core.files import UMASK, atomic_write_bytes


def markdown_table(results: dict[str, Any]) -> str:
    rows = results["rows"]
    budgets = sorted({r["budget"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by_key = {(r["method"], r["budget"]): r for r in rows}
    model, full, ev = results["model"], results["full"], results["evaluation"]
    env = results.get("environment", {})
    lines = [
        f"Model `{model.get('name') or model['model_type']}` ({model['model_type']}, {model['num_moe_layers']} MoE "
        f"layers, {model['num_experts']} experts, K={model['k_orig']}); full model perplexity "
        f"**{full['perplexity']:.3f}** at {full['activations_per_token']:g} activations/token.",
        f"Perplexity on {ev['text']} ({ev['tokens']:,} tokens, windows of {ev['seq_len']}, batch {ev['batch_size']}); "
        f"cells show perplexity (relative change) [measured activations/token; with stand-ins, + their "
        f"activation-equivalents = the cost per token the budget bounds].",
        f"Machine: {env.get('machine', '?')}, {env.get('torch_threads', '?')} threads, torch {env.get('torch', '?')}, "
        f"transformers {env.get('transformers', '?')}; sweep took {results.get('seconds', 0):.0f} s.",
        "",
        "| method | " + " | ".join(f"B={by_key[(methods[0], b)]['budget_activations']:g} ({b:.0%})" for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    for method in methods:
        cells = []
        for b in budgets:
            r = by_key.get((method, b))
            if r is None:
                cells.append("")
                continue
            best = min(x["perplexity"] for x in rows if x["budget"] == b)
            text = f"{r['perplexity']:.3f} ({r['relative_change']:+.1%}) [{_spent(r)}]"
            cells.append(f"**{text}**" if r["perplexity"] == best else text)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    if any("tasks" in r for r in rows):
        tasks = sorted({t for r in rows for t in r.get("tasks", {})})
        lines += ["", "Task accuracy (lm-evaluation-harness, `acc`):", "",
                  "| method | budget | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
        full_tasks = results["full"].get("tasks", {})
        lines.append("| full model | 100% | " + " | ".join(
            f"{full_tasks.get(t, {}).get('acc', float('nan')):.3f}" for t in tasks) + " |")
        for r in rows:
            lines.append(f"| {r['method']} | {r['budget']:.0%} | " + " | ".join(
                f"{r.get('tasks', {}).get(t, {}).get('acc', float('nan')):.3f}" for t in tasks) + " |")
    autos = [r for r in rows if r.get("auto_choice")]
    if autos:
        lines += ["", "auto chose: " + "; ".join(
            f"B={r['budget_activations']:g}: {r['auto_choice']['method']} (k_base={r['auto_choice']['k_base']}"
            + (", stand-ins where the (k, rank) DP put them, ranks "
               + (" ".join(f"{i}:{k}" for i, k in r["auto_choice"].get("standin_ranks", {}).items()) or "none")
               if r["auto_choice"].get("menu")
               else ", stand-ins on every layer" if r["auto_choice"].get("substitute") else "") + ")"
            for r in autos)]
    return "\n".join(lines) + "\n"


def _spent(row: dict[str, Any]) -> str:
    """A row's measured activations per token and, where stand-ins cost more, the total it spent."""
    acts, cost = row["activations_per_token"], row.get("cost_per_token")
    return f"{acts:.2f}" if cost is None or abs(cost - acts) < 5e-3 else f"{acts:.2f} + {cost - acts:.2f} = {cost:.2f}"


def save_png(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def write_report(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """results.md, quality_vs_activations.png, allocations.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "results.md", markdown_table(results).encode("utf-8"))
    rows = results["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in methods:
        # the cost the budget bounds (activations plus stand-ins' activation-equivalents), where known
        pts = sorted((r.get("cost_per_token") or r["activations_per_token"], r["perplexity"])
                     for r in rows if r["method"] == method)
        ax.plot(*zip(*pts), marker="o", label=method)
    ax.axhline(results["full"]["perplexity"], color="grey", ls="--", lw=1, label="full model")
    ax.set_xlabel("measured cost per token: activations + stand-ins (summed over MoE layers)")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("Quality vs measured cost")
    ax.legend(fontsize=8, ncol=2)
    save_png(fig, out_dir / "quality_vs_activations.png")
    plt.close(fig)

    budgets = sorted({r["budget"] for r in rows})
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.6), sharey=True, squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, b in zip(axes[0], budgets):
        for n, method in enumerate(methods):
            r = next((x for x in rows if x["method"] == method and x["budget"] == b), None)
            if r and all(k is not None for k in r["k_per_layer"]):
                shift = (n - len(methods) / 2) * 0.03          # methods that agree stay visible side by side
                ax.plot([i + shift for i in range(len(r["k_per_layer"]))], r["k_per_layer"], marker=".",
                        ls=styles[n % len(styles)], label=method)
        ax.set_title(f"B = {b:.0%} of full")
        ax.set_xlabel("MoE layer (shallow -> deep)")
    axes[0][0].set_ylabel("K_l (activations per token)")
    axes[0][-1].legend(fontsize=7)
    save_png(fig, out_dir / "allocations.png")
    plt.close(fig)
    return [out_dir / n for n in ("results.md", "quality_vs_activations.png", "allocations.png")]


@contextlib.contextmanager
def written_together(out: Path) -> Iterator[Path]:
    """A temporary folder, next to `out`, to write a set of result files into. When the block ends
    they are moved into `out` together (SIGINT and SIGTERM held off meanwhile), so an interrupt leaves
    all of the new set or none of it; the temporary folder is removed on every exit path (only a
    SIGKILL or a power cut can leave a hidden `.NAME.*.tmp` folder behind). A new `out` appears by one
    rename; into an existing `out` (a sweep's, which holds its profile.json) the files are replaced one
    by one, so an OS error midway (a full disk) can leave some new files beside old ones."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = None
    try:
        with signals_held():
            folder = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
        os.chmod(folder, 0o777 & ~UMASK)          # mkdtemp makes 0700; it may become `out` itself
        yield folder
        with signals_held():
            if not out.exists():
                os.rename(folder, out)
            else:
                for item in sorted(folder.iterdir()):
                    os.replace(item, out / item.name)
    finally:
        if folder is not None:
            with signals_held():
                shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block take effect when it ends. Python runs signal
    handlers on the main thread only, so elsewhere (where they could not interrupt us) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous: dict[int, Any] = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not None:     # None: set outside Python, could not be put back
                previous[signum] = signal.signal(signum, lambda number, frame: caught.append(number))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught:
            handler = previous.get(caught[0])
            if callable(handler):
                handler(caught[0], None)
            elif handler != signal.SIG_IGN:          # the default action (or a handler set outside Python)
                signal.raise_signal(caught[0])
