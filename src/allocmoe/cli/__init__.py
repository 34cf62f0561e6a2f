"""Command line: a thin shell over the Python API, one public call per subcommand.

    allocmoe profile  [--model M] [--calib-text F] [--seq-len N] [--calib-tokens N] --output PROFILE.json
    allocmoe allocate [--model M] [--profile P] [--calib-text F] --budget B --method NAME [--k-base N] --output PLAN.json
    allocmoe eval     [--model M] [--plan P] [--text F] [--output FILE]
    allocmoe sweep    [--model M] [--calib-text F] [--text F] [--budgets ...] [--methods ...] [--output DIR]
    allocmoe bench    [--model M|synthetic:NAME] [--plan P | --budget B --method NAME] ...
    allocmoe generate [--model M] [--plan P] (--prompt TEXT | --prompt-file F) [--max-new-tokens N] [--chat]
    allocmoe serve    [--model M] [--plan NAME=P ...] [--profile P] [--host 127.0.0.1] [--port 8000] ...
    allocmoe export   --format vllm|vllm-global|sglang|llama.cpp [--plan P] [--request-plan NAME=P ...] [--model M]

Bad input prints one line, `allocmoe: error: ...`, and exits 2.
"""

from __future__ import annotations

import os
import sys

from ..errors import AllocMoeError
from .common import Parser


def build_parser() -> Parser:
    from .. import __version__
    from ..serve.commands import add_generate_parser, add_serve_parser
    from . import calibrate, deploy, measure

    parser = Parser(prog="allocmoe", description="Budget-aware expert activation for MoE models.")
    parser.add_argument("--version", action="version", version=f"allocmoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    calibrate.add_parsers(sub)
    measure.add_parsers(sub)
    add_generate_parser(sub)
    add_serve_parser(sub)
    deploy.add_parsers(sub)
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

