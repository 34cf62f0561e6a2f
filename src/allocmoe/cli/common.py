"""What every command shares: the parser class, flag groups, deprecated aliases, JSON output.

One vocabulary across commands, as in vLLM and lm-eval: `--output` is what a command writes,
`--calib-tokens` the calibration tokens, `--eval-tokens` the scored tokens, `--windows-per-pass` the
windows of text in one forward pass (profile, allocate, eval, sweep, analyze), `--sequences` the
sequences bench decodes side by side, `--quiet` turns progress bars off. Old spellings (`--batch-size`,
`--max-tokens`, ...) stay as aliases that warn and say in --help that they are deprecated; prefixes are never expanded (`--out` is
refused, not read as `--output`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ..core.outputs import plan_inputs
from ..errors import AllocMoeError
from ..texts import OFFLINE_TASKS


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching: a typo must not silently become another flag.
    Subparsers inherit the class, so every command gets the same rule."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """argparse's one line, with the fix every refusal states: where the flags are listed."""
        super().error(f"{message}; see `{self.prog} --help`")


class Deprecated(argparse.Action):
    """An old flag spelling: stores into the new flag's dest and prints one warning line."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"allocmoe: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def positive_int(text: str) -> int:
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    return _whole(text, 0)


def _whole(text: str, least: int) -> int:
    """ASCII digits only: int() would also take "1_0", " 4 " and "٤" (an Arabic-Indic four)."""
    try:
        if not re.fullmatch(r"-?[0-9]{1,30}", text, re.ASCII):
            raise ValueError(text)
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {'at least 0' if least == 0 else 'above 0'}, got {value}")
    return value


def add_alias(p, old: str, new: str, dest: str, type=None, metavar: str | None = None) -> None:
    """`old`, the deprecated spelling of `new`: still taken (a warning line when used), shown in --help as such."""
    p.add_argument(old, dest=dest, action=Deprecated, new=new, type=type, default=argparse.SUPPRESS,
                   metavar=metavar, help=f"deprecated; use {new}")


def add_model_flags(p, batch_size: int = 4, batch_help: str = "windows per forward pass",
                    batch_flag: str = "--windows-per-pass") -> None:
    """--model, --trust-remote-code, --seq-len and the batch flag (`--windows-per-pass`, or bench's
    `--sequences`), with `--batch-size` its deprecated alias."""
    p.add_argument("--model", default=None, help="local Hugging Face model folder (default: the built-in model)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model folder's own Python code")
    dest = batch_flag.lstrip("-").replace("-", "_")
    p.add_argument(batch_flag, dest=dest, type=positive_int, default=batch_size, metavar="N",
                   help=f"{batch_help} (default {batch_size})")
    add_alias(p, "--batch-size", batch_flag, dest, type=positive_int, metavar="N")
    p.add_argument("--seq-len", type=positive_int, default=None, help="window length (default: min(2048, model limit))")


def add_task_flags(p) -> None:
    p.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks (needs allocmoe[eval]); offline: "
                   + ",".join(OFFLINE_TASKS))
    p.add_argument("--num-fewshot", type=non_negative_int, default=None, help="lm-eval few-shot examples")
    p.add_argument("--limit", type=positive_int, default=None, help="lm-eval: at most N examples per task")
    p.add_argument("--include-path", default=None, help="folder of extra lm-eval task YAMLs")


def add_output(p, help: str, old: str | None = None, **kwargs) -> None:
    """`--output` (what the command writes), with the command's old spelling as a warning alias."""
    p.add_argument("--output", dest="output", help=help, **kwargs)
    if old:
        add_alias(p, old, "--output", "output")


def add_calib_tokens(p, default: int, old: str = "--max-tokens") -> None:
    p.add_argument("--calib-tokens", dest="calib_tokens", type=positive_int, default=default,
                   help=f"calibration tokens ({default})")
    add_alias(p, old, "--calib-tokens", "calib_tokens", type=positive_int)


