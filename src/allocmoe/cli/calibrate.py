"""`allocmoe profile` and `allocmoe allocate`: making a plan (slow profile, fast pure allocation)."""

from __future__ import annotations

import argparse
import sys

from ..core.outputs import check_output_file
from ..errors import AllocMoeError
from .common import (add_calib_tokens, add_prefix_cache, add_model_flags, add_quiet, add_ray_flags, output_companions,
                     check_seq_len, inspect, load, non_negative_int, positive_int)


def add_parsers(sub) -> None:
    from ..calibrate.methods import METHODS

    p = sub.add_parser("profile", help="allocation-isolating sensitivity profile (slow, resumable)")
    add_model_flags(p)
    p.add_argument("--calib-text", default=None, help="UTF-8 calibration text (default: built-in calibration split)")
    add_calib_tokens(p, 8192)
    p.add_argument("--output", required=True, help="profile JSON to write")
    add_prefix_cache(p)
    p.add_argument("--max-memory", default=None, metavar="SIZE", help="for a model bigger than memory, e.g. 300MiB: "
                   "weights, states and working memory stay under it, the model read layer by layer (see docs/profiling.md)")
    add_ray_flags(p, "fan the cells out")
    add_quiet(p)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("allocate",
                       help="turn a budget, a perplexity target or a latency budget (and a profile) into a plan")
    add_model_flags(p)
    p.add_argument("--profile", default=None, help="profile JSON (needed by alloc-moe, alloc-l, auto)")
    p.add_argument("--calib-text", default=None, help="calibration text for top-p, naee, auto, profiling")
    p.add_argument("--budget", default=None, help="fraction of full (0.5, 1/2, 50%%) or count (78) of activations per token; with stand-ins "
                   "(--substitute, auto) it bounds activations plus their activation-equivalents")
    p.add_argument("--target-ppl", default=None, metavar="TARGET",
                   help="instead of --budget: the smallest total budget whose plan stays within this calibration "
                        "perplexity (with stand-ins, on the windows they were not fitted on), relative to the "
                        "full model (5%%) or absolute (157.0)")
    p.add_argument("--method", default=None, choices=METHODS, help="allocation method (default: auto)")
    p.add_argument("--k-base", type=positive_int, default=None, help="Alloc-T: experts every token keeps (default 1)")
    p.add_argument("--pool", default=None, choices=("batch", "sequence"), help="Alloc-T pool extent (default: batch)")
    _add_substitute_flags(p)
    p.add_argument("--refine", type=non_negative_int, default=None, metavar="PASSES",
                   help="refine the allocation with at most this many calibration passes, resumable (0 = off; "
                        "default: 128 for auto, 0 for the other methods)")
    p.add_argument("--max-distinct-experts", default=None, metavar="M",
                   help="instead of --budget, a latency budget for batched decoding: distinct experts each decode "
                        "step loads, summed over the MoE layers and split across them by the exact solver from a "
                        "profile measured at --decode-batch; a fraction of the unrestricted union on calibration "
                        "text (0.5, 1/2, 50%%) or an average count per layer (e.g. 16); see docs/methods.md")
    p.add_argument("--decode-batch", type=positive_int, default=None, metavar="B",
                   help="with --max-distinct-experts: sequences decoded side by side, the step the budget bounds "
                        "(default 16; replaces --windows-per-pass)")
    p.add_argument("--k-floor", type=positive_int, default=None,
                   help="with --max-distinct-experts: each token's top experts chosen first (default 1)")
    p.add_argument("--m-step", type=positive_int, default=None, metavar="N",
                   help="with --max-distinct-experts: profile every N-th expert count, linear in between "
                        "(default 1: every count; larger is N times cheaper)")
    add_calib_tokens(p, 8192)
    p.add_argument("--output", required=True, help="plan JSON to write")
    add_prefix_cache(p)
    add_quiet(p)
    # None: not given (the defaults are filled in by cmd_allocate), so a flag the run would not read is refused
    p.set_defaults(func=cmd_allocate, windows_per_pass=None, calib_tokens=None, prefix_cache=None)


