"""`allocmoe eval`, `sweep`, `compare`, `analyze`, `bench`: measuring a plan's quality and speed."""

from __future__ import annotations

import json
import sys

import torch

from ..core.outputs import check_output_dir, check_output_file, plan_inputs
from ..errors import AllocMoeError
from .common import (add_calib_tokens, add_prefix_cache, add_eval_tokens, add_model_flags, add_output, add_quiet,
                     add_ray_flags, add_task_flags, check_seq_len, emit, sweep_inputs, sweep_names, inspect, load,
                     non_negative_int, positive_int, task_names)


def add_parsers(sub) -> None:
    """The measuring commands' parsers: eval, sweep, compare, analyze, bench."""
    for add in (_add_eval, _add_sweep, _add_compare, _add_analyze, _add_bench):
        add(sub)


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity with or without a plan")
    add_model_flags(p)
    p.add_argument("--plan", default=None, help="plan JSON to apply (default: the unmodified model)")
    p.add_argument("--text", default=None, help="UTF-8 text to score (default: built-in test split)")
    add_eval_tokens(p, None, "score only the first N tokens (default: all)")
    p.add_argument("--decode-batch", type=positive_int, default=None,
                   help="score as N sequences decoded side by side, one position of each per step (replaces "
                        "--windows-per-pass for perplexity); reports distinct experts per step per layer")
    add_output(p, "also write the result JSON here", old="--output-json")
    add_task_flags(p)
    add_quiet(p)
    p.set_defaults(func=cmd_eval, windows_per_pass=None)      # None: not given (4), so --decode-batch can refuse it


def _add_sweep(sub) -> None:
    from ..calibrate.methods import METHODS

    p = sub.add_parser("sweep", help="budgets x methods table with plots (the main job)")
    add_model_flags(p)
    p.add_argument("--profile", default=None, help="reuse this profile instead of profiling")
    p.add_argument("--calib-text", default=None, help="calibration text (default: built-in calibration split)")
    p.add_argument("--text", default=None, help="evaluation text (default: built-in test split)")
    p.add_argument("--budgets", default="1/3,1/2,2/3,5/6", help="comma-separated budgets (default 1/3,1/2,2/3,5/6)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods (default: all)")
    p.add_argument("--k-base", type=positive_int, default=1, help="Alloc-T k_base (default 1)")
    add_eval_tokens(p, 16384, "evaluation tokens per row (16384)")
    add_calib_tokens(p, 8192, old="--calib-max-tokens")
    add_output(p, "folder for results (default allocmoe-sweep)", old="--output-dir", default="allocmoe-sweep")
    add_task_flags(p)
    add_prefix_cache(p)
    add_ray_flags(p, "profile and score the rows (and their --tasks)")
    add_quiet(p)
    # None: not given (the defaults are filled in by cmd_sweep), so a flag no row would read is refused
    p.set_defaults(func=cmd_sweep, k_base=None, calib_tokens=None, prefix_cache=None)


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="paired task-accuracy difference of two `eval --tasks` results")
    p.add_argument("a", help="eval JSON (from `allocmoe eval --tasks ... --output FILE`)")
    p.add_argument("b", help="eval JSON of the same tasks, e.g. another plan")
    p.add_argument("--metric", default="acc", choices=("acc", "acc_norm"), help="per-item metric (acc)")
    add_output(p, "also write the comparison JSON here", old="--output-json")
    p.set_defaults(func=cmd_compare)


