"""`allocmoe export`: a plan as the command line of a serving engine (vLLM with the plugin, or an
engine with one engine-wide k). `generate` and `serve` live with the server, in `serve.commands`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import AllocMoeError
from .common import add_output


def add_parsers(sub) -> None:
    p = sub.add_parser("export", help="the command line each serving engine needs for a plan")
    p.add_argument("--format", required=True, choices=["vllm", "vllm-global", "sglang", "llama.cpp"],
                   help="vllm: the allocmoe plugin; the others have one engine-wide k")
    p.add_argument("--plan", default=None, help="plan JSON every request gets")
    p.add_argument("--request-plan", action="append", default=[], metavar="NAME=PLAN.json",
                   help="vllm: a plan requests choose with vllm_xargs {\"allocmoe_plan\": NAME} (repeatable)")
    p.add_argument("--model", default="MODEL", help="the model path or id to put in the command (default MODEL)")
    p.add_argument("--arch", default=None, help="llama.cpp: the GGUF's general.architecture (default: from the plan)")
    add_output(p, "also write the snippet (or JSON) to this file")
    p.add_argument("--json", action="store_true", help="print JSON: command, env, notes, global k, spend")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> None:
    from ..integrations.export import export_plan
    from ..io_utils import atomic_write_bytes
    from ..serve.plans import PLAN_NAME

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