# -- which flags a run reads ------------------------------------------------------------------------------
# `allocate`'s optional flags that only some runs read, by what reads them. A flag given to a run that
# would not read it is refused (issue 39: no flag is ignored without a word), naming who reads it.
ALLOCATE_READERS = {
    "--profile": ("the profile methods", "alloc-moe, alloc-l and auto allocate from a profile"),
    "--k-base": ("Alloc-T", "only alloc-moe, alloc-t and auto run Alloc-T, whose tokens each keep k_base experts"),
    "--pool": ("Alloc-T", "only alloc-moe, alloc-t and auto run Alloc-T, whose pool it sets"),
    "--calib-text": ("calibration", "only top-p, naee, auto, --target-ppl, --substitute, --refine and profiling "
                     "(alloc-moe or alloc-l without --profile) read calibration text"),
    "--calib-tokens": ("calibration", "only top-p, naee, auto, --target-ppl, --substitute, --refine and profiling "
                       "(alloc-moe or alloc-l without --profile) read calibration text"),
    "--seq-len": ("calibration", "only top-p, naee, auto, --target-ppl, --substitute, --refine and profiling "
                  "(alloc-moe or alloc-l without --profile) run the model on text"),
    "--windows-per-pass": ("calibration", "only top-p, naee, auto, --target-ppl, --substitute, --refine and profiling "
                     "(alloc-moe or alloc-l without --profile) run the model on text"),
    "--no-prefix-cache": ("profiling", "only profiling (alloc-moe, alloc-l or auto without --profile) reads it"),
}


def _add_substitute_flags(p) -> None:
    """allocate's flags for the stand-ins of skipped experts (the substitute)."""
    from ..calibrate.methods import STANDIN_FITS

    p.add_argument("--substitute", action=argparse.BooleanOptionalAction, default=None,
                   help="add back a stand-in for each skipped expert: its calibrated mean output plus a rank-R "
                        "linear term (saved beside the plan as <name>.means.safetensors; allocmoe "
                        "serve/generate/eval/bench and the vLLM plugin run it, engine-wide export formats "
                        "do not); "
                        "default: auto tries with and without, other methods without")
    p.add_argument("--substitute-rank", type=non_negative_int, default=None, metavar="R",
                   help="with the substitute: rank of the least-squares linear term beside each skipped expert's "
                        "mean (default 8; 0: the means alone, as MoNE)")
    p.add_argument("--rank-menu", action="store_const", const=True, default=None,
                   help="auto: its (k, stand-in) DP also offers each layer stand-in ranks 0, R/2 and 2R besides R "
                        "(off by default: over the 20 quality cells it lost on test text; docs/quality.md)")
    p.add_argument("--standin-fit", default=None, choices=STANDIN_FITS,
                   help="with the substitute: how the plan's stand-ins are fitted for shipping, once every choice "
                        "is made: skipped, on the slots the plan skips, weighted by gate^2, on the inputs the plan "
                        "gives each layer (default); routed, on every token routed to the expert, the full model's "
                        "inputs (the fit before; docs/quality.md)")


def allocate_reads(method: str, *, profile_given: bool, calibrates: bool, profiles: bool) -> set[str]:
    """The flags of ALLOCATE_READERS that an `allocate` run of `method` reads."""
    from ..calibrate.methods import K_BASE_METHODS, PROFILE_METHODS

    read = {"the profile methods": method in PROFILE_METHODS + ("auto",), "Alloc-T": method in K_BASE_METHODS,
            "calibration": calibrates, "profiling": profiles}
    return {flag for flag, (reader, _) in ALLOCATE_READERS.items() if read[reader]}


