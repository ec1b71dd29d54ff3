"""The ``hetconv`` command line, above every other room: one module per command (:mod:`.train`,
:mod:`.worker`, :mod:`.devices`, :mod:`.simulate`, :mod:`.plan`, :mod:`.export`,
:mod:`.evaluate`, :mod:`.report`), the mode flags declared once for train, simulate and plan
(:mod:`.modes`), and :func:`main` (the ``hetconv`` console script)."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
