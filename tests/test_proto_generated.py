"""The committed code in hetconv/proto must be what grpc_tools generates from protos/ today.

Only the messages (``_pb2.py``) and their type stubs (``_pb2.pyi``) are generated and committed:
the service stubs and servicer glue are built from the call table (``hetconv.calls``), so the
``--grpc_python_out`` plugin is not run.
"""

from __future__ import annotations

import difflib
import importlib.resources
from pathlib import Path

import pytest

protoc = pytest.importorskip(
    "grpc_tools.protoc",
    reason="grpcio-tools is not installed (pip install -e '.[dev]'); cannot regenerate the code",
)

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
SUFFIXES = ("_pb2.py", "_pb2.pyi")


def _proto_files() -> list[Path]:
    """Every .proto under protos/, relative to it (also its path in the package tree)."""
    return sorted(p.relative_to(PROTOS) for p in PROTOS.rglob("*.proto"))


def _regenerate_command(protos: list[Path]) -> str:
    return (
        "python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. "
        + " ".join(f"protos/{p.as_posix()}" for p in protos)
        + f"  (run from {ROOT})"
    )


def _generated(proto: Path) -> list[Path]:
    """The files generated from ``proto``, relative to the output root."""
    return [proto.parent / (proto.stem + suffix) for suffix in SUFFIXES]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """Run protoc in-process on every .proto into a fresh directory; returns that directory."""
    out = tmp_path_factory.mktemp("proto_out")
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",  # argv[0]
        f"-I{PROTOS}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        *(str(PROTOS / p) for p in _proto_files()),
    ]
    status = protoc.main(args)
    assert status == 0, f"grpc_tools.protoc failed with status {status}: {args}"
    return out


def test_protos_exist():
    assert _proto_files(), f"no .proto files under {PROTOS}"
    assert Path("hetconv/proto/worker.proto") in _proto_files()


@pytest.mark.parametrize("proto", _proto_files(), ids=lambda p: p.as_posix())
def test_every_proto_has_committed_generated_code(proto):
    missing = [str(f) for f in _generated(proto) if not (ROOT / f).is_file()]
    assert not missing, (
        f"{proto} has no committed generated code {missing}; generate it with:\n"
        + _regenerate_command(_proto_files())
    )


@pytest.mark.parametrize(
    "target",
    [f for p in _proto_files() for f in _generated(p)],
    ids=lambda f: f.as_posix(),
)
def test_committed_code_is_up_to_date(generated, target):
    fresh = generated / target
    assert fresh.is_file(), f"protoc did not produce {target}"
    committed = ROOT / target
    assert committed.is_file(), f"{target} is not committed; generate it with:\n" + (
        _regenerate_command(_proto_files())
    )
    old, new = committed.read_bytes(), fresh.read_bytes()
    if old != new:
        diff = difflib.unified_diff(
            old.decode(errors="replace").splitlines(),
            new.decode(errors="replace").splitlines(),
            f"committed {target}",
            "regenerated",
            lineterm="",
        )
        excerpt = "\n".join(line[:200] for line in list(diff)[:20])
        pytest.fail(
            f"{target} is stale: it differs from what grpc_tools.protoc generates from protos/. "
            f"Regenerate it with:\n{_regenerate_command(_proto_files())}\n\n{excerpt}",
            pytrace=False,
        )


def test_no_generated_service_stubs():
    """The call table builds the stubs; a committed ``_pb2_grpc.py`` would be dead code."""
    stale = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "hetconv").rglob("*_pb2_grpc.py")
    )
    assert not stale, f"generated service stubs are not used (hetconv.calls builds them): {stale}"
