"""Forward tokens/s of a tiny MoE at K_orig and at half the budget, side by side in one run.

Shows that cutting activations cuts wall-clock (unselected pairs are not computed), for static
top-k and for Alloc-T. Timings are interleaved and repeated; medians are printed.

    python benchmarks/forward_throughput.py
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from allocmoe import apply_plan
from allocmoe.calibrate.methods import allocate


def main() -> None:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=32, num_experts_per_tok=8,
        norm_topk_prob=False)
    model = AutoModelForCausalLM.from_config(config).eval()
    for name, p in model.named_parameters():
        if name.endswith("gate.weight"):
            torch.nn.init.normal_(p, 0, 1 / 16)
    ids = torch.randint(0, 1024, (4, 256))
    plans = {"full (K=8)": None, "uniform top-4 (B=1/2)": allocate("0.5", "uniform", model=model),
             "alloc-t (B=1/2)": allocate("0.5", "alloc-t", model=model)}
    samples = {name: [] for name in plans}
    with torch.no_grad():
        for rep in range(6):
            for name, plan in plans.items():
                handle = apply_plan(model, plan) if plan else None
                t0 = time.perf_counter()
                model(ids)
                elapsed = time.perf_counter() - t0
                if handle:
                    handle.remove()
                if rep:                                         # the first round is warm-up
                    samples[name].append(ids.numel() / elapsed)
    base = statistics.median(samples["full (K=8)"])
    print(f"tiny qwen3_moe (4 layers, 32 experts, K=8), batch 4 x 256, {torch.get_num_threads()} threads")
    for name, values in samples.items():
        med = statistics.median(values)
        print(f"  {name:24s} {med:9.0f} tok/s  ({med / base:.2f}x)  spread {min(values):.0f}-{max(values):.0f}")


if __name__ == "__main__":
    main()
