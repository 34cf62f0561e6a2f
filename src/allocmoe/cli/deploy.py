"""`allocmoe export`: a plan as the command line of a serving engine (vLLM with the plugin, or an
engine with one engine-wide k). `generate` and `serve` are in cli/serve.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import AllocMoeError
from ..core.outputs import check_output_file, plan_inputs
from .common import add_output, named_plan_inputs


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
    from ..integrations.vllm_plugin import parse_named_plans
    from ..core.files import atomic_write_bytes

    check_output_file(args.output, inputs=[*plan_inputs("--plan", args.plan), *named_plan_inputs(args.request_plan)])
    if not args.model.strip():
        raise AllocMoeError("--model is empty; give the model path or id the engine should serve")
    if args.arch is not None and args.format != "llama.cpp":
        raise AllocMoeError(f"--arch applies only to --format llama.cpp; drop it for {args.format}")
    if args.arch is not None and not args.arch.strip():
        raise AllocMoeError("--arch is empty; give the GGUF's general.architecture, or leave it out to take it "
                            "from the plan")
    plans: dict[str | None, Path] = {None: Path(args.plan)} if args.plan else {}
    plans.update(parse_named_plans(args.request_plan, "--request-plan"))
    export = export_plan(args.format, plans, model=args.model, arch=args.arch)
    text = json.dumps(export.to_dict(), indent=2) + "\n" if args.json else "#!/usr/bin/env sh\n" + export.script()
    if args.output:
        atomic_write_bytes(args.output, text.encode())
        if not args.json:
            os.chmod(args.output, 0o755)
        print(f"wrote {args.output}", file=sys.stderr)
    sys.stdout.write(text)
