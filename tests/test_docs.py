"""The README and the docs stay true: their links resolve, their `hetconv` commands parse with
the real command line, the README's first two commands are the ones CI runs, and the README
fits on a screen or so."""

from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from hetconv.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]

FIRST_COMMANDS = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install . && hetconv train",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && pytest",
]

_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _without_code(text: str) -> str:
    """The text with its fenced blocks blanked (links and headings inside code are not)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, markup and punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFC", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _without_code(page.read_text(encoding="utf-8")).splitlines():
        found = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not found:
            continue
        slug = _slug(found.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page: Path) -> list[str]:
    return _LINK.findall(_without_code(page.read_text(encoding="utf-8")))


def _bash_blocks(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    return [m.group(2) for m in _FENCE.finditer(text) if m.group(1) == "bash"]


def _command_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, a leading `$ ` prompt dropped."""
    commands, pending = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command.startswith("$ "):
            command = command[2:]
        if command:
            commands.append(command)
    return commands


def _hetconv_argvs(command: str) -> list[list[str]]:
    """Every `hetconv ...` of a command line (also after `&&` or `;`), its comment dropped, as
    the argv the parser gets."""
    argvs = []
    for part in re.split(r"&&|;", command):
        if not re.match(r"\s*hetconv(\s|$)", part):
            continue
        words = shlex.split(part, comments=True)
        argvs.append(words[1:])
    return argvs


def test_the_pages_exist():
    missing = [_page_id(p) for p in PAGES if not p.is_file()]
    assert not missing, missing
    assert len(PAGES) > 3, "docs/ holds no pages"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(ROOT)}")
        elif anchor and resolved.is_file() and resolved.suffix == ".md":
            if anchor not in _anchors(resolved):
                broken.append(f"{target}: no heading #{anchor} in {_page_id(resolved)}")
    assert not broken, f"{_page_id(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_hetconv_command_parses(page):
    parser = build_parser()
    refused = []
    for block in _bash_blocks(page):
        for command in _command_lines(block):
            for argv in _hetconv_argvs(command):
                try:
                    parser.parse_args(argv)
                except SystemExit as e:  # argparse's way of refusing
                    refused.append(f"{command!r} (exit {e.code})")
    assert not refused, f"{_page_id(page)}: the command line refuses " + "; ".join(refused)


def test_some_hetconv_commands_are_checked():
    """The check above finds the commands it should (a parser of the blocks that found none
    would pass every page)."""
    argvs = [
        argv
        for page in PAGES
        for block in _bash_blocks(page)
        for command in _command_lines(block)
        for argv in _hetconv_argvs(command)
    ]
    commands = {argv[0] for argv in argvs if argv}
    assert {"train", "worker", "simulate", "plan", "evaluate", "report"} <= commands, commands


def test_the_readme_starts_with_the_two_commands_ci_runs():
    blocks = _bash_blocks(README)
    assert [block.strip() for block in blocks[:2]] == FIRST_COMMANDS
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    steps = [re.sub(r"\s--quiet\b", "", line).strip() for line in ci.splitlines()]
    assert 'python3 -m venv "$venv"' in steps
    install = steps.index("pip install .")
    train = next(i for i, s in enumerate(steps) if s.split()[:2] == ["hetconv", "train"])
    dev = steps.index("pip install -e '.[dev]'")
    tests = next(i for i, s in enumerate(steps) if s.split()[:1] == ["pytest"])
    assert install < train < dev < tests, (install, train, dev, tests)


def test_the_readme_fits_in_300_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail to docs/"


def test_the_link_and_command_checks_catch_what_they_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A title\n\n## Second `one`: here\n\n[ok](#second-one-here) [bad](#nowhere)\n\n"
        "```bash\n$ hetconv train --steps 3 \\\n    --batch 8   # a comment\n"
        "export X=1 && hetconv plan --nodes 2\nls runs\n```\n",
        encoding="utf-8",
    )
    assert _anchors(page) == {"a-title", "second-one-here"}
    assert _links(page) == ["#second-one-here", "#nowhere"]
    [block] = _bash_blocks(page)
    argvs = [argv for command in _command_lines(block) for argv in _hetconv_argvs(command)]
    assert argvs == [["train", "--steps", "3", "--batch", "8"], ["plan", "--nodes", "2"]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--no-such-flag"])
