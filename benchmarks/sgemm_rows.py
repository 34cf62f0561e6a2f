"""How one DeepSeek-V2-Lite expert's matmul time moves with its number of token rows, on this CPU.

Prints, for n rows, the weights-first product W @ x^T (the CPU experts kernel's matmul from
experts.TOKENS_FIRST_MAX_ROWS + 1 rows on) for the up projection [2816, 2048] and the down
projection [2048, 1408], the same with the rows widened as the kernel widens them
(experts.ROW_BLOCK / PAD_FROM_ROWS), the tokens-first product x @ W^T in one piece (on an Intel
Xeon host W @ x^T cost twice as much from 2 rows on, as much as the tokens-first product from 4
rows on), and the kernel's tokens-first product (`_tokens_first`: from SLICED_FROM_ROWS rows, W
in slices of experts.SLICE_ROWS output rows run as one batched matmul, because MKL passes over W
once per 3 rows and over a slice the later passes hit cache). Weights cycle over 48 experts
(1.6 GB) so they come from memory, as in a real layer (8 experts, 280 MB, partly fit this host's
cache). Shows why the kernel widens ragged row counts, slices W at 4-14 rows, and why a half
budget cannot halve prefill time on CPU: even one row streams the expert's 35 MB of weights.

    python benchmarks/sgemm_rows.py [--max-rows 40] [--threads N] [--packed] [--transposed]

--packed adds oneDNN's linear on weights packed as `pack_experts` packs them (the kernel's path
from PACKED_FROM_ROWS rows on when the experts are packed). --transposed stores the weights as
[in, O] (gpt_oss's layout) and prints W @ x^T against x @ W, the product the kernel runs there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from machine import cpu_name

from allocmoe.routing.experts import SLICED_FROM_ROWS, _packed_linear, _row_window, _tokens_first

EXPERTS = 48      # distinct weight matrices cycled through, so each product reads its weights from memory




def time_rows(weights: torch.Tensor, x: torch.Tensor, rows: int, repeats: int, tokens_first: bool = False,
              packed: list[torch.Tensor] | None = None, sliced: bool = False) -> float:
    """Median milliseconds of one weights-first (or tokens-first, sliced tokens-first, or packed
    oneDNN) product on `rows` rows of x."""
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for e in range(EXPERTS):
            if packed is not None:
                _packed_linear(x[:rows], packed[e])
            elif sliced:
                _tokens_first(x[:rows], weights[e])
            elif tokens_first:
                torch.mm(x[:rows], weights[e].t())
            else:
                torch.mm(weights[e], x[:rows].t())
        samples.append((time.perf_counter() - start) / EXPERTS)
    return statistics.median(samples[1:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rows", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--packed", action="store_true",
                        help="add a column: oneDNN's linear on weights packed by experts.pack_experts' rule")
    parser.add_argument("--transposed", action="store_true",
                        help="weights stored [in, O] (gpt_oss): W @ x^T against x @ W, no sliced column")
    args = parser.parse_args()
    if args.transposed and args.packed:
        parser.error("--packed times the [O, in] layout; run it without --transposed")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = {"up [2816, 2048]": (2816, 2048), "down [2048, 1408]": (2048, 1408)}
    if args.transposed:          # stored [E, in, O]; the [E, O, in] views are what the kernel multiplies
        projections = {name: torch.randn(EXPERTS, i, o).transpose(1, 2) for name, (o, i) in shapes.items()}
    else:
        projections = {name: torch.randn(EXPERTS, o, i) for name, (o, i) in shapes.items()}
    spare = 64   # rows beyond max-rows, so every window can widen
    inputs = {name: torch.randn(args.max_rows + spare, w.size(2)) for name, w in projections.items()}
    packed = {name: [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
              for name, weights in projections.items()} if args.packed else {}
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; milliseconds per "
          "product, weights-first as is -> widened (widened rows) | tokens-first"
          + (" (x @ W on weights stored [in, O])" if args.transposed else
             f" | the kernel's tokens-first (batched slices from {SLICED_FROM_ROWS} rows)")
          + (" | packed" if packed else ""))
    print("rows  " + "  ".join(f"{name:>48}" for name in projections))
    with torch.no_grad():
        for rows in range(1, args.max_rows + 1):
            lo, hi = _row_window(0, rows, args.max_rows + spare)
            cells = []
            for name, weights in projections.items():
                plain = time_rows(weights, inputs[name], rows, args.repeats)
                widened = time_rows(weights, inputs[name], hi - lo, args.repeats) if hi - lo != rows else plain
                tokens_first = time_rows(weights, inputs[name], rows, args.repeats, tokens_first=True)
                cell = f"{plain:8.2f} -> {widened:6.2f} ({hi - lo:2d}) | {tokens_first:6.2f}"
                if not args.transposed:
                    cell += f" | {time_rows(weights, inputs[name], rows, args.repeats, sliced=True):6.2f}"
                if packed:
                    cell += f" | {time_rows(weights, inputs[name], rows, args.repeats, packed=packed[name]):6.2f}"
                cells.append(cell)
            print(f"{rows:4d}  " + "  ".join(f"{cell:>48}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