def _add_analyze(sub) -> None:
    p = sub.add_parser("analyze", help="experts vs routing entropy, expert load vs the unmodified model")
    add_model_flags(p)
    p.add_argument("--plan", required=True, help="plan JSON to analyse")
    p.add_argument("--text", default=None, help="UTF-8 text (default: built-in test split)")
    add_eval_tokens(p, 16384, "tokens to route (16384)")
    add_output(p, "folder for analysis.json and analysis.png (default allocmoe-analysis)", old="--output-dir",
               default="allocmoe-analysis")
    add_quiet(p)
    p.set_defaults(func=cmd_analyze)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="prefill/decode latency: full vs plan vs experts off, side by side")
    add_model_flags(p, batch_size=1, batch_help="sequences decoded side by side (a decode step routes one "
                    "token of each)", batch_flag="--sequences")
    p.add_argument("--plan", default=None, help="plan JSON to time (a distinct-expert plan is timed beside "
                   "uniform top-k at the activations per token it spends)")
    p.add_argument("--budget", default=None, help="or make a plan: budget (fraction or count)")
    p.add_argument("--max-distinct-experts", default=None, metavar="M",
                   help="or make a distinct-expert plan: at most M distinct experts per layer and decode step, "
                        "a fraction of the unrestricted union at --sequences (0.5, 1/2, 50%%; measured on other "
                        "random prompts) or a count (e.g. 32); timed beside uniform top-k")
    p.add_argument("--method", default="alloc-t", help="with --budget: uniform, alloc-t (default), ascending, descending")
    p.add_argument("--k-base", type=positive_int, default=1, help="Alloc-T k_base (default 1)")
    p.add_argument("--input-len", type=positive_int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--output-len", type=positive_int, default=32, help="decode steps timed (default 32)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed rounds (default 1)")
    p.add_argument("--num-layers", type=positive_int, default=None, help="synthetic models: decoder layers to build")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--packed-experts", action="store_true",
                   help="CPU, float32: also pack the experts' weights for oneDNN (a second copy in memory), which "
                        "runs experts with 4 or more rows of a batched step faster (docs/speed.md)")
    add_output(p, "also write the result JSON here", old="--output-json")
    add_quiet(p)
    # None: not given (alloc-t and 1 with --budget), so --method and --k-base are refused where nothing reads them
    p.set_defaults(func=cmd_bench, method=None, k_base=None)


def cmd_eval(args) -> None:
    from ..measure.evaluate.run import evaluate_model

    check_output_file(args.output, inputs=[*plan_inputs("--plan", args.plan), ("--text", args.text),
                      ("--model", args.model), ("--include-path", args.include_path)])
    tasks = task_names(args)
    if args.decode_batch is not None and args.windows_per_pass is not None and not tasks:
        raise AllocMoeError("--windows-per-pass does not apply with --decode-batch, which replaces it for perplexity "
                            "(it sizes only --tasks' batches); drop --windows-per-pass")
    args.windows_per_pass = 4 if args.windows_per_pass is None else args.windows_per_pass
    result = evaluate_model(args.model, plan=args.plan, text=args.text, seq_len=args.seq_len,
                            eval_tokens=args.eval_tokens, windows_per_pass=args.windows_per_pass,
                            trust_remote_code=args.trust_remote_code, tasks=tasks,
                            task_options={"num_fewshot": args.num_fewshot, "limit": args.limit,
                                          "include_path": args.include_path}, progress=not args.quiet,
                            decode_batch=args.decode_batch)
    # per-item scores (thousands of 0/1 values) go to the file, for `allocmoe compare`; not to the screen
    shown = {key: value for key, value in result.items() if key != "task_items"}
    if tasks and not args.output:
        print("per-item scores, which `allocmoe compare` pairs up, are kept only with --output", file=sys.stderr)
    emit(result, args.output, shown)
    if args.decode_batch:
        outside = result["top1_outside_chosen_rate"]
        print(f"decode batch {args.decode_batch}: perplexity {result['perplexity']:.4f} at "
              f"{result['activations_per_token']:.2f} of {result['full_activations_per_token']:g} activations/token"
              + (f" (cost {result['cost_per_token']:.2f} with stand-ins)" if result.get("cost_per_token") is not None
                 and result["cost_per_token"] - result["activations_per_token"] > 5e-3 else "") + "; "
              f"distinct experts per step {result['distinct_experts_per_step']:.2f} (max "
              f"{result['max_distinct_experts_per_step']}) of {result['model']['num_experts']} per layer"
              + (f"; top-1 outside the chosen set {outside:.1%}" if outside is not None else ""), file=sys.stderr)


