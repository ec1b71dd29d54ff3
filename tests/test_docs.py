"""The README and the docs stay true: their links resolve, their `hetconv` commands parse with
the real command line, the README's first two commands are the ones CI runs, and the README
fits on a screen or so."""

from __future__ import annotations

import argparse
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


# -- statements the code could contradict ---------------------------------------------------------

#: Where the pages say a flag's default: "`--network auto`, the default", "(`--backend auto`,
#: the worker's default)" (not "`--overlap on` (the default, `auto`, ...)", which names it).
_FLAG_DEFAULT = re.compile(
    r"`(?:hetconv (?P<command>\w+) )?(?P<flag>--[\w-]+) (?P<value>[^`\s]+)`,?\s+\(?"
    r"the (?:(?P<whose>\w+)'s )?default\b(?!, `)"
)
#: Other statements of a default in words: (pattern, command, flag, words -> the value).
_WORDED_DEFAULTS = [
    (r"default (\d+) steps", "train", "--steps", int),
    (r"trains the `([\w-]+)` network", "train", "--model", str),
    (r"starts (two|three|four|\d+) local worker", "train", "--local-workers", "number"),
    (r"`hetconv worker`[^.]*?serves on ([\d.]+:\d+)|# serves on ([\d.]+:\d+)", "worker",
     "--listen", str),
    (r"every (\d+)(?:st|nd|rd|th) step \(the default\)", "train", "--spot-check-every", int),
    (r"hence the default of (\d+)", "train", "--spot-check-every", int),
]  # fmt: skip
_NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4}


def _page_text(page: Path) -> str:
    return " ".join(page.read_text(encoding="utf-8").split())  # lines joined


def _resolved_defaults() -> dict[tuple[str, str], set[str]]:
    """(command, flag) -> every value its default takes: the parser's, and for train's flags
    resolved by the run (--shares, --rebalance-every, --steps ...) what the demo and a run on
    named workers resolve and write into config.toml."""
    import tempfile

    from hetconv.cli.train import cluster_config_of, train_config
    from hetconv.cli.train_config import write_run_config
    from hetconv.master.spotcheck import SpotCheckConfig
    from hetconv.training.rundir import read_config

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    values: dict[tuple[str, str], set[str]] = {}
    for name, sub in commands.choices.items():
        for action in sub._actions:
            for flag in action.option_strings:
                values[(name, flag)] = {str(action.default)}
    train = commands.choices["train"]
    for workers in ([], ["127.0.0.1:50051"]):
        args = parser.parse_args(["train", *(w for a in workers for w in ("--worker", a))])
        train_config(args, None)
        cluster_config_of(args, workers, None)
        with tempfile.TemporaryDirectory() as folder:
            write_run_config(Path(folder) / "config.toml", args)
            recorded = read_config(Path(folder) / "config.toml")
        for action in train._actions:
            value = recorded.get(action.dest.replace("_", "-"))
            for flag in action.option_strings:
                if value is not None:
                    values[("train", flag)].add(str(value))
    values[("train", "--spot-check-every")].add(str(SpotCheckConfig().every))
    return values


def _stated_defaults(page: Path) -> list[tuple[str, str, str, str]]:
    """(command, flag, value, the words) for each default the page states."""
    text = _page_text(page)
    found = []
    for m in _FLAG_DEFAULT.finditer(text):
        command = m.group("command") or m.group("whose") or "train"
        found.append((command, m.group("flag"), m.group("value"), m.group(0)))
    for pattern, command, flag, kind in _WORDED_DEFAULTS:
        for m in re.finditer(pattern, text):
            word = next(g for g in m.groups() if g)
            value = _NUMBERS.get(word, word) if kind == "number" else kind(word)
            found.append((command, flag, str(value), m.group(0)))
    return found


def test_the_defaults_the_pages_state_are_the_code_s():
    resolved = _resolved_defaults()
    wrong, stated = [], 0
    for page in PAGES:
        for command, flag, value, words in _stated_defaults(page):
            stated += 1
            if (command, flag) not in resolved:
                wrong.append(f"{_page_id(page)}: {words!r}: hetconv {command} has no {flag}")
            elif value not in resolved[(command, flag)]:
                wrong.append(
                    f"{_page_id(page)}: {words!r}: the default of hetconv {command} {flag} is "
                    + " or ".join(sorted(resolved[(command, flag)]))
                )
    assert not wrong, "; ".join(wrong)
    assert stated >= 8, f"only {stated} defaults found in the pages: has their wording changed?"


#: The cuda backend's status: its tests passed on an NVIDIA H100 (docs/backends.md). A page
#: that says it never ran on a GPU contradicts that.
_NEVER_ON_A_GPU = re.compile(
    r"(?:has not|hasn't|never|not yet)\s+(?:yet\s+)?(?:been\s+)?(?:run|tested|ran)\s+on\s+"
    r"(?:a|any|an)\s+(?:real\s+)?(?:GPU|NVIDIA)",
    re.I,
)


def test_no_page_says_the_cuda_backend_never_ran_on_a_gpu():
    said = [
        f"{_page_id(page)}: {m.group(0)!r}"
        for page in PAGES
        for m in _NEVER_ON_A_GPU.finditer(_page_text(page))
    ]
    assert not said, "the cuda backend's tests passed on an H100 and an H200: " + "; ".join(said)
    assert re.search(r"Tested on an NVIDIA H100 and, with the whole stage on the device, an "
                     r"NVIDIA H200", _page_text(ROOT / "docs" / "backends.md"))  # fmt: skip


def test_the_statement_checks_catch_what_they_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "`hetconv worker` serves on 0.0.0.0:50051. (`--network auto`, the default) and "
        "`--overlap on` (the default, `auto`, turns it on). `--backend gpu` (the worker's "
        "default). Trains the `tiny` network; default 400 steps. The cuda backend has not yet "
        "run on a GPU.",
        encoding="utf-8",
    )
    stated = {(c, f, v) for c, f, v, _ in _stated_defaults(page)}
    assert stated == {
        ("worker", "--listen", "0.0.0.0:50051"),
        ("train", "--network", "auto"),
        ("worker", "--backend", "gpu"),
        ("train", "--steps", "400"),
    }
    resolved = _resolved_defaults()
    assert "gpu" not in resolved[("worker", "--backend")]
    assert "400" not in resolved[("train", "--steps")]
    assert {"link", "compute"} <= resolved[("train", "--shares")]
    assert _NEVER_ON_A_GPU.search(_page_text(page))