def refuse_unread(given: dict[str, object], reads: set[str], readers: dict[str, tuple[str, str]], run: str) -> None:
    """Refuse the first flag in `given` (flag -> value, None when not given) that the run does not read."""
    for flag, value in given.items():
        if value is not None and flag in readers and flag not in reads:
            raise AllocMoeError(f"{flag} does not apply to {run}: {readers[flag][1]}; drop {flag}")


def cmd_profile(args) -> None:
    from ..calibrate.profile import ProfileConfig, profile_sensitivity
    from ..texts import read_text

    check_output_file(args.output, inputs={"--calib-text": args.calib_text, "--model": args.model},
                      writes=(f"{args.output}.partial.json",))
    text, name = read_text(args.calib_text, "calibration")
    config = ProfileConfig(seq_len=args.seq_len, calib_tokens=args.calib_tokens, windows_per_pass=args.windows_per_pass,
                           progress=not args.quiet, prefix_cache=args.prefix_cache, max_memory=args.max_memory,
                           ray=args.ray, ray_workers=args.ray_workers)
    spec = inspect(args)
    check_calibration(spec, text, args.seq_len, args.calib_tokens, args.windows_per_pass)
    folder = config.max_memory is not None or config.ray is not None     # loaded by the walk or the workers
    model, tok = (spec, spec.tokenizer()) if folder else load(args, spec)
    profile = profile_sensitivity(model, tok, text, config, output=args.output, calib_name=name)
    print(f"wrote {args.output}: {profile['num_layers']} layers x k=1..{profile['k_orig']}", file=sys.stderr)


def check_calibration(spec, text: str, seq_len: int | None, calib_tokens: int, windows_per_pass: int,
                      field: str = "calib_tokens") -> None:
    """The library's checks of a calibration run, before the weights load: the text long enough for a
    window, --calib-tokens no more than the text has (8192, the default, reads as "up to") and
    --windows-per-pass no more windows than the text gives."""
    from ..scoring.perplexity import check_batch_size, tokenize_windows

    windows = tokenize_windows(spec.tokenizer(), text, check_seq_len(spec, seq_len), calib_tokens,
                               beyond=None if calib_tokens == 8192 else f"{field} (--calib-tokens)")
    check_batch_size(windows, windows_per_pass)


def cmd_allocate(args) -> None:
    """Everything is checked before the weights load (the profile against the model's layout, even when
    the method never loads them; the budget; the calibration text), then the weights load only for the
    runs that need them (weights_reason: the methods that run the model, or profile first): the others
    read config.json alone, so a folder without weights is refused only for those that need them."""
    from ..calibrate.methods import allocate
    from ..calibrate.profile import ProfileConfig, profile_sensitivity
    from ..texts import read_text

    check_output_file(args.output, inputs={"--profile": args.profile, "--calib-text": args.calib_text,
                      "--model": args.model}, writes=output_companions(args.output))
    if args.max_distinct_experts is not None:
        return _allocate_distinct(args)
    given = _allocate_flags(args)
    config = _allocate_config(args)
    run = _AllocateRun(args, config, given)
    text = name = None
    if run.calibrates or args.calib_text is not None:
        text, name = read_text(args.calib_text, "calibration")
    if run.calibrates:
        check_calibration(run.spec, text, args.seq_len, args.calib_tokens, args.windows_per_pass)
    model, tok = run.skeleton, None
    if run.needs_weights is not None:
        model, tok = load(args, run.spec)
    profile = run.profile
    if run.profiles_first:
        print("no --profile given: profiling first (save one with `allocmoe profile` to reuse it)", file=sys.stderr)
        profile = profile_sensitivity(model, tok, text, ProfileConfig(
            seq_len=args.seq_len, calib_tokens=args.calib_tokens, windows_per_pass=args.windows_per_pass,
            progress=not args.quiet, prefix_cache=args.prefix_cache), calib_name=name)
    memo = _refine_memo(args, config, run, profile, name)
    plan = allocate(args.budget, args.method, profile=profile, model=model, tokenizer=tok,
                    calib_text=text if run.calibrates else None, config=config, target_ppl=args.target_ppl,
                    refine_memo=memo)
    plan.save(args.output)
    if memo is not None:
        memo.finish()
    _say_plan(args, plan)


