"""What `--help` says: `hetconv train --help` shows the options most runs need and points to
`--help-all`, which shows every option in groups; every command prints each default once, and
what it prints is the parser's default and what a run resolves and records in its config.toml."""

from __future__ import annotations

import argparse
import io
import re
from contextlib import redirect_stdout

import pytest

from hetconv.cli import build_parser, main
from hetconv.cli.common import STATED_DEFAULT, HelpFormatter
from hetconv.cli.train import cluster_config_of, train_config
from hetconv.cli.train_config import write_run_config
from hetconv.training.rundir import read_config

#: Options a first run needs, which `hetconv train --help` must show.
FIRST = ("--model", "--data-dir", "--steps", "--epochs", "--batch", "--lr", "--local",
         "--worker", "--discover", "--name", "--resume", "--save")  # fmt: skip
#: Modes and tuning that only `--help-all` shows.
LATER = ("--start-ahead", "--master-block", "--head", "--resident-sync-every", "--stages",
         "--spot-check-sample", "--settle-steps", "--token")  # fmt: skip


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _printed(argv: list[str]) -> str:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return out.getvalue()


def _options_in(text: str) -> set[str]:
    """The options a help text lists (at the start of an entry, not in another's words)."""
    return set(re.findall(r"^\s{2}(?:-\w, )?(--[\w-]+)", text, re.M))


def test_train_help_shows_what_a_first_run_needs_and_points_to_help_all():
    text = _printed(["train", "--help"])
    assert len(text.splitlines()) <= 80, f"{len(text.splitlines())} lines"
    listed = _options_in(text)
    assert set(FIRST) <= listed, set(FIRST) - listed
    assert not set(LATER) & listed, set(LATER) & listed
    train = _commands()["train"]
    hidden = len(train.hidden_by_help())
    said = re.search(r"(\d+) more options \(([^)]*)\): hetconv train --help-all", " ".join(
        text.split()
    ))  # fmt: skip
    assert said is not None, text[-300:]
    assert int(said.group(1)) == hidden > 20
    assert "the modes" in said.group(2)


def test_train_help_all_shows_every_option_in_groups():
    text = _printed(["train", "--help-all"])
    train = _commands()["train"]
    every = {s for a in train._actions for s in a.option_strings if s.startswith("--")}
    assert every <= _options_in(text) | {"--preset", "--no-master-compute"}
    titles = [g.title for g in train._action_groups if g._group_actions]
    for title in ("the network and the data", "training", "where convolutions run",
                  "how each layer runs (the modes)", "security", "checkpoints"):  # fmt: skip
        assert title in titles and f"\n{title}:\n" in text, title
    for option in LATER:  # each in a group of its own kind, not beside --lr
        group = next(g for g in train._action_groups if option in _group_options(g))
        assert "--lr" not in _group_options(group), option
    assert "more options" not in text


def _group_options(group) -> set[str]:
    return {s for a in group._group_actions for s in a.option_strings}


def test_a_command_without_tiers_has_no_help_all():
    worker = _commands()["worker"]
    assert worker.hidden_by_help() == []
    assert "--help-all" not in worker.format_help()


def _defaults_said(parser: argparse.ArgumentParser, action: argparse.Action) -> list[str]:
    """The defaults an option's help prints (as --help-all shows it), each as said."""
    text = parser._get_formatter()._expand_help(action)
    return [m.strip() for m in STATED_DEFAULT.findall(" ".join(text.split()))]


def _same(said: str, value: object) -> bool:
    word = said.split()[0].rstrip(",.") if said.split() else ""
    try:
        return float(word) == float(value)
    except (TypeError, ValueError):
        return word == str(value)


def _a_value(said: str, action: argparse.Action) -> bool:
    """Whether a default said in words is a value: a number or one of the choices."""
    word = said.split()[0].rstrip(",.") if said.split() else ""
    return bool(re.fullmatch(r"-?\d+(\.\d+)?", word)) or word in (action.choices or ())


def _every_option():
    for name, parser in _commands().items():
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS:
                yield name, parser, action


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_printed_default_is_printed_once_and_is_the_parsers(command):
    parser = _commands()[command]
    assert parser.formatter_class is HelpFormatter
    wrong = []
    for name, _, action in _every_option():
        if name != command:
            continue
        said = _defaults_said(parser, action)
        option = action.option_strings[0]
        if len(said) > 1:
            wrong.append(f"{option}: {len(said)} defaults printed: {said}")
        shown = action.default not in (None, False, [], argparse.SUPPRESS)
        if shown and not said:
            wrong.append(f"{option}: default {action.default!r} not printed")
        if shown and said and not _same(said[0], action.default):
            wrong.append(
                f"{option}: prints default {said[0]!r}, the parser's is {action.default!r}"
            )
    assert not wrong, "; ".join(wrong)


def test_the_formatter_prints_a_default_the_help_states_once():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    stated = parser.add_argument("--batch", type=int, default=16, help="images (default 16)")
    plain = parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    assert _defaults_said(parser, stated) == ["16"]
    assert _defaults_said(parser, plain) == ["0.1"]


def _demo_config(tmp_path, argv: list[str], workers: list[str]) -> dict[str, object]:
    """What a run of ``hetconv train ARGV`` resolves and writes into its config.toml."""
    args = build_parser().parse_args(["train", *argv])
    train_config(args, None)
    cluster_config_of(args, workers, None)
    path = tmp_path / "config.toml"
    write_run_config(path, args)
    return read_config(path)


def test_train_defaults_are_what_a_run_resolves_and_records(tmp_path):
    """Each default `hetconv train --help-all` prints, the parser's or one said in words for a
    flag resolved later (--steps, --rebalance-every, ...), is what the demo's config.toml
    records; --shares says both of its defaults, each as a run resolves it."""
    from hetconv.master.spotcheck import SpotCheckConfig
    from hetconv.training import TrainConfig

    train = _commands()["train"]
    recorded = _demo_config(tmp_path, [], [])
    named = _demo_config(tmp_path, ["--worker", "127.0.0.1:50051"], ["127.0.0.1:50051"])
    resolved_elsewhere = {  # said in words; resolved by a config, not written in config.toml
        "--checkpoint-every": TrainConfig(checkpoint_dir="c").checkpoint_interval,
        "--spot-check-every": SpotCheckConfig().every,
        "--spot-check-sample": SpotCheckConfig().kernels,
    }
    wrong, checked = [], 0
    for action in train._actions:
        if not action.option_strings:
            continue
        option, key = action.option_strings[0], action.dest.replace("_", "-")
        said = _defaults_said(train, action)
        if not said:
            continue
        if option == "--shares":
            text = " ".join(said[0].split())
            assert recorded[key] == "compute" and named[key] == "link", (recorded, named)
            assert text.startswith("link with named or discovered workers"), text
            continue
        if action.default is None and not _a_value(said[0], action):
            continue  # said in words ("all of them", "inferred from it"): nothing to compare
        value = recorded.get(key, resolved_elsewhere.get(option, action.default))
        assert value is not None, f"{option}: prints default {said[0]!r}, resolved nowhere"
        checked += 1
        if not _same(said[0], value):
            wrong.append(f"{option}: prints default {said[0]!r}, a run resolves {value!r}")
    assert not wrong, "; ".join(wrong)
    assert checked >= 20
    det = _demo_config(tmp_path, ["--deterministic"], [])
    assert det["shares"] == "compute" and det["rebalance-every"] == 0
