"""Every `allocmoe` command line the README and docs show names a command and flags that exist
(read from the real parser, so a renamed flag cannot linger in the docs)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from allocmoe.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def command_lines(path: Path) -> list[str]:
    """`allocmoe ...` lines inside fenced shell blocks (continuation lines joined) and inline code."""
    lines, block, inside = [], [], False
    source = path.read_text()
    lines += [m.group(1) for m in re.finditer(r"`allocmoe ([a-z]+(?: [^`]*)?)`", source)]
    for line in source.splitlines():
        if line.startswith("```"):
            inside = not inside and line.strip() in ("```bash", "```sh", "```shell")
            continue
        if inside:
            block.append(line)
    text = re.sub(r"\\\n\s*", " ", "\n".join(block))
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        match = re.search(r"(?:^|&& |\| )allocmoe (\S+)(.*)", line)
        if match:
            lines.append(f"{match.group(1)}{match.group(2)}")
    return lines


def options_of(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    if command not in sub.choices:
        return set()
    return {s for action in sub.choices[command]._actions for s in action.option_strings
            if action.help != "==SUPPRESS=="}


CASES = [(path.name, line) for path in DOCS for line in command_lines(path)]


def test_the_docs_show_commands_at_all():
    assert len(CASES) >= 20 and {"README.md", "vllm.md", "serve.md"} <= {name for name, _ in CASES}


@pytest.mark.parametrize("doc,line", CASES, ids=[f"{d}:{l[:40]}" for d, l in CASES])
def test_every_command_and_flag_shown_exists(doc, line):
    words = line.replace("$", "X").replace("...", "").split() if line.count('"') % 2 else \
        shlex.split(line.replace("$", "X"), comments=False)
    command, flags = words[0], [w.split("=")[0] for w in words[1:] if w.startswith("--")]
    if command in ("-h", "--help", "--version"):
        return
    known = options_of(command)
    assert known, f"{doc}: `allocmoe {command}` is not a command"
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{doc}: `allocmoe {command}` has no {', '.join(unknown)} (or only as a deprecated alias)"
