"""Write docs/cli.md, the reference of every `allocmoe` command and flag, from the real parser.

    python scripts/cli_reference.py            # rewrite docs/cli.md
    python scripts/cli_reference.py --check    # exit 1 if docs/cli.md is out of date

tests/test_readme.py compares docs/cli.md with `render()`, so a flag added to the parser without
rerunning this script fails the tests.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from allocmoe.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "cli.md"

INTRO = """\
# Command-line reference

Every `allocmoe` command and flag, with its default. This page is generated from the parser by
`python scripts/cli_reference.py`; the tests fail when it is out of date. For a tour, see the
[README](../README.md#five-minute-tour); for serving, [serve.md](serve.md) and [vllm.md](vllm.md).

## Rules every command follows

- **Exit codes**: `0` success; `2` bad input (a budget of 0 or above full, a corrupt file, a plan or
  profile made for another model, an unsupported architecture, text that is too short, an output
  path that cannot be written, a flag that does not exist), stated on one line,
  `allocmoe: error: <what>; <how to fix it>`, before any work; `1` an unexpected failure, also one
  line; `130` interrupted (Ctrl-C or `kill`; a profile resumes from its `.partial.json` when rerun).
- **`--debug`**, anywhere on the line, shows the traceback of an unexpected failure (exit `1`); add it
  to the failing command and include the output when you report the failure.
- **One vocabulary**: `--output` is what a command writes, `--calib-tokens` how much calibration
  text it reads, `--eval-tokens` how much text it scores, `--windows-per-pass` how many windows of
  text go through the model in one forward pass (profile, allocate, eval, sweep, analyze),
  `--sequences` how many sequences `bench` decodes side by side, `--quiet` hides the progress bars of
  the long commands (bars and messages go to stderr, results to stdout). The Python configs use the
  same names (`calib_tokens`, `eval_tokens`, `windows_per_pass`, `sequences`).
- **No abbreviations**: a flag must be spelled out in full (`--out` is refused, not read as
  `--output`), so a typo cannot silently become another flag.
- **No flag is ignored**: a flag the run would not read is refused, naming what reads it
  (`--pool` or `--calib-tokens` with `allocate --method uniform`, `--k-base` with `bench --plan`,
  `--windows-per-pass` with `eval --decode-batch`, `--no-prefix-cache` when nothing is profiled). A
  default shown blank below means "not given"; the help text says what is used then.
- **Values the input cannot hold are refused**, before any pass: `--k-base` above the model's K (or,
  for `alloc-t`, above the experts each layer gets at the budget), `--windows-per-pass` above the windows
  the text gives, `--calib-tokens`/`--eval-tokens` above the tokens the text has (the default 8192
  reads as "up to"), a `--target-ppl` above 100 x the vocabulary size, a text holding NUL or other control
  characters, a model whose config's top-k is outside 1..its experts, and a shard index naming a
  file outside the model folder.
- **Deprecated spellings** still work, print one warning line
  (`allocmoe: warning: --output-json is deprecated; use --output`) and say so in `--help`:
  `--output-json` and `--output-dir` (now `--output`), `--max-tokens` (now `--calib-tokens` or
  `--eval-tokens`, by command), `--calib-max-tokens` (now `--calib-tokens`) and `--batch-size` (now
  `--windows-per-pass`, or `--sequences` for `bench`). Each command below lists its own.
- **Outputs never destroy anything**: before any work, `--output` is refused when it is empty, a name
  the system cannot take (too long), a device, FIFO or socket (only an absent or regular file is
  replaced; a folder output must be absent or a folder), read-only, or one of the command's inputs
  through any link or hard link (`allocate --profile P --output P`, `eval --plan P --output P`, the
  plan's means file, `--text`/`--calib-text`, a file inside `--model`). Files are written to a
  temporary file and renamed into place: never half-written. Input files must be regular files (a
  FIFO is refused, never waited on).
- **Budgets** (`--budget`, `--max-distinct-experts`, a request's budget) are read in the documented
  ASCII forms only: a fraction of full `0.5`, `.5`, `1/2`, `50%`, or a count `78` (`78.0`, `7.8e1`);
  no spaces, no `_`, no other digits (`1_0`, `50 %`, `١` are refused).
- **Required** flags say so in the default column; `(--a A | --b B)` in a usage line means exactly
  one of the two.
- `allocmoe --version` prints the version; `allocmoe COMMAND --help` prints the flags below.
"""


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, whitespace collapsed."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    default = action.default
    if default is None or default == argparse.SUPPRESS or default is False or default == []:
        return ""
    if default is True:
        return "on"
    return f"`{default}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text as `--help` prints it, plus the choices where the text does not name them all."""
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    if action.choices is not None and not all(str(c) in text for c in action.choices):
        choices = ", ".join(f"`{c}`" for c in action.choices)
        text = f"{text} (one of {choices})" if text else f"one of {choices}"
    return text


def _invocation(action: argparse.Action) -> str:
    """`--flag VALUE` (choices are listed in the help column instead of argparse's {a,b,c})."""
    if not action.option_strings:
        return action.metavar or action.dest
    flags = ", ".join(action.option_strings)
    return flags if action.nargs == 0 else f"{flags} {action.metavar or action.dest.upper().replace('_', '-')}"


def _subcommands(parser: argparse.ArgumentParser):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    return [(name, helps.get(name, ""), sp) for name, sp in sub.choices.items()]


def render() -> str:
    """docs/cli.md as the current parser would have it."""
    parser = build_parser()
    wide = functools.partial(argparse.HelpFormatter, width=1_000_000)   # usage on one line, whatever the terminal
    out = [INTRO]
    commands = _subcommands(parser)
    out.append("## Commands\n")
    out.append("| command | what it does |\n|---|---|")
    for name, help_line, _ in commands:
        out.append(f"| [`{name}`](#allocmoe-{name}) | {_cell(help_line)} |")
    out.append("")
    for name, help_line, sp in commands:
        out.append(f"## `allocmoe {name}`\n")
        out.append(f"{help_line[:1].upper()}{help_line[1:]}.\n")
        sp.formatter_class = wide
        usage = " ".join(sp.format_usage().split())
        out.append(f"```text\n{usage}\n```\n")
        shown = [a for a in sp._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
                 and not hasattr(a, "new")]                     # deprecated spellings: listed after the table
        positionals = [a for a in shown if not a.option_strings]
        options = [a for a in shown if a.option_strings]
        if positionals:
            out.append("| argument | what it is |\n|---|---|")
            for action in positionals:
                out.append(f"| `{_invocation(action)}` | {_cell(_help(sp, action))} |")
            out.append("")
        if options:
            out.append("| flag | default | what it does |\n|---|---|---|")
            for action in options:
                out.append(f"| `{_invocation(action)}` | {_default(action)} | {_cell(_help(sp, action))} |")
            out.append("")
        aliases = [a for a in sp._actions if hasattr(a, "new") and a.option_strings]
        if aliases:
            listed = ", ".join(f"`{a.option_strings[0]}` (use `{getattr(a, 'new', '?')}`)" for a in aliases)
            out.append(f"Deprecated, still accepted with a warning: {listed}.\n")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--check", action="store_true", help="only check that docs/cli.md is up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date; run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