def cmd_sweep(args) -> None:
    """Every input is checked before the weights load (budgets, methods, tasks, the profile against the
    model's layout, --seq-len), and both texts' lengths before profiling or the first pass."""
    from ..calibrate.methods import PROFILE_METHODS, check_k_base
    from ..calibrate.profile import ProfileConfig, load_profile
    from .calibrate import refuse_unread
    from ..core.budget import Budget
    from ..measure.report import markdown_table
    from ..pipelines.sweep import SweepConfig, sweep
    from ..texts import read_text

    check_output_dir(args.output, inputs=sweep_inputs(args), names=sweep_names(args.profile))
    tasks = task_names(args)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    reads, given = _sweep_reads(args, methods)
    args.k_base = 1 if args.k_base is None else args.k_base
    args.calib_tokens = 8192 if args.calib_tokens is None else args.calib_tokens
    args.prefix_cache = args.prefix_cache is not False
    config = SweepConfig(
        budgets=tuple(b for b in args.budgets.split(",") if b.strip()),
        methods=methods,
        eval_tokens=args.eval_tokens, seq_len=args.seq_len, windows_per_pass=args.windows_per_pass, k_base=args.k_base,
        profile=ProfileConfig(calib_tokens=args.calib_tokens, progress=not args.quiet, prefix_cache=args.prefix_cache),
        tasks=tuple(tasks or ()), task_limit=args.limit, num_fewshot=args.num_fewshot,
        include_path=args.include_path, progress=not args.quiet, ray=args.ray, ray_workers=args.ray_workers)
    calib, calib_name = read_text(args.calib_text, "calibration")
    text, text_name = read_text(args.text, "test")
    spec = inspect(args)
    seq_len = check_seq_len(spec, args.seq_len)
    fingerprint = spec.fingerprint()
    for budget in config.budgets:
        Budget.parse(budget, fingerprint["num_moe_layers"], fingerprint["k_orig"])
        for method in set(methods) & {"alloc-t", "alloc-moe"}:      # the k_base every such row would keep
            check_k_base(args.k_base, method, fingerprint["k_orig"], budget, spec.skeleton(), None)
    profile = load_profile(args.profile, spec.skeleton()) if args.profile else None
    if tasks:
        from ..measure.evaluate.harness import check_tasks

        check_tasks(tasks, args.include_path)
    refuse_unread(given, {flag for flag, read in reads.items() if read}, SWEEP_READERS,     # once the methods are known
                  f"--methods {','.join(methods)}")
    from ..scoring.perplexity import check_batch_size, tokenize_windows

    windows = tokenize_windows(spec.tokenizer(), text, seq_len, args.eval_tokens,     # 16384, the default: "up to"
                               beyond=None if args.eval_tokens == 16384 else "eval_tokens (--eval-tokens)")
    check_batch_size(windows, args.windows_per_pass)
    profiles = profile is None and any(m in PROFILE_METHODS + ("auto",) for m in config.methods)
    if profiles or any(m in ("top-p", "naee", "auto") for m in config.methods):
        calib_windows = tokenize_windows(spec.tokenizer(), calib, seq_len, args.calib_tokens,
                                         beyond=None if args.calib_tokens == 8192 else "calib_tokens (--calib-tokens)")
        check_batch_size(calib_windows, args.windows_per_pass)     # the calibration passes batch the same way
    model, tok = (spec, spec.tokenizer()) if args.ray is not None else load(args, spec)   # --ray: the workers load it
    results = sweep(model, tok, calib, text, config, output_dir=args.output, profile=profile,
                    text_names=(calib_name, text_name))
    print(markdown_table(results))
    print(f"wrote {args.output}/results.json, results.md, plans.json, quality_vs_activations.png, allocations.png",
          file=sys.stderr)


def cmd_compare(args) -> None:
    from ..measure.evaluate.paired import compare_results, markdown
    from ..core.files import atomic_write_json, read_json

    check_output_file(args.output, inputs={"A": args.a, "B": args.b})
    a, b = read_json(args.a, "eval result"), read_json(args.b, "eval result")
    comparison = compare_results(a, b, args.metric, (args.a, args.b))
    print(markdown(comparison, (args.a, args.b), args.metric))
    skipped = sorted(set(a.get("task_items", {})) - set(comparison["tasks"]))
    if skipped:
        print(f"not compared (no per-item {args.metric}, or only in {args.a}): {', '.join(skipped)}", file=sys.stderr)
    if args.output:
        atomic_write_json(args.output, {"a": args.a, "b": args.b, "metric": args.metric, **comparison})
        print(f"wrote {args.output}", file=sys.stderr)


