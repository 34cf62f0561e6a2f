"""Three exact ways to run a step whose tokens keep different expert counts, through vLLM CPU's own
fused MoE kernel (`cpu_fused_moe`), side by side on one MoE layer with random weights.

    weight0  every token at width K, dropped slots at weight 0 (the plugin's old path, the reference)
    pairs    the kept (token, expert) pairs as rows of width 1, one call, summed back with index_add
    groups   one call per distinct count, each at its own width
    dup      width K, a dropped slot pointing at the token's own top-1 at weight 0

Each is checked against weight0 (max abs difference, bf16) before it is timed; rounds interleave the
four and the median is printed. The plugin (integrations/vllm_experts.py) uses `pairs`.

    .venv-vllm/bin/python benchmarks/vllm_kernel_paths.py [--tokens 1 8 512] [--rounds 5]
Default shape: one DeepSeek-V2-Lite MoE layer (64 experts, top-6, hidden 2048, expert width 1408).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1408)
    args = parser.parse_args()
    torch.manual_seed(0)
    num_experts, k, hidden, width = args.experts, args.top_k, args.hidden, args.width
    isa = "amx" if "amx_bf16" in open("/proc/cpuinfo").read() else "vec"
    w13 = cpu_prepack_moe_weight((torch.randn(num_experts, 2 * width, hidden) * 0.02).bfloat16(), isa)
    w2 = cpu_prepack_moe_weight((torch.randn(num_experts, hidden, width) * 0.02).bfloat16(), isa)

    def call(x, weights, ids):
        out = torch.empty_like(x)
        cpu_fused_moe(out, x, w13, w2, None, None, weights.float().contiguous(), ids.int().contiguous(), "silu",
                      isa, False)
        return out

    print(f"torch threads {torch.get_num_threads()}, isa {isa}, layer E={num_experts} K={k} H={hidden} I={width}")
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden).bfloat16()
        probs, ids = torch.randn(tokens, num_experts).softmax(-1).topk(k)
        counts = torch.randint(1, k + 1, (tokens,))
        keep = torch.arange(k)[None] < counts[:, None]
        zeroed = probs * keep

        def weight0():
            return call(x, zeroed, ids)

        def pairs():
            token = torch.arange(tokens).repeat_interleave(counts)
            rows = call(x[token].contiguous(), probs[keep].reshape(-1, 1), ids[keep].reshape(-1, 1))
            return torch.zeros(tokens, hidden).index_add_(0, token, rows.float()).bfloat16()

        def groups():
            out = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
            for c in counts.unique().tolist():
                rows = (counts == c).nonzero().squeeze(1)
                out[rows] = call(x[rows].contiguous(), probs[rows, :c], ids[rows, :c])
            return out

        def dup():
            return call(x, zeroed, torch.where(keep, ids, ids[:, :1]))

        ways = (weight0, pairs, groups, dup)
        reference = weight0().float()
        diffs = {f.__name__: (f().float() - reference).abs().max().item() for f in ways[1:]}
        times = {f.__name__: [] for f in ways}
        for _ in range(args.rounds):
            for f in ways:
                start = time.perf_counter()
                f()
                times[f.__name__].append(time.perf_counter() - start)
        base = statistics.median(times["weight0"])
        cells = "  ".join(f"{n} {statistics.median(t) * 1e3:.1f} ms ({base / statistics.median(t):.2f}x)"
                          for n, t in times.items())
        mean = counts.float().mean()
        print(f"tokens {tokens:4d}, mean kept {mean:.2f} of {k} (ideal {k / mean:.2f}x): {cells}; "
              f"max |diff| vs weight0 {max(diffs.values()):.3g}", flush=True)


if __name__ == "__main__":
    main()
