"""Argument types shared by every command line (``hetconv ...`` and the scripts): a bad value
is refused by argparse with a message naming it, before anything starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number_at_least(kind: Callable[[str], int | float], least: float, strict: bool = False):
    """An argparse type: ``kind(text)`` that is finite and ``>= least`` (``> least`` when
    ``strict``), else ``argparse.ArgumentTypeError`` naming the text."""
    word = "greater than" if strict else "at least"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or value < least or (strict and value == least):
            if least == 0 and strict:
                raise argparse.ArgumentTypeError(f"{text} must be positive")
            raise argparse.ArgumentTypeError(f"{text} must be {word} {least:g}")
        return value

    return parse


def positive(kind: Callable[[str], int | float]):
    """An argparse type for a finite number > 0 of type ``kind`` (int or float)."""
    return number_at_least(kind, 0, strict=True)


positive_int = number_at_least(int, 1)
positive_float = positive(float)
non_negative_int = number_at_least(int, 0)


def parse_address(text: str, where: str = "--worker") -> str:
    """``text`` if it is ``HOST:PORT`` (port 0-65535); ValueError naming ``where`` otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{where}: {text!r} is not HOST:PORT")
    return text