def cmd_analyze(args) -> None:
    from ..measure.analyze import analyze_plan, write_analysis
    from ..scoring.perplexity import check_batch_size, tokenize_windows
    from ..core.plan import Plan
    from ..routing.layout import check_plan
    from ..texts import read_text

    check_output_dir(args.output, inputs=[*plan_inputs("--plan", args.plan), ("--text", args.text),
                     ("--model", args.model)], names=("analysis.json", "analysis.png"))
    text, _ = read_text(args.text, "test")
    plan = Plan.load(args.plan)
    spec = inspect(args)
    seq_len = check_seq_len(spec, args.seq_len)
    check_plan(plan, spec.skeleton())
    windows = tokenize_windows(spec.tokenizer(), text, seq_len, args.eval_tokens,     # 16384, the default: "up to"
                               beyond=None if args.eval_tokens == 16384 else "--eval-tokens")
    check_batch_size(windows, args.windows_per_pass)
    model, tok = load(args, spec)
    result = analyze_plan(model, tok, plan, windows, args.windows_per_pass, progress=not args.quiet)
    write_analysis(result, args.output)
    print(json.dumps({k: v for k, v in result.items() if k != "per_layer"}, indent=2))
    print(f"wrote {args.output}/analysis.json, analysis.png", file=sys.stderr)


BENCH_METHODS = ("uniform", "alloc-t", "ascending", "descending")   # need neither a profile nor calibration

# sweep's flags that only some rows read (cli/calibrate.py's rule: a flag nothing reads is refused)
SWEEP_READERS = {
    "--profile": ("", "no row allocates from a profile (only alloc-moe, alloc-l and auto do)"),
    "--k-base": ("", "no row runs Alloc-T (only alloc-moe, alloc-t and auto do)"),
    "--calib-text": ("", "no row reads calibration text (only top-p, naee, auto and profiling do)"),
    "--calib-tokens": ("", "no row reads calibration text (only top-p, naee, auto and profiling do)"),
    "--no-prefix-cache": ("", "nothing is profiled (no profile method, or --profile is given)"),
}
# bench's flags that only some runs read
BENCH_READERS = {
    "--method": ("", "only --budget makes a plan with a method; --plan and --max-distinct-experts bring their own"),
    "--k-base": ("", "only --budget with --method alloc-t runs Alloc-T, whose tokens each keep k_base experts"),
}


def _sweep_reads(args, methods: tuple[str, ...]) -> tuple[dict[str, bool], dict[str, object]]:
    """(which of SWEEP_READERS' flags some row of `methods` reads, those flags as given: None when not)."""
    from ..calibrate.methods import K_BASE_METHODS, PROFILE_METHODS

    profiles = args.profile is None and any(m in PROFILE_METHODS + ("auto",) for m in methods)
    reads = {"--profile": any(m in PROFILE_METHODS + ("auto",) for m in methods),
             "--k-base": any(m in K_BASE_METHODS for m in methods),
             "--calib-text": profiles or any(m in ("top-p", "naee", "auto") for m in methods),
             "--no-prefix-cache": profiles}
    reads["--calib-tokens"] = reads["--calib-text"]
    given = {"--profile": args.profile, "--k-base": args.k_base, "--calib-text": args.calib_text,
             "--calib-tokens": args.calib_tokens, "--no-prefix-cache": args.prefix_cache}
    return reads, given


class _Shape:
    """What `check_memory` reads of a model (its config; its parameters' dtype and device), before the
    model exists: a batch that cannot fit is refused before gigabytes of weights are built or read."""

    def __init__(self, config, dtype: torch.dtype, device: str):
        self.config, self._probe = config, torch.empty(0, dtype=dtype, device=device)

    def parameters(self):
        yield self._probe


def _packed(model, wanted: bool):
    """`bench --packed-experts`: the experts' weights packed for oneDNN beside the model's own
    (pack_experts refuses, before packing, a second copy that would not fit in free memory)."""
    import contextlib

    from ..routing.experts import pack_experts

    return pack_experts(model) if wanted else contextlib.nullcontext()


