"""Command line: a thin shell over the Python API, one public call per subcommand.

    allocmoe profile  [--model M] [--calib-text F] [--seq-len N] [--max-tokens N] --output PROFILE.json
    allocmoe allocate [--model M] [--profile P] [--calib-text F] --budget B --method NAME [--k-base N] --output PLAN.json
    allocmoe eval     [--model M] [--plan P] [--text F] [--output-json FILE]
    allocmoe sweep    [--model M] [--calib-text F] [--text F] [--budgets ...] [--methods ...] [--output-dir DIR]
    allocmoe bench    [--model M|synthetic:NAME] [--plan P | --budget B --method NAME] ...
    allocmoe generate [--model M] [--plan P] (--prompt TEXT | --prompt-file F) [--max-new-tokens N] [--chat]
    allocmoe serve    [--model M] [--plan NAME=P ...] [--profile P] [--host 127.0.0.1] [--port 8000] ...
    allocmoe export   --format vllm|vllm-global|sglang|llama.cpp [--plan P] [--request-plan NAME=P ...] [--model M]

Bad input prints one line, `allocmoe: error: ...`, and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import AllocMoeError
from .texts import OFFLINE_TASKS


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face model folder (default: the built-in model)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model folder's own Python code")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward pass (default 4)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: min(2048, model limit))")


def _add_tasks(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks (needs allocmoe[eval]); offline: "
                   + ",".join(OFFLINE_TASKS))
    p.add_argument("--num-fewshot", type=int, default=None, help="lm-eval few-shot examples")
    p.add_argument("--limit", type=int, default=None, help="lm-eval: at most N examples per task")
    p.add_argument("--include-path", default=None, help="folder of extra lm-eval task YAMLs")


def _load(args):
    from .models import load_model

    return load_model(args.model, trust_remote_code=args.trust_remote_code)


def _emit(obj, path: str | None, shown: dict | None = None) -> None:
    """Write `obj` to `path` (atomically) if given; print `shown` (default: all of `obj`)."""
    from .io_utils import atomic_write_json

    if path:
        atomic_write_json(path, obj)
        print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(obj if shown is None else shown, indent=2))


def cmd_profile(args) -> None:
    from .profile import ProfileConfig, profile_sensitivity
    from .texts import read_text

    text, name = read_text(args.calib_text, "calibration")
    config = ProfileConfig(seq_len=args.seq_len, max_tokens=args.max_tokens, batch_size=args.batch_size)
    model, tok = _load(args)
    profile = profile_sensitivity(model, tok, text, config, output=args.output, calib_name=name)
    print(f"wrote {args.output}: {profile['num_layers']} layers x k=1..{profile['k_orig']}", file=sys.stderr)


def cmd_allocate(args) -> None:
    from .methods import MODEL_METHODS, PROFILE_METHODS, AllocateConfig, allocate
    from .profile import ProfileConfig, load_profile, profile_sensitivity
    from .texts import read_text

    config = AllocateConfig(k_base=args.k_base, pool=args.pool, calib_max_tokens=args.max_tokens,
                            seq_len=args.seq_len, batch_size=args.batch_size)
    model = tok = None
    needs_model = args.method in MODEL_METHODS or args.profile is None
    if needs_model:
        model, tok = _load(args)
    profile = load_profile(args.profile, model) if args.profile else None
    text = None
    if args.method in MODEL_METHODS + PROFILE_METHODS:
        text, name = read_text(args.calib_text, "calibration")
        if profile is None and args.method in PROFILE_METHODS + ("auto",):
            print("no --profile given: profiling first (save one with `allocmoe profile` to reuse it)", file=sys.stderr)
            profile = profile_sensitivity(model, tok, text, ProfileConfig(
                seq_len=args.seq_len, max_tokens=args.max_tokens, batch_size=args.batch_size), calib_name=name)
    plan = allocate(args.budget, args.method, profile=profile, model=model, tokenizer=tok, calib_text=text,
                    config=config)
    plan.save(args.output)
    ks = ", ".join(f"{i}:{p.k:g}" if p.k is not None else f"{i}:{p.name}" for i, p in sorted(plan.layers.items()))
    print(f"wrote {args.output}: {plan.method} at B={plan.budget:g} of {plan.full_budget}; k per layer {ks}",
          file=sys.stderr)


def cmd_eval(args) -> None:
    from .api import evaluate_model

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    result = evaluate_model(args.model, plan=args.plan, text=args.text, seq_len=args.seq_len,
                            max_tokens=args.max_tokens, batch_size=args.batch_size,
                            trust_remote_code=args.trust_remote_code, tasks=tasks,
                            task_options={"num_fewshot": args.num_fewshot, "limit": args.limit,
                                          "include_path": args.include_path})
    # per-item scores (thousands of 0/1 values) go to the file, for `allocmoe compare`; not to the screen
    shown = {key: value for key, value in result.items() if key != "task_items"}
    if tasks and not args.output_json:
        print("per-item scores, which `allocmoe compare` pairs up, are kept only with --output-json", file=sys.stderr)
    _emit(result, args.output_json, shown)


def cmd_sweep(args) -> None:
    from .profile import ProfileConfig, load_profile
    from .sweep import SweepConfig, sweep
    from .texts import read_text

    config = SweepConfig(
        budgets=tuple(b for b in args.budgets.split(",") if b.strip()),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        eval_max_tokens=args.max_tokens, seq_len=args.seq_len, batch_size=args.batch_size, k_base=args.k_base,
        profile=ProfileConfig(max_tokens=args.calib_max_tokens),
        tasks=tuple(t.strip() for t in (args.tasks or "").split(",") if t.strip()),
        task_limit=args.limit, num_fewshot=args.num_fewshot, include_path=args.include_path)
    calib, calib_name = read_text(args.calib_text, "calibration")
    text, text_name = read_text(args.text, "test")
    model, tok = _load(args)
    profile = load_profile(args.profile, model) if args.profile else None
    results = sweep(model, tok, calib, text, config, output_dir=args.output_dir, profile=profile,
                    text_names=(calib_name, text_name))
    from .report import markdown_table

    print(markdown_table(results))
    print(f"wrote {args.output_dir}/results.json, results.md, quality_vs_activations.png, allocations.png",
          file=sys.stderr)


def cmd_compare(args) -> None:
    from .evaluate.paired import compare_results, markdown
    from .io_utils import atomic_write_json, read_json

    a, b = read_json(args.a, "eval result"), read_json(args.b, "eval result")
    comparison = compare_results(a, b, args.metric, (args.a, args.b))
    print(markdown(comparison, (args.a, args.b), args.metric))
    skipped = sorted(set(a.get("task_items", {})) - set(comparison["tasks"]))
    if skipped:
        print(f"not compared (no per-item {args.metric}, or only in {args.a}): {', '.join(skipped)}", file=sys.stderr)
    if args.output_json:
        atomic_write_json(args.output_json, {"a": args.a, "b": args.b, "metric": args.metric, **comparison})
        print(f"wrote {args.output_json}", file=sys.stderr)


def cmd_analyze(args) -> None:
    from .analyze import analyze_plan, write_analysis
    from .evaluate.perplexity import default_seq_len, tokenize_windows
    from .plan import Plan
    from .texts import read_text

    text, _ = read_text(args.text, "test")
    model, tok = _load(args)
    plan = Plan.load(args.plan, model)
    windows = tokenize_windows(tok, text, args.seq_len or default_seq_len(model), args.max_tokens)
    result = analyze_plan(model, tok, plan, windows, args.batch_size)
    write_analysis(result, args.output_dir)
    print(json.dumps({k: v for k, v in result.items() if k != "per_layer"}, indent=2))
    print(f"wrote {args.output_dir}/analysis.json, analysis.png", file=sys.stderr)


def cmd_export(args) -> None:
    from .integrations.export import export_plan
    from .io_utils import atomic_write_bytes
    from .serve.plans import PLAN_NAME

    plans: dict[str | None, Path] = {}
    if args.plan:
        plans[None] = Path(args.plan)
    for value in args.request_plan:
        name, sep, path = value.partition("=")
        if not sep or not PLAN_NAME.match(name) or name == "default" or name in plans:
            raise AllocMoeError(f"--request-plan {value!r}: give NAME=PLAN.json with a new name of letters, "
                                "digits, '.', '_' or '-' (not 'default')")
        plans[name] = Path(path)
    for name, path in plans.items():
        if not path.is_file():
            raise AllocMoeError(f"plan file not found: {path}")
    if args.output and Path(args.output).is_dir():
        raise AllocMoeError(f"--output {args.output} is a folder; give a file name such as serve.sh")
    export = export_plan(args.format, plans, model=args.model, arch=args.arch)
    text = json.dumps(export.to_dict(), indent=2) + "\n" if args.json else "#!/usr/bin/env sh\n" + export.script()
    if args.output:
        atomic_write_bytes(args.output, text.encode())
        if not args.json:
            os.chmod(args.output, 0o755)
        print(f"wrote {args.output}", file=sys.stderr)
    sys.stdout.write(text)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .methods import METHODS

    parser = argparse.ArgumentParser(prog="allocmoe", description="Budget-aware expert activation for MoE models.")
    parser.add_argument("--version", action="version", version=f"allocmoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="allocation-isolating sensitivity profile (slow, resumable)")
    _add_model(p)
    p.add_argument("--calib-text", default=None, help="UTF-8 calibration text (default: built-in calibration split)")
    p.add_argument("--max-tokens", type=int, default=8192, help="calibration tokens per configuration (8192)")
    p.add_argument("--output", required=True, help="profile JSON to write")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("allocate", help="turn a budget (and a profile) into a plan")
    _add_model(p)
    p.add_argument("--profile", default=None, help="profile JSON (needed by alloc-moe, alloc-l, auto)")
    p.add_argument("--calib-text", default=None, help="calibration text for top-p, naee, auto, profiling")
    p.add_argument("--budget", required=True, help="fraction of full (0.5, 1/2, 50%%) or count (78)")
    p.add_argument("--method", default="auto", choices=METHODS, help="allocation method (default: auto)")
    p.add_argument("--k-base", type=int, default=1, help="Alloc-T: experts every token keeps (default 1)")
    p.add_argument("--pool", default="batch", choices=("batch", "sequence"), help="Alloc-T pool extent")
    p.add_argument("--max-tokens", type=int, default=8192, help="calibration tokens (8192)")
    p.add_argument("--output", required=True, help="plan JSON to write")
    p.set_defaults(func=cmd_allocate)

    p = sub.add_parser("eval", help="perplexity with or without a plan")
    _add_model(p)
    p.add_argument("--plan", default=None, help="plan JSON to apply (default: the unmodified model)")
    p.add_argument("--text", default=None, help="UTF-8 text to score (default: built-in test split)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--output-json", default=None, help="also write the result here")
    _add_tasks(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("sweep", help="budgets x methods table with plots (the main job)")
    _add_model(p)
    p.add_argument("--profile", default=None, help="reuse this profile instead of profiling")
    p.add_argument("--calib-text", default=None, help="calibration text (default: built-in calibration split)")
    p.add_argument("--text", default=None, help="evaluation text (default: built-in test split)")
    p.add_argument("--budgets", default="1/3,1/2,2/3,5/6", help="comma-separated budgets (default 1/3,1/2,2/3,5/6)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods (default: all)")
    p.add_argument("--k-base", type=int, default=1, help="Alloc-T k_base (default 1)")
    p.add_argument("--max-tokens", type=int, default=16384, help="evaluation tokens per row (16384)")
    p.add_argument("--calib-max-tokens", type=int, default=8192, help="calibration tokens (8192)")
    p.add_argument("--output-dir", default="allocmoe-sweep", help="folder for results (default allocmoe-sweep)")
    _add_tasks(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("compare", help="paired task-accuracy difference of two `eval --tasks` results")
    p.add_argument("a", help="eval JSON (from `allocmoe eval --tasks ... --output-json`)")
    p.add_argument("b", help="eval JSON of the same tasks, e.g. another plan")
    p.add_argument("--metric", default="acc", choices=("acc", "acc_norm"), help="per-item metric (acc)")
    p.add_argument("--output-json", default=None, help="also write the comparison here")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("analyze", help="experts vs routing entropy, expert load vs the unmodified model")
    _add_model(p)
    p.add_argument("--plan", required=True, help="plan JSON to analyse")
    p.add_argument("--text", default=None, help="UTF-8 text (default: built-in test split)")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens to route (16384)")
    p.add_argument("--output-dir", default="allocmoe-analysis", help="folder for analysis.json and analysis.png")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("export", help="the command line each serving engine needs for a plan")
    p.add_argument("--format", required=True, choices=["vllm", "vllm-global", "sglang", "llama.cpp"],
                   help="vllm: the allocmoe plugin; the others have one engine-wide k")
    p.add_argument("--plan", default=None, help="plan JSON every request gets")
    p.add_argument("--request-plan", action="append", default=[], metavar="NAME=PLAN.json",
                   help="vllm: a plan requests choose with vllm_xargs {\"allocmoe_plan\": NAME} (repeatable)")
    p.add_argument("--model", default="MODEL", help="the model path or id to put in the command (default MODEL)")
    p.add_argument("--arch", default=None, help="llama.cpp: the GGUF's general.architecture (default: from the plan)")
    p.add_argument("--output", default=None, help="also write the snippet (or JSON) to this file")
    p.add_argument("--json", action="store_true", help="print JSON: command, env, notes, global k, spend")
    p.set_defaults(func=cmd_export)

    from .bench import add_bench_parser

    add_bench_parser(sub, _add_model)
    from .serve.commands import add_generate_parser, add_serve_parser

    add_generate_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except AllocMoeError as exc:
        print(f"allocmoe: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("allocmoe: interrupted (a profile resumes from its .partial.json when rerun)", file=sys.stderr)
        sys.exit(130)
    except MemoryError:
        print("allocmoe: error: out of memory; lower --batch-size or --seq-len", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:        # output piped into `head` and the like: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
