"""What every command's parser shares: the help formatter and the subcommand parser."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones that would only say 'None', 'False' or '[]'."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser. Its usage errors read ``hetconv COMMAND: error: ...`` (exit 2),
    as :func:`hetconv.cli.main` reports bad input. ``intermixed=True``: positionals may sit on
    both sides of options (``hetconv simulate a --nodes 1..4 b``), as
    ``parse_intermixed_args`` parses."""

    def __init__(self, *args, intermixed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.intermixed = intermixed
        self._mixing = False

    def parse_known_args(self, args=None, namespace=None):
        if not self.intermixed or self._mixing:
            return super().parse_known_args(args, namespace)
        self._mixing = True  # the intermixed parse calls back here for its two passes
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._mixing = False
