"""The house's size limits, kept: no source file over 600 lines, no function over 80, no class
over 400 (generated protobuf code aside). A reader should find one concern per file."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("hetconv", "master", "worker", "simulations", "training", "cli", "benchmarks")
FILE_LINES, FUNCTION_LINES, CLASS_LINES = 600, 80, 400


def _sources() -> list[Path]:
    return [
        path
        for room in ROOMS
        for path in sorted((ROOT / room).rglob("*.py"))
        if "proto" not in path.relative_to(ROOT).parts
    ]


def test_the_rooms_hold_sources():
    names = {path.relative_to(ROOT).as_posix() for path in _sources()}
    assert {"master/cluster.py", "master/runs.py", "worker/service.py", "cli/main.py"} <= names


def test_no_source_file_function_or_class_is_over_its_limit():
    over = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT).as_posix()
        if text.count("\n") > FILE_LINES:
            over.append(f"{where}: {text.count(chr(10))} lines (limit {FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > FUNCTION_LINES:
                over.append(f"{where}: function {node.name} {lines} lines")
            elif isinstance(node, ast.ClassDef) and lines > CLASS_LINES:
                over.append(f"{where}: class {node.name} {lines} lines")
    assert over == []
