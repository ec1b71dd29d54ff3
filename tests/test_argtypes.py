"""The one set of argument types every command line uses."""

from __future__ import annotations

import argparse

import pytest

from hetconv.argtypes import non_negative_int, positive, positive_float, positive_int


@pytest.mark.parametrize(
    "parse, text, message",
    [
        (positive_int, "0", "0 must be at least 1"),
        (positive_int, "2.5", "'2.5' is not an integer"),
        (non_negative_int, "-1", "-1 must be at least 0"),
        (positive_float, "0", "0 must be positive"),
        (positive_float, "-3", "-3 must be positive"),
        (positive_float, "nan", "nan must be positive"),
        (positive_float, "inf", "inf must be positive"),
        (positive(float), "ten", "'ten' is not a number"),
    ],
)
def test_bad_values_are_named(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{message}$"):
        parse(text)


def test_good_values_pass_through_with_their_type():
    assert positive_int("3") == 3 and isinstance(positive_int("3"), int)
    assert positive_float("0.5") == 0.5
    assert non_negative_int("0") == 0
    assert positive(int)("7") == 7


def test_the_commands_use_them():
    from hetconv import cli
    from hetconv.cli import simulate as simulate_cli
    from hetconv.simulations import validate

    parser = argparse.ArgumentParser()
    simulate_cli.add_arguments(parser)
    for module in (cli, simulate_cli, validate):
        assert not hasattr(module, "_positive"), module.__name__
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--batch", "0"])
