"""`allocmoe generate` and `allocmoe serve`: flags in, one call out (the CLI registers these).

Every flag is checked before the model loads: numbers, files, plan names, a free port.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from ..core.files import read_utf8
from ..errors import AllocMoeError

BUILTIN_NAME = "allocmoe-builtin"


def _add_model_flags(p) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face model folder (default: the built-in model)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model folder's own Python code")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file (default: the tokenizer's)")


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream text from the model under a plan; a summary line on stderr")
    _add_model_flags(p)
    p.add_argument("--plan", default=None, help="plan JSON to generate with (default: the unmodified model)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", default=None, help="the prompt text")
    source.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
    p.add_argument("--stop", action="append", default=[], help="stop before this string (repeatable)")
    p.add_argument("--chat", action="store_true", help="put the prompt through the chat template as a user turn")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> None:
    from ..models import inspect_model
    from ..core.plan import Plan
    from ..routing.layout import check_plan
    from ..serve.generate import generate
    from ..serve.prompts import read_chat_template
    from ..serve.sampling import SamplingParams

    SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed, stop=tuple(args.stop))          # refuse bad numbers before loading
    prompt = args.prompt if args.prompt is not None else read_utf8(args.prompt_file, "prompt file")
    if not prompt:
        raise AllocMoeError("the prompt is empty; give some text with --prompt or --prompt-file")
    template = read_chat_template(args.chat_template) if args.chat_template else None
    if template and not args.chat:
        raise AllocMoeError("--chat-template applies only with --chat; add --chat or drop the template")
    plan = Plan.load(args.plan) if args.plan else None
    spec = inspect_model(args.model, trust_remote_code=args.trust_remote_code)
    if plan is not None:
        check_plan(plan, spec.skeleton())           # a plan of another model, before the weights load
    model, tok = spec.load()
    stream = generate(model, tok, prompt, plan, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat, chat_template=template)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(stream.summary.line(), file=sys.stderr)


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server; each request may pick its own plan")
    _add_model_flags(p)
    p.add_argument("--plan", action="append", default=[], metavar="NAME=PLAN.json",
                   help="serve this plan as MODEL@NAME (repeatable; a bare PLAN.json is named by its file stem)")
    p.add_argument("--profile", default=None, help="profile JSON: lets requests ask for a budget, "
                   "allocated on the fly by the exact solver")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests per forward pass (default 8)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch (default 64); "
                   "more get 503 with Retry-After")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + new tokens at most "
                   "(default: the model's context)")
    p.add_argument("--api-key", default=os.environ.get("ALLOCMOE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ALLOCMOE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the folder's "
                   f"name; {BUILTIN_NAME} for the built-in model)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for the model (default: the "
                   "CPU count less one, leaving a core to the HTTP loop)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="a larger request body gets 413, "
                   "unread (default 4 MiB)")
    p.add_argument("--request-timeout", type=float, default=30.0, help="seconds a client has to send a "
                   "request's headers, and again its body; a slower one is cut off (408) (default 30)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, help="seconds an idle kept-alive "
                   "connection stays open (default 5)")
    p.add_argument("--max-connections", type=int, default=256, help="open connections at most; one more "
                   "gets 503 and is closed (default 256)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="on SIGTERM, seconds running "
                   "generations get to finish before they end with an error (default 10)")
    p.add_argument("--latency-target-ms", type=float, default=None, help="hold each decode step within this many "
                   "ms under load: requests that name no plan or budget step down a ladder of plans (full, then "
                   "5/6, 2/3, 1/2, 1/3 of the budget from --profile, or the --plan files by budget) as the batch "
                   "grows, chosen from the step times the server measures (default: off)")
    p.add_argument("--record-plans", action="store_true", help="return the plan each request ran under at each "
                   "forward pass, as usage.allocmoe.plans ([plan, passes], the prefill pass first)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> None:
    try:
        import uvicorn  # noqa: F401

        from ..serve.app import ServerConfig, create_app
        from ..serve.http import HTTPLimits, run
    except ImportError as exc:
        raise AllocMoeError(f"allocmoe serve needs the serve extra ({exc.name} is missing): "
                            "pip install 'allocmoe[serve]'") from None
    from ..models import inspect_model
    from ..core.plan import PLAN_NAME, Plan
    from ..routing.layout import check_plan
    from ..calibrate.methods import allocate
    from ..calibrate.profile import load_profile
    from ..serve.prompts import read_chat_template

    for name, value in (("--max-batch-size", args.max_batch_size), ("--num-threads", args.num_threads),
                        ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            raise AllocMoeError(f"{name} must be >= 1, got {value}; give 1 or more")
    for name, value in (("--max-request-bytes", args.max_request_bytes),
                        ("--max-connections", args.max_connections)):
        if value < 1:
            raise AllocMoeError(f"{name} must be >= 1, got {value}; give 1 or more")
    for name, value in (("--request-timeout", args.request_timeout), ("--timeout-keep-alive", args.timeout_keep_alive),
                        ("--shutdown-timeout", args.shutdown_timeout)):
        if not value > 0 or value == float("inf"):
            raise AllocMoeError(f"{name} must be a number of seconds above 0, got {value}; give e.g. 10")
    if args.max_queue < 0:
        raise AllocMoeError(f"--max-queue must be >= 0, got {args.max_queue}; give 0 or more")
    target = args.latency_target_ms
    if target is not None and (not target > 0 or target == float("inf")):
        raise AllocMoeError(f"--latency-target-ms must be a number of milliseconds above 0, got {target:g}; give e.g. 50")
    if target is not None and not args.profile and not args.plan:
        raise AllocMoeError("--latency-target-ms needs a ladder of plans: give --profile PROFILE.json (full, 5/6, 2/3, "
                            "1/2 and 1/3 of the budget are allocated from it) or the plans as --plan NAME=FILE")
    if args.api_key is not None and not args.api_key.strip():
        raise AllocMoeError("--api-key is empty; give a key or leave the flag out")
    plan_files = _plan_files(args.plan, PLAN_NAME)
    template = read_chat_template(args.chat_template) if args.chat_template else None
    plans = {name: Plan.load(path) for name, path in plan_files.items()}
    spec = inspect_model(args.model, trust_remote_code=args.trust_remote_code)
    skeleton = spec.skeleton()              # plans, profile and lengths checked before the weights load
    for plan in plans.values():
        check_plan(plan, skeleton)
    profile = load_profile(args.profile, skeleton) if args.profile else None
    if args.max_model_len is not None and spec.context is not None and not 2 <= args.max_model_len <= spec.context:
        raise AllocMoeError(f"max model len {args.max_model_len} must lie between 2 and the model's context of "
                            f"{spec.context} tokens; give --max-model-len {spec.context} or less")
    _check_port_free(args.host, args.port)  # last: a free port is checked as late as it can be
    _set_threads(args.num_threads)
    model, tok = spec.load()
    name = args.served_model_name or (BUILTIN_NAME if args.model in (None, "builtin") else Path(args.model).resolve().name)
    config = ServerConfig(model_name=name, plans=plans, profile=profile, max_batch_size=args.max_batch_size,
                          max_queue=args.max_queue, api_key=args.api_key, chat_template=template,
                          max_model_len=args.max_model_len, allocate=allocate, latency_target_ms=target,
                          record_plans=args.record_plans,
                          limits=HTTPLimits(max_request_bytes=args.max_request_bytes,
                                            request_timeout=args.request_timeout,
                                            timeout_keep_alive=args.timeout_keep_alive,
                                            max_connections=args.max_connections,
                                            shutdown_timeout=args.shutdown_timeout))
    app = create_app(model, tok, config)
    ids = ", ".join([name] + [f"{name}@{n}" for n in plans])
    print(f"allocmoe: serving {ids} on http://{args.host}:{args.port}/v1"
          f"{' (budgets on request: --profile given)' if profile else ''}", file=sys.stderr)
    if app.state.server.elastic is not None:
        ladder = ", ".join(f"{r.name} ({r.activations:g})" for r in app.state.server.elastic.rungs)
        print(f"allocmoe: elastic: decode steps held within {target:g} ms; ladder {ladder}", file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"allocmoe: warning: listening on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    run(app, args.host, args.port, config.limits, args.log_level)


def _set_threads(num_threads: int | None) -> None:
    """Torch's threads busy-wait between ops; on a machine whose every core they hold, the HTTP loop
    and the engine starve each other (measured: 2 cores, 8 clients, 165 tok/s with 2 threads against
    391 with 1), so by default one core is left to the server's own Python."""
    import torch

    torch.set_num_threads(num_threads or max(1, (os.cpu_count() or 2) - 1))


def _plan_files(values: list[str], pattern) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = Path(value).stem, value
        if not pattern.match(name):
            raise AllocMoeError(f"--plan {value!r}: the name {name!r} must be letters, digits, '.', '_' or '-'; "
                                "give NAME=PLAN.json")
        if name in files:
            raise AllocMoeError(f"two plans are named {name!r}; give each --plan NAME=FILE its own name")
        if not Path(path).is_file():
            raise AllocMoeError(f"--plan {value!r}: plan file not found: {path}; check the path")
        files[name] = Path(path)
    return files


def _check_port_free(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise AllocMoeError(f"--host {host!r} is not an address of this machine; give one, e.g. 127.0.0.1 "
                            "(this machine only) or 0.0.0.0 (every interface)") from None
    if not 1 <= port <= 65535:
        raise AllocMoeError(f"--port must lie between 1 and 65535, got {port}; give a port in that range")
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address[0], port, *address[2:]))
        except OSError as exc:
            raise AllocMoeError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port "
                                "or stop what holds it") from None