def _allocate_flags(args) -> dict[str, object]:
    """allocate's flags on their own, before the model is looked at: no latency-budget flag without
    --max-distinct-experts, one of --budget and --target-ppl (in its form). Returns the optional flags
    as given (None when not), for refuse_unread, and fills in the defaults of those not given."""
    from ..calibrate.target import parse_target

    for flag, value in (("--decode-batch", args.decode_batch), ("--k-floor", args.k_floor), ("--m-step", args.m_step)):
        if value is not None:
            raise AllocMoeError(f"{flag} applies only with --max-distinct-experts; give --max-distinct-experts M "
                                f"for a latency budget, or drop {flag}")
    if (args.budget is None) == (args.target_ppl is None):
        said = "both --budget and --target-ppl were given" if args.budget else "no --budget was given"
        raise AllocMoeError(f"{said}; give --budget B (e.g. 0.5) or --target-ppl T (e.g. 5%), one of the two "
                            "(or --max-distinct-experts M for a latency budget)")
    if args.target_ppl is not None:
        parse_target(args.target_ppl, 1.0)           # its form, before any work; its value needs the model
    given = {"--profile": args.profile, "--k-base": args.k_base, "--pool": args.pool, "--calib-text": args.calib_text,
             "--calib-tokens": args.calib_tokens, "--seq-len": args.seq_len,
             "--windows-per-pass": args.windows_per_pass, "--no-prefix-cache": args.prefix_cache}
    args.method = args.method or "auto"
    args.k_base = 1 if args.k_base is None else args.k_base
    args.pool = args.pool or "batch"
    args.calib_tokens = 8192 if args.calib_tokens is None else args.calib_tokens
    args.windows_per_pass = 4 if args.windows_per_pass is None else args.windows_per_pass
    args.prefix_cache = args.prefix_cache is not False
    return given


def _allocate_config(args):
    """The AllocateConfig the flags give (checked as the library checks it), and the add-on flags'
    agreement with the method."""
    from ..calibrate.methods import ADDON_METHODS, AllocateConfig, addons

    config = AllocateConfig(k_base=args.k_base, pool=args.pool, calib_tokens=args.calib_tokens,
                            seq_len=args.seq_len, windows_per_pass=args.windows_per_pass, progress=not args.quiet,
                            substitute=args.substitute, refine=args.refine,
                            **({} if args.substitute_rank is None else {"substitute_rank": args.substitute_rank}),
                            **({} if args.standin_fit is None else {"standin_fit": args.standin_fit}),
                            **({} if args.rank_menu is None else {"rank_menu": True}))
    substitute, refine = addons(args.method, config)
    if args.rank_menu and (args.method != "auto" or args.substitute is not None):
        raise AllocMoeError("--rank-menu applies to auto's (k, stand-in) menu, which runs with --method auto and the "
                            "substitute left to auto; drop --rank-menu, or --substitute/--no-substitute")
    for flag, value in (("--substitute-rank", args.substitute_rank), ("--standin-fit", args.standin_fit)):
        if value is not None and not substitute:
            raise AllocMoeError(f"{flag} applies to the substitute, which --method {args.method} runs without "
                                f"here; add --substitute, or drop {flag}")
    if (substitute or refine) and args.method not in ADDON_METHODS:
        raise AllocMoeError(f"--method {args.method} cannot take --substitute or --refine (they need a budget-exact "
                            f"top-k allocation); use one of {', '.join(ADDON_METHODS)}, or drop those flags")
    return config


