"""Command line: a thin shell over the Python API, one public call per subcommand.

    allocmoe profile  [--model M] [--calib-text F] [--seq-len N] [--calib-tokens N] --output PROFILE.json
    allocmoe allocate [--model M] [--profile P] [--calib-text F] --budget B --method NAME [--k-base N] --output PLAN.json
    allocmoe eval     [--model M] [--plan P] [--text F] [--output FILE]
    allocmoe sweep    [--model M] [--calib-text F] [--text F] [--budgets ...] [--methods ...] [--output DIR]
    allocmoe bench    [--model M|synthetic:NAME] [--plan P | --budget B --method NAME] ...
    allocmoe generate [--model M] [--plan P] (--prompt TEXT | --prompt-file F) [--max-new-tokens N] [--chat]
    allocmoe serve    [--model M] [--plan NAME=P ...] [--profile P] [--host 127.0.0.1] [--port 8000] ...
    allocmoe export   --format vllm|vllm-global|sglang|llama.cpp [--plan P] [--request-plan NAME=P ...] [--model M]

Exit codes: 0 success; 2 bad input (one line, `allocmoe: error: <what>; <how to fix it>`); 1 an
unexpected failure (one line; `--debug`, anywhere on the line, shows the traceback); 130 interrupted
(Ctrl-C or SIGTERM; a profile or sweep that kept work says what a rerun resumes).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from ..errors import AllocMoeError
from .common import Parser


def build_parser() -> Parser:
    from ..version import __version__
    from .serve import add_generate_parser, add_serve_parser
    from . import calibrate, deploy, measure

    parser = Parser(prog="allocmoe", description="Budget-aware expert activation for MoE models.")
    parser.add_argument("--version", action="version", version=f"allocmoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    calibrate.add_parsers(sub)
    measure.add_parsers(sub)
    add_generate_parser(sub)
    add_serve_parser(sub)
    deploy.add_parsers(sub)
    parser.commands = sub.choices       # name -> the command's parser
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv                # accepted anywhere, so it can be added to any failing line
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:     # refused by the command's own parser, so its usage and `--help` are the ones shown
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "quiet", False):     # no bars at all: transformers' "Loading weights" bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main_thread else None
    try:
        args.func(args)
    except AllocMoeError as exc:
        print(f"allocmoe: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        _close_bars()
        resume = getattr(exc, "resume", None)        # errors.Interrupted: what a rerun picks up
        print(f"allocmoe: interrupted; rerun the same command to resume: {resume}" if resume else
              "allocmoe: interrupted", file=sys.stderr)
        sys.exit(130)
    except MemoryError:
        print("allocmoe: error: out of memory; lower --windows-per-pass (bench: --sequences) or --seq-len", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:        # output piped into `head` and the like: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except Exception as exc:       # a bug, or a case not checked yet: one line, the traceback on request
        if debug:
            raise
        said = (str(exc).strip().splitlines() or [""])[0]       # one line, whatever the exception holds
        print(f"allocmoe: error: unexpected failure ({type(exc).__name__}: {said}); rerun with --debug for the "
              "traceback and report it", file=sys.stderr)
        sys.exit(1)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _close_bars() -> None:
    """Close every progress bar still open, so the interrupted line starts a line of its own. A bar
    whose `with` block unwound is closed already; one caught while it was being made (the interrupt
    landed inside tqdm's constructor, after its first frame) never entered its block."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        try:
            bar.close()
        except Exception:            # half-built: nothing more to close, and the message must still go out
            pass


def _interrupt(signum, frame):
    """SIGTERM (`kill`) unwinds like Ctrl-C, so every cleanup path runs and partial files go."""
    raise KeyboardInterrupt
