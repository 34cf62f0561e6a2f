"""What every command shares: the parser class, flag groups, deprecated aliases, JSON output.

One vocabulary across commands, as in vLLM and lm-eval: `--output` is what a command writes,
`--calib-tokens` the calibration tokens, `--eval-tokens` the scored tokens, `--quiet` turns progress
bars off. Old spellings stay as aliases that warn once; prefixes are never expanded (`--out` is
refused, not read as `--output`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
from pathlib import Path

from ..core.files import kind_of, path_stat, shown_path
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


BUILTIN_FILES = Path(__file__).resolve().parent.parent / "builtin"    # the built-in model, texts and tasks
Inputs = "dict[str, str | None] | list[tuple[str, str | None]]"


def check_output_file(path: str | None, flag: str = "--output", inputs: Inputs = (), writes: tuple = ()) -> None:
    """Refuse, before any work, an output file that could not be written at the end, or that would
    destroy something: an empty path or one the system cannot take (too long), an existing folder,
    device, FIFO or socket (only an absent or regular file is ever replaced), a read-only file or
    folder, a folder that does not exist, and any of the command's `inputs` (flag -> path; a plan's
    means file counts, see `plan_inputs`), through any link or hard link. `writes` are the other
    files the command writes beside it (a plan's means file, a `.partial.json`), checked the same way."""
    if path is None:
        return
    if str(path).endswith(("/", os.sep)):
        raise AllocMoeError(f"{flag} {shown_path(path)} ends with a slash, a folder; give a file path")
    _check_output_path(path, f"{flag} {shown_path(path)}", inputs)
    for other in writes:
        _check_output_path(other, f"{flag} {shown_path(path)} also writes {shown_path(other)}, which", inputs)


def check_output_dir(path: str | None, flag: str = "--output", inputs: Inputs = (), names: tuple = ()) -> None:
    """Refuse, before any work, an output folder that is a file (or a device, FIFO, socket) or lies
    under one, an empty path, an input folder (--model), or one whose files `names` (what the command
    writes into it) would replace one of the command's `inputs` or are not regular files."""
    if path is None:
        return
    st = path_stat(path, flag)
    target, said = Path(path), f"{flag} {shown_path(path)}"
    if len(os.fsencode(target.name)) > 200:     # its files are first written to a hidden temporary folder beside it
        raise AllocMoeError(f"{said}: the folder name is {len(os.fsencode(target.name))} bytes long, more than the "
                            "200 allocmoe can write beside; give a shorter name")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        kind = "a file" if stat.S_ISREG(st.st_mode) else kind_of(st.st_mode)
        raise AllocMoeError(f"{said} is {kind}; give a folder path")
    _refuse_under_a_file(target, said)
    for name, given in [*_pairs(inputs), ("allocmoe's built-in files", str(BUILTIN_FILES))]:
        if given and os.path.isdir(given) and _same(target, given):
            raise AllocMoeError(f"{said} is also an input folder ({name} {shown_path(given)}); give another folder")
    if st is not None:
        _check_folder_writable(target, said)
        for name in names:
            _check_output_path(str(target / name), f"{said} would replace {name} in it, which", inputs)


def plan_inputs(flag: str, plan: str | None) -> list[tuple[str, str | None]]:
    """A plan input and its means file (named in the plan, else the default name beside it), so an
    output can be refused for either; read only if the plan is a regular file, errors left for loading."""
    if not plan or plan.startswith("builtin:"):
        return [(flag, plan)]
    from ..core.means import sidecar_name

    found = [(flag, plan), (f"{flag}'s means file", str(Path(plan).parent / sidecar_name(plan)))]
    try:
        if os.path.isfile(plan) and os.path.getsize(plan) < 1 << 20:
            with open(plan, "rb") as f:
                named = json.loads(f.read()).get("substitute", {}).get("means_file")
            if isinstance(named, str) and named and "/" not in named and "\\" not in named:
                found.append((f"{flag}'s means file", str(Path(plan).parent / named)))
    except Exception:                  # any problem with the plan is the loader's to report, in its words
        pass
    return found


def _pairs(inputs: Inputs) -> list[tuple[str, str | None]]:
    return list(inputs.items()) if isinstance(inputs, dict) else list(inputs)


def _same(a, b) -> bool:
    """Whether two paths name one file: the same inode (hard links, links, bind mounts) or, for a path
    that does not exist yet, the same resolved path."""
    try:
        if os.path.samefile(a, b):
            return True
    except (OSError, ValueError):
        pass
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


def _check_output_path(path: str, said: str, inputs: Inputs) -> None:
    """`said` begins every refusal: "--output X" (then "is ..."), or what names the file in question."""
    st = path_stat(path, said.split(" ", 1)[0])
    target = Path(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise AllocMoeError(f"{said} is a folder; give a file path")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise AllocMoeError(f"{said} is {kind_of(st.st_mode)}, not a regular file; give the path of a new or "
                            "regular file")
    for name, given in [*_pairs(inputs), ("allocmoe's built-in files", str(BUILTIN_FILES))]:
        if not given or str(given).startswith(("builtin:", "synthetic:")):
            continue
        if _same(path, given):
            raise AllocMoeError(f"{said} is also an input ({name} {shown_path(given)}): writing it would destroy "
                                "the input; give another output path")
        if st is not None and os.path.isdir(given) and _inside(path, given):
            raise AllocMoeError(f"{said} is a file inside an input folder ({name} {shown_path(given)}): writing "
                                "it would change the input; give a path outside it")
    _refuse_under_a_file(target, said)
    if path_stat(target.parent, said.split(" ", 1)[0]) is None:
        raise AllocMoeError(f"{said}: the folder {shown_path(target.parent)} does not exist; create it or choose "
                            "another path")
    _check_folder_writable(target.parent, said)
    if st is not None and not os.access(path, os.W_OK):
        raise AllocMoeError(f"{said} is read-only; make it writable or choose another path")


def _inside(path, folder) -> bool:
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    except (OSError, ValueError):
        return False


def _check_folder_writable(folder: Path, said: str) -> None:
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AllocMoeError(f"{said}: the folder {shown_path(folder)} is not writable; choose another path")


def _refuse_under_a_file(target: Path, said: str) -> None:
    """The nearest existing folder above `target` must be a folder, not a regular file."""
    parent = next((p for p in target.parents if _exists(p)), None)
    if parent is not None and not parent.is_dir():
        raise AllocMoeError(f"{said} lies under {shown_path(parent)}, which is a file; choose another path")


def _exists(path: Path) -> bool:
    try:
        os.stat(path)
        return True
    except (OSError, ValueError):
        return False


def add_alias(p, old: str, new: str, dest: str, type=None) -> None:
    p.add_argument(old, dest=dest, action=Deprecated, new=new, type=type, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)


def add_model_flags(p, batch_size: int = 4, batch_help: str = "windows per forward pass") -> None:
    p.add_argument("--model", default=None, help="local Hugging Face model folder (default: the built-in model)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model folder's own Python code")
    p.add_argument("--batch-size", type=positive_int, default=batch_size, help=f"{batch_help} (default {batch_size})")
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


def inspect(args):
    """Check `--model` without reading its weights (config, architecture, weight files): a ModelSpec
    whose `skeleton()` plans, profiles, budgets and `--seq-len` are checked against before loading."""
    from ..models import inspect_model

    return inspect_model(args.model, trust_remote_code=args.trust_remote_code)


def load(args, spec=None):
    """Load `--model` (or the already inspected `spec`): (model, tokenizer)."""
    from ..models import load_model

    return load_model(spec if spec is not None else args.model, trust_remote_code=args.trust_remote_code)


def check_seq_len(spec, seq_len: int | None) -> int:
    """The window length `--seq-len` gives on this model, refused past its context (the library's rule)."""
    from ..measure.evaluate.perplexity import window_len

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