class _AllocateRun:
    """An allocate run checked against the model folder before any weights load: whether it needs the
    weights, the profile (checked against the model's layout), the budget or target, --seq-len, the
    flags it would not read, k_base; what it does (calibrates, profiles first)."""

    def __init__(self, args, config, given: dict[str, object]):
        from ..calibrate.methods import K_BASE_METHODS, PROFILE_METHODS, addons, check_k_base, weights_reason
        from ..calibrate.profile import load_profile
        from ..core.budget import Budget

        substitute, self.refine = addons(args.method, config)
        self.spec = spec = inspect(args, require_weights=False)
        self.needs_weights = weights_reason(args.method, profile_given=args.profile is not None,
                                            target_ppl=args.target_ppl, substitute=substitute, refine=self.refine)
        self.skeleton = skeleton = self._check_weights(spec, config, substitute)
        self.profile = profile = load_profile(args.profile, skeleton) if args.profile else None
        self.fingerprint = fingerprint = spec.fingerprint()
        if args.budget is not None:
            Budget.parse(args.budget, fingerprint["num_moe_layers"], fingerprint["k_orig"])
        else:
            from ..calibrate.target import check_target_reach

            check_target_reach(args.target_ppl, getattr(skeleton.config, "vocab_size", None))
        self.seq_len = check_seq_len(spec, args.seq_len)
        self.profiles_first = profile is None and args.method in PROFILE_METHODS + ("auto",)
        self.calibrates = (self.profiles_first or args.method in ("top-p", "naee", "auto")
                           or args.target_ppl is not None or substitute or self.refine)
        refuse_unread(given, allocate_reads(args.method, profile_given=profile is not None,
                                            calibrates=self.calibrates, profiles=self.profiles_first),
                      ALLOCATE_READERS, f"--method {args.method}" + (" with --target-ppl" if args.target_ppl else ""))
        if args.method in K_BASE_METHODS:
            check_k_base(args.k_base, args.method, fingerprint["k_orig"], args.budget, skeleton, profile)

    def _check_weights(self, spec, config, substitute: bool):
        """The folder's skeleton, once a run needing weights is known to have them and the substitute's
        rank and fit are known to suit the model."""
        from ..calibrate.methods import weightless_message

        if self.needs_weights is not None and not spec.has_weights:
            raise AllocMoeError(weightless_message(spec.path, self.needs_weights))
        skeleton = spec.skeleton()
        if substitute and config.substitute_rank > skeleton.config.hidden_size:
            raise AllocMoeError(f"--substitute-rank {config.substitute_rank} is above this model's hidden size "
                                f"{skeleton.config.hidden_size}; give {skeleton.config.hidden_size} or less")
        if substitute:
            from ..calibrate.means import check_fit_memory

            check_fit_memory(spec.fingerprint()["num_experts"], skeleton.config.hidden_size, config.substitute_rank)
        return skeleton


def _refine_memo(args, config, run: _AllocateRun, profile, name):
    """The refinement's resume file (<output>.refine.partial.json), keyed by what its scores depend on;
    None when nothing is refined (or a target search runs, which refines afresh per budget)."""
    from ..calibrate.crossfit import SPLIT
    from ..calibrate.methods import addons
    from ..calibrate.refine import SavedScores

    if not run.refine or args.target_ppl is not None:
        return None
    # with stand-ins the moves are scored cross-fitted (calibrate/crossfit.py): a partial file from
    # before, scored another way, has another (or no) "scored_on" and is not resumed from
    scored_on = SPLIT if addons(args.method, config)[0] else "all calibration windows"
    return SavedScores(f"{args.output}.refine.partial.json", {"scored_on": scored_on,
        "model": run.fingerprint, "method": args.method, "budget": args.budget, "k_base": args.k_base,
        "pool": args.pool, "substitute": args.substitute, "substitute_rank": config.substitute_rank,
        "calibration": name, "calib_tokens": args.calib_tokens, "seq_len": run.seq_len,
        "profile": profile["sensitivity"] if profile else None})


