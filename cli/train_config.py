"""A run's ``config.toml``: the resolved flags a run folder keeps (:func:`write_run_config`),
and ``hetconv train --config`` reading them back under the flags given (:func:`apply_config`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hetconv.data import infer_dataset
from hetconv.model import PRESETS
from hetconv.training.config import DEFAULT_STEPS, DEFAULT_TRAIN_SIZE
from hetconv.training.rundir import read_config_tables, write_config

from .train_flags import add_train_arguments

#: Flags a config file never holds: where this run's outputs go (a rerun makes its own), the
#: secret, and the file itself.
_NOT_CONFIG = {
    "help": "",
    "config": "a config file cannot name another",
    "name": "each run names its own folder: give --name on the command line",
    "run_dir": "give --run-dir on the command line",
    "no_run_dir": "give --no-run-dir on the command line",
    "resume": "give --resume on the command line",
    "token": "a secret never goes into a file: use $HETCONV_TOKEN or --token",
    "trace": "outputs go to the run folder, or give --trace on the command line",
    "save": "outputs go to the run folder, or give --save on the command line",
    "checkpoint_dir": "outputs go to the run folder, or give --checkpoint-dir on the command line",
    "no_progress": "give --no-progress on the command line",
}
#: The table each flag is written in (flags not named here: [training]).
_CONFIG_TABLES = {
    "model": ("preset",),
    "data": ("dataset", "data_dir", "holdout_fraction", "train_size", "eval_size", "eval_every"),
    "training": ("steps", "epochs", "batch", "seed", "lr", "momentum", "weight_decay", "load"),
    "cluster": (
        "local", "worker", "workers_file", "local_workers", "connect_timeout", "master_compute",
        "shares", "network", "wire_format", "rebalance_every", "settle_steps", "stages",
        "deterministic", "probe_nodes",
        "tls_ca", "spot_check_every", "spot_check_sample", "discover", "discover_wait",
    ),
    "outputs": ("checkpoint_every", "tensorboard"),
}  # fmt: skip
_CONFIG_PATHS = ("data_dir", "workers_file", "tls_ca", "load")


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetconv train", add_help=False)
    add_train_arguments(parser)
    return parser


def _config_key(action: argparse.Action) -> str:
    return action.dest.replace("_", "-")  # --model's is preset, the name it had before


def _config_actions() -> dict[str, argparse.Action]:
    """Config key (the flag's name without --) -> the flag, for every flag a config holds."""
    return {
        _config_key(a): a
        for a in _train_parser()._actions
        if a.option_strings and a.dest not in _NOT_CONFIG
    }


def write_run_config(path: Path, args: argparse.Namespace) -> None:
    """Write the run's resolved flags (defaults filled in, paths made absolute)."""
    values = dict(vars(args))
    if values["data_dir"]:
        values["dataset"] = values["dataset"] or infer_dataset(values["data_dir"])
    else:
        values["dataset"] = "synthetic"
        values["train_size"] = values["train_size"] or DEFAULT_TRAIN_SIZE
    if values["steps"] is None and values["epochs"] is None:
        values["steps"] = DEFAULT_STEPS
    for key in _CONFIG_PATHS:
        if values[key]:
            values[key] = os.path.abspath(values[key])
    if values["preset"] not in PRESETS:
        values["preset"] = os.path.abspath(values["preset"])
    if values["local"]:  # nothing else of a cluster applies
        values.update({dest: None for dest in _CONFIG_TABLES["cluster"] if dest != "local"})
    tables: dict[str, dict[str, object]] = {name: {} for name in _CONFIG_TABLES}
    for key, action in _config_actions().items():
        table = next((t for t, dests in _CONFIG_TABLES.items() if action.dest in dests), None)
        tables[table or "training"][key] = values.get(action.dest)
    write_config(
        path,
        tables,
        "hetconv train's flags for this run (the token and where outputs go are not kept).\n"
        f"Run it again: hetconv train --config {path}\n"
        "Flags given on the command line override these.",
    )


def _config_value(path: str, key: str, action: argparse.Action, value: object) -> object:
    """A config file's value for ``action``, checked as the flag's own value would be."""

    def refuse(why: str) -> ValueError:
        return ValueError(f"config {path}: {key} = {value!r}: {why}")

    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise refuse("expected true or false")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise refuse("expected a list of strings")
        return list(value)
    wrong = action.type is None and not isinstance(value, str)
    if wrong or isinstance(value, (bool, list, dict)):
        raise refuse("expected " + ("a string" if action.type is None else "a number"))
    if action.type is not None:
        if isinstance(value, str) and _numeric(action.type, value):
            raise refuse("expected a number, not a string (no quotes)")
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            raise refuse(str(e) or "not a valid value") from None
    if action.choices is not None and value not in action.choices:
        raise refuse(f"expected one of {', '.join(map(str, action.choices))}")
    return value


def _numeric(parse, text: str) -> bool:
    """Whether flag type ``parse`` makes a number of ``text``."""
    try:
        return isinstance(parse(text), (int, float))
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return False


def _config_values(path: str) -> dict[str, object]:
    """The keys of config ``path``, each checked to stand in its own table, once."""
    values: dict[str, object] = {}
    keys = _config_actions()
    for table, key, value in read_config_tables(path):
        if table not in _CONFIG_TABLES:
            raise ValueError(
                f"config {path}: unknown table [{table}] (the tables are "
                f"{', '.join(f'[{t}]' for t in _CONFIG_TABLES)})"
            )
        dest = key.replace("-", "_")
        home = next((t for t, dests in _CONFIG_TABLES.items() if dest in dests), "training")
        if key in values:
            raise ValueError(f"config {path}: {key} is given twice")
        if home != table and key in keys:
            raise ValueError(f"config {path}: [{table}] {key}: {key} belongs in [{home}]")
        values[key] = value
    return values


def _explicit_train_flags(argv: list[str]) -> set[str]:
    """The dests of the train flags ``argv`` (a ``hetconv train`` command line) gives."""
    parser = _train_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    train_argv = argv[argv.index("train") + 1 :] if "train" in argv else argv
    return set(vars(parser.parse_known_args(train_argv)[0]))


def apply_config(args: argparse.Namespace, argv: list[str]) -> None:
    """Fill ``args`` from ``args.config``: every flag not given on the command line."""
    path = args.config
    values = _config_values(path)
    actions = _config_actions()
    explicit = _explicit_train_flags(argv)
    parser = _train_parser()
    # A flag given on the command line also overrides the file's others of its group
    # (--epochs there, --steps here).
    overridden = set(explicit)
    for group in parser._mutually_exclusive_groups:
        dests = {a.dest for a in group._group_actions}
        if dests & explicit:
            overridden |= dests
    for key, value in values.items():
        action = actions.get(key)
        if action is None:
            dest = key.replace("-", "_")
            why = _NOT_CONFIG.get(dest)
            raise ValueError(
                f"config {path}: {key} cannot be set in a config file ({why})"
                if why
                else f"config {path}: unknown key {key!r} (the keys are train's flags without "
                "--, e.g. wire-format)"
            )
        value = _config_value(path, key, action, value)
        if action.dest not in overridden:
            setattr(args, action.dest, value)