def cmd_bench(args) -> None:
    """Flags, device, plan (against the model's layout), budget and positions are all checked before
    the weights load or the synthetic model is built."""
    from ..calibrate.methods import allocate
    from ..core.plan import Plan
    from ..measure.bench import BenchConfig, benchmark, check_memory, distinct_plan_for, is_distinct_plan

    check_output_file(args.output, inputs=[*plan_inputs("--plan", args.plan), ("--model", args.model)])
    config = BenchConfig(input_len=args.input_len, output_len=args.output_len, sequences=args.sequences,
                         repeats=args.repeats, warmup=args.warmup)
    _bench_flags(args)
    synthetic = _check_synthetic_and_method(args)
    device, dtype = _bench_device(args)
    plan = Plan.load(args.plan) if args.plan else None
    spec, cfg = _bench_spec(args, synthetic)
    distinct = is_distinct_plan(plan) if plan is not None else args.max_distinct_experts is not None
    check_memory(_Shape(spec.config, dtype, device), config,                 # before building or loading
                 caches=3 + distinct + (plan is not None and plan.means is not None))
    max_distinct = _check_bench_against_model(args, spec, plan)
    torch.set_grad_enabled(False)
    model = _bench_model(args, spec, cfg, synthetic, device, dtype)
    union = None
    if plan is None and args.budget is not None:
        plan = allocate(args.budget, args.method, model=model, config={"k_base": args.k_base})
    elif plan is None:
        plan, union = distinct_plan_for(model, config, *max_distinct)
    with _packed(model, args.packed_experts):
        result = benchmark(model, plan, config, synthetic=synthetic, progress=not args.quiet)
    if union is not None:
        result["unrestricted_union"] = {"fraction": max_distinct[0], "per_layer": {str(i): u for i, u in union.items()},
                                        "measured_on": "other random prompts (seed 1), same batch and decode steps"}
    emit(result, args.output)
    _say_bench(result)


def _bench_flags(args) -> None:
    """What to time, given once (--plan, --budget or --max-distinct-experts), and only the flags that run
    reads; fills in --method and --k-base."""
    from .calibrate import refuse_unread

    given = [flag for flag, value in (("--plan", args.plan), ("--budget", args.budget),
                                      ("--max-distinct-experts", args.max_distinct_experts)) if value is not None]
    if len(given) != 1:
        were = f"{' and '.join(given)} were {'both' if len(given) == 2 else 'all'} given" if given else "nothing to time"
        raise AllocMoeError(f"{were}; give "
                            "one of --plan PLAN.json, --budget B (with --method) or --max-distinct-experts M")
    if args.seq_len is not None:
        raise AllocMoeError("--seq-len does not apply to bench; the prompt length is --input-len")
    method = "alloc-t" if args.method is None else args.method
    reads = {"--method"} if args.budget is not None else set()
    reads |= {"--k-base"} if args.budget is not None and method == "alloc-t" else set()
    refuse_unread({"--method": args.method, "--k-base": args.k_base}, reads, BENCH_READERS,
                  given[0] + (f" --method {method}" if args.budget is not None else ""))
    args.method, args.k_base = method, 1 if args.k_base is None else args.k_base


def _check_synthetic_and_method(args) -> bool:
    """Whether --model names a synthetic model; --num-layers only for one, --budget only with a method
    that needs neither a profile nor calibration."""
    from ..calibrate.methods import METHODS
    from ..measure.synthetic import PREFIX

    synthetic = str(args.model or "").startswith(PREFIX)
    if args.num_layers is not None and not synthetic:
        raise AllocMoeError(f"--num-layers applies only to synthetic models ({PREFIX}NAME); drop it or bench "
                            "a synthetic model")
    if args.budget is not None and args.method not in BENCH_METHODS:
        if args.method not in METHODS:
            raise AllocMoeError(f"unknown method {args.method!r}; with --budget choose one of "
                                f"{', '.join(BENCH_METHODS)}")
        raise AllocMoeError(f"--budget with --method {args.method!r} needs a profile or calibration; make a "
                            "plan with `allocmoe allocate` and pass --plan (speed depends on the budget, "
                            "not on which layers get it: alloc-t times the same work as alloc-moe)")
    return synthetic