def _say_plan(args, plan) -> None:
    """The lines on stderr that say what was written (and, for a target, what budget met it)."""
    ks = ", ".join(f"{i}:{p.k:g}" if p.k is not None else f"{i}:{p.name}" for i, p in sorted(plan.layers.items()))
    print(f"wrote {args.output}: {plan.method} at B={plan.budget:g} of {plan.full_budget}; k per layer {ks}; "
          f"{plan.cost_text()}", file=sys.stderr)
    if args.target_ppl is not None:
        found = plan.provenance["target"]
        print(f"target {found['perplexity']:.4g} (full model {found['full_calibration_perplexity']:.4g}): the "
              f"smallest total budget meeting it is {found['budget_found']}, calibration perplexity "
              f"{found['calibration_perplexity']:.4g} on {found.get('judged_on', 'calibration text')}; `allocmoe eval --plan {args.output}` gives the test figure",
              file=sys.stderr)


def _allocate_distinct(args) -> None:
    """`allocate --max-distinct-experts M`: everything checked before the weights load (the flags that
    do not apply, the budget's form, --k-floor against the model's K, the calibration text's length
    and windows at the decode batch), then the unrestricted union, the distinct profile (resumable
    from <output>.distinct.partial.json) and the exact allocation."""
    from ..calibrate.distinct import (DistinctConfig, allocate_distinct, check_k_floor, distinct_windows,
                                      parse_distinct_budget)
    from ..calibrate.methods import weightless_message
    from ..texts import read_text

    for flag in ("--budget", "--target-ppl"):
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise AllocMoeError(f"both {flag} and --max-distinct-experts were given; give one: {flag} for activations "
                                "per token, --max-distinct-experts for distinct experts per decode step")
    for flag, value in (("--method", args.method), ("--profile", args.profile), ("--k-base", args.k_base),
                        ("--pool", args.pool), ("--substitute", args.substitute),
                        ("--substitute-rank", args.substitute_rank), ("--standin-fit", args.standin_fit),
                        ("--rank-menu", args.rank_menu), ("--refine", args.refine),
                        ("--windows-per-pass", args.windows_per_pass)):
        if value is not None:
            raise AllocMoeError(f"{flag} does not apply with --max-distinct-experts (its plan caps distinct experts "
                                f"per step, from its own profile measured at --decode-batch, which replaces "
                                f"--windows-per-pass); drop {flag}")
    config = DistinctConfig(decode_batch=args.decode_batch or 16, k_floor=args.k_floor or 1,
                            calib_tokens=8192 if args.calib_tokens is None else args.calib_tokens,
                            seq_len=args.seq_len, m_step=args.m_step or 1,
                            prefix_cache=args.prefix_cache is not False, progress=not args.quiet)
    spec = inspect(args, require_weights=False)
    if not spec.has_weights:
        raise AllocMoeError(weightless_message(spec.path, "a latency budget (--max-distinct-experts) measures "
                                               "distinct experts on calibration text"))
    fingerprint = spec.fingerprint()
    parse_distinct_budget(args.max_distinct_experts, fingerprint["num_experts"], fingerprint["num_moe_layers"])
    check_k_floor(config.k_floor, fingerprint["k_orig"])
    text, name = read_text(args.calib_text, "calibration")
    distinct_windows(spec.skeleton(), spec.tokenizer(), text, config)
    model, tok = load(args, spec)
    plan = allocate_distinct(args.max_distinct_experts, model=model, tokenizer=tok, calib_text=text, config=config,
                             resume_file=f"{args.output}.distinct.partial.json", calib_name=name)
    plan.save(args.output)
    details = plan.provenance["details"]
    ms = " ".join(f"{i}:{p.max_experts}" for i, p in sorted(plan.layers.items()))
    print(f"wrote {args.output}: at most M_l distinct experts per decode step at batch {details['decode_batch']}, "
          f"{details['allocated']} of {details['total']} allowed in all (unrestricted: "
          f"{sum(details['union_mean']):.1f} on average); M per layer {ms}; `allocmoe eval --plan {args.output} "
          f"--decode-batch {details['decode_batch']}` measures it", file=sys.stderr)
