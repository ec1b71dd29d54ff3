"""What every command's parser shares: the help formatter and the subcommand parser, whose
``--help`` may show the options most runs need and ``--help-all`` every one."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable

#: A help text that says its option's default itself: "(default 20)", "; default: its best",
#: ". Default link; ...". The formatter then adds none, so each default is printed once.
STATED_DEFAULT = re.compile(r"(?:^|[(;,.]\s*)default\b:?\s*([^;)]*)", re.I)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: appended as ``(default: X)`` unless the help says it in its
    own words, and never the empty ones that would only say 'None', 'False' or '[]'."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        if action.help and STATED_DEFAULT.search(action.help):
            return action.help
        return super()._get_help_string(action)


class _HelpAll(argparse.Action):
    """``--help-all``: the help with every option, then exit."""

    def __init__(
        self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None
    ):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_help(every_option=True), sys.stdout)
        parser.exit()


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser. Its usage errors read ``hetconv COMMAND: error: ...`` (exit 2),
    as :func:`hetconv.cli.main` reports bad input. ``intermixed=True``: positionals may sit on
    both sides of options (``hetconv simulate a --nodes 1..4 b``), as
    ``parse_intermixed_args`` parses. With :meth:`set_help_tiers`, ``--help`` shows the
    options most runs need and ``--help-all`` every one."""

    def __init__(self, *args, intermixed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._mixing = False
        #: The dests ``--help`` shows (None: every option).
        self.first_tier: frozenset[str] | None = None
        self._more = ""

    def set_help_tiers(self, first: Iterable[str], more: str) -> None:
        """Make ``--help`` show only the options whose dests are in ``first``, ending with a
        line that says ``--help-all`` shows the rest: ``more`` says what they are."""
        first = frozenset(first)
        unknown = first - {a.dest for a in self._actions}
        if unknown:
            raise ValueError(f"no option for {', '.join(sorted(unknown))}")
        self.first_tier, self._more = first, more
        for action in self._actions:
            if isinstance(action, argparse._HelpAction):
                action.help = "show the options most runs need and exit"
        self.add_argument(
            "--help-all", action=_HelpAll, help=f"show every option, {more} too, and exit"
        )

    def hidden_by_help(self) -> list[argparse.Action]:
        """The options ``--help`` leaves to ``--help-all``."""
        if self.first_tier is None:
            return []
        return [
            a
            for a in self._actions
            if a.option_strings
            and a.dest not in self.first_tier
            and not isinstance(a, (argparse._HelpAction, _HelpAll))
        ]

    def format_help(self, every_option: bool = False) -> str:
        hidden = [] if every_option else self.hidden_by_help()
        if not hidden:
            return super().format_help()
        helps = [(a, a.help) for a in hidden]
        # A group left with nothing to show loses its description too.
        empty = [
            (g, g.description)
            for g in self._action_groups
            if g._group_actions and all(a in hidden for a in g._group_actions)
        ]
        epilog = self.epilog
        try:
            for action, _ in helps:
                action.help = argparse.SUPPRESS
            for group, _ in empty:
                group.description = None
            self.epilog = f"{len(hidden)} more options ({self._more}): {self.prog} --help-all"
            return super().format_help()
        finally:
            for action, text in helps:
                action.help = text
            for group, description in empty:
                group.description = description
            self.epilog = epilog

    def parse_known_args(self, args=None, namespace=None):
        if not self.intermixed or self._mixing:
            return super().parse_known_args(args, namespace)
        self._mixing = True  # the intermixed parse calls back here for its two passes
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False