def add_eval_tokens(p, default: int | None, help: str) -> None:
    p.add_argument("--eval-tokens", dest="eval_tokens", type=positive_int, default=default, help=help)
    add_alias(p, "--max-tokens", "--eval-tokens", "eval_tokens", type=positive_int)


def add_prefix_cache(p) -> None:
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="profile: run every cell as a full pass (the naive protocol: same numbers, about twice "
                        "the work; for checking)")


def add_ray_flags(p, what: str) -> None:
    """`--ray [ADDRESS]` and `--ray-workers N`: `what` runs on Ray actors that each load the model once."""
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS", help=f"{what} on Ray actors "
                   "(needs allocmoe[ray]): no value starts a local instance, 'auto' joins RAY_ADDRESS's")
    p.add_argument("--ray-workers", type=positive_int, default=None, metavar="N", help="with --ray: actors, each "
                   "holding the model (default: one per CPU of the cluster)")


def add_quiet(p) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars (they go to stderr)")


def inspect(args, require_weights: bool = True):
    """Check `--model` without reading its weights (config, architecture, weight files): a ModelSpec
    whose `skeleton()` plans, profiles, budgets and `--seq-len` are checked against before loading.
    `require_weights` False accepts a folder of config.json alone (its spec's has_weights is False)."""
    from ..models import inspect_model

    return inspect_model(args.model, trust_remote_code=args.trust_remote_code, require_weights=require_weights)


def load(args, spec=None):
    """Load `--model` (or the already inspected `spec`): (model, tokenizer)."""
    from ..models import load_model

    return load_model(spec if spec is not None else args.model, trust_remote_code=args.trust_remote_code)


def check_seq_len(spec, seq_len: int | None) -> int:
    """The window length `--seq-len` gives on this model, refused past its context (the library's rule)."""
    from ..scoring.perplexity import window_len

    return window_len(spec.skeleton(), seq_len)


def task_names(args) -> list[str] | None:
    """`--tasks` as a list (None when not given); the lm-eval flags are refused without it."""
    from ..measure.evaluate.harness import check_task_options

    names = None
    if args.tasks is not None:
        names = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if not names:
            raise AllocMoeError(f"--tasks {args.tasks!r} names no task; give comma-separated task names, "
                                f"e.g. {OFFLINE_TASKS[0]}")
    check_task_options(names, num_fewshot=args.num_fewshot, limit=args.limit, include_path=args.include_path)
    return names


def emit(obj, path: str | None, shown: dict | None = None) -> None:
    """Write `obj` to `path` (atomically) if given; print `shown` (default: all of `obj`)."""
    from ..core.files import atomic_write_json

    if path:
        atomic_write_json(path, obj)
        print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(obj if shown is None else shown, indent=2))


def output_companions(output: str | None) -> tuple[str, ...]:
    """The files `allocate --output PLAN` may write beside the plan: its means file and its resume files."""
    if not output:
        return ()
    from ..core.means import sidecar_name

    return (str(Path(output).parent / sidecar_name(output)), f"{output}.refine.partial.json",
            f"{output}.distinct.partial.json")


def named_plan_inputs(values: list[str], flag: str = "--request-plan") -> list[tuple[str, str | None]]:
    """`NAME=PLAN.json` values as plan inputs (their means files too); malformed ones are the parser's to refuse."""
    return [pair for value in values or () if "=" in value for pair in plan_inputs(flag, value.split("=", 1)[1])]


def sweep_inputs(args) -> list[tuple[str, str | None]]:
    return [("--profile", args.profile), ("--calib-text", args.calib_text), ("--text", args.text),
            ("--model", args.model), ("--include-path", args.include_path)]


def sweep_names(profile: str | None) -> tuple[str, ...]:
    """What `sweep` writes into its folder (its own profile only when none is given)."""
    names = ("results.json", "plans.json", "results.md", "quality_vs_activations.png", "allocations.png")
    return names if profile else names + ("profile.json", "profile.json.partial.json")