def _bench_device(args) -> tuple[str, torch.dtype]:
    """--device (default: cuda if available) and --dtype (float32 on CPU, bfloat16 on CUDA), checked."""
    from ..models import check_device

    device = str(check_device(args.device if args.device is not None else
                              ("cuda" if torch.cuda.is_available() else "cpu")))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if args.packed_experts and (device != "cpu" or dtype != torch.float32):
        raise AllocMoeError("--packed-experts serves the CPU kernel in float32; drop it, or bench with --device cpu "
                            "--dtype float32")
    return device, dtype


def _bench_spec(args, synthetic: bool):
    """(the model's spec, the synthetic config or None): what is benched, before any weights exist."""
    from ..measure.synthetic import synthetic_config
    from ..models import ModelSpec

    if synthetic:
        cfg = synthetic_config(args.model, args.num_layers)
        return ModelSpec(path=args.model, config=cfg), cfg
    return inspect(args), None


def _check_bench_against_model(args, spec, plan) -> tuple[float | None, int | None] | None:
    """The positions against the model's context; the plan against its layout, or the budget (and
    k_base) against its shape; returns the parsed --max-distinct-experts when that is what is timed."""
    from ..core.budget import Budget
    from ..measure.bench import parse_max_distinct
    from ..routing.layout import check_plan

    positions = args.input_len + args.output_len
    if spec.context is not None and positions > spec.context:
        raise AllocMoeError(f"--input-len {args.input_len} + --output-len {args.output_len} = {positions} positions, "
                            f"past this model's context of {spec.context}; lower --input-len or --output-len")
    fingerprint = spec.fingerprint()
    if plan is not None:
        check_plan(plan, spec.skeleton())
    elif args.budget is not None:
        Budget.parse(args.budget, fingerprint["num_moe_layers"], fingerprint["k_orig"])
        if args.method == "alloc-t":
            from ..calibrate.methods import check_k_base

            check_k_base(args.k_base, "alloc-t", fingerprint["k_orig"], args.budget, spec.skeleton(), None)
    else:
        return parse_max_distinct(args.max_distinct_experts, fingerprint["num_experts"])
    return None


def _bench_model(args, spec, cfg, synthetic: bool, device: str, dtype: torch.dtype):
    """The model to time: the synthetic one built (refused first if its weights would not fit), or loaded."""
    from ..core.memory import check_free_memory
    from ..measure.synthetic import build_synthetic, parameter_bytes

    if not synthetic:
        return spec.load(dtype=dtype, device=device)[0]
    need = parameter_bytes(cfg, dtype)
    if device == "cpu":
        check_free_memory(need, torch.device("cpu"), f"{args.model} with {cfg.num_hidden_layers} layers",
                          "pass a smaller --num-layers", detail=" of weights")
    return build_synthetic(args.model, args.num_layers, dtype=dtype, device=device)


def _say_bench(result: dict) -> None:
    """The decode table and the speedups, on stderr."""
    from ..measure.bench import format_table

    print(format_table(result), file=sys.stderr)
    print(f"prefill {result['prefill_speedup']:.3f}x (ideal {result['prefill_ideal_speedup']:.3f}x), "
          f"decode {result['decode_speedup']:.3f}x (ideal {result['decode_ideal_speedup']:.3f}x) "
          f"at {result['measured_activations_per_token']:.2f} of "
          f"{result['model']['num_moe_layers'] * result['model']['k_orig']} activations/token", file=sys.stderr)
    stated = result["plan"].get("cost")
    if stated is not None:
        print(f"the plan's stated cost: {stated['total']:.4g} per token = {stated['activations']:.4g} activations + "
              f"{stated['standins']:.3g} in stand-ins (B = {result['plan']['budget']:g}); measured "
              f"{result['measured_cost_per_token']:.4g}", file=sys.stderr)
    if "substitute_cost" in result:
        cost = result["substitute_cost"]
        ranks = sorted(set(cost["decode"].get("ranks", {}).values())) or [cost["decode"]["rank"]]
        print(f"substitute (rank {'/'.join(map(str, ranks))}): prefill {cost['prefill']['ratio']:.3f}x, decode "
              f"{cost['decode']['ratio']:.3f}x the time of the same plan without it", file=sys.stderr)
