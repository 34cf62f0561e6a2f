"""The README stays a front door and the docs stay true to the code: the README is short and shows
the sweep's picture, every relative link in README.md and docs/*.md resolves, docs/cli.md is what
scripts/cli_reference.py makes from the current parser (so a new flag cannot go undocumented), and
every `allocmoe COMMAND` the README shows has a working `--help`."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from allocmoe.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PICTURE = "docs/sweep/quality_vs_activations.png"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _without_code(text: str) -> str:
    """Markdown with fenced blocks and inline code removed (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _links(path: Path) -> list[str]:
    return LINK.findall(_without_code(path.read_text()))


def test_readme_is_short_and_shows_the_sweep():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; keep it at most 250 and move detail to docs/"
    images = [m.group(1) for m in re.finditer(r"!\[[^\]]*\]\(([^)\s]+)\)", _without_code(README.read_text()))]
    assert PICTURE in images, f"README.md should show {PICTURE} as an image"
    assert (ROOT / PICTURE).is_file()


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_every_relative_link_resolves(doc):
    broken = []
    for target in _links(doc):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue                                   # http(s):, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path) if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)} has broken links: {', '.join(broken)}"


def test_cli_reference_is_up_to_date():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = (ROOT / "docs" / "cli.md").read_text()
    assert current == module.render(), "docs/cli.md is out of date; run python scripts/cli_reference.py"


def _readme_commands() -> list[str]:
    """Each distinct `allocmoe COMMAND` in the README's fenced code blocks."""
    blocks = re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    lines = [line.split(" #")[0] for line in "\n".join(blocks).splitlines()]    # not in comments
    found = re.findall(r"(?:^|[\s&|;(])allocmoe ([a-z][a-z-]*)\b", "\n".join(lines), flags=re.M)
    return sorted(set(found))


def test_readme_shows_the_cli():
    assert {"profile", "allocate", "eval", "generate", "serve", "export"} <= set(_readme_commands())


@pytest.mark.parametrize("command", _readme_commands())
def test_every_command_in_the_readme_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0, f"`allocmoe {command} --help` exited with {exit_info.value.code}"
    assert f"allocmoe {command}" in capsys.readouterr().out
