"""Packaging guarantees: current stubs, and an edge that never needs torch."""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_ON_EDGE = ("torch", "transformers", "triton", "nvidia-")


def requirement_closure(dist_name: str) -> set[str]:
    """Every distribution the installed `dist_name` pulls in, extras excluded."""
    seen: set[str] = set()
    todo = [dist_name]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_edge_requirement_closure_has_no_torch_or_transformers() -> None:
    closure = requirement_closure("specsplit-edge")
    assert "specsplit-shared" in closure and "onnxruntime" in closure
    bad = sorted(n for n in closure if n.startswith(FORBIDDEN_ON_EDGE))
    assert not bad, f"the edge would install {bad}"


def test_server_closure_does_reach_torch() -> None:
    """The closure walk must be able to find torch, or the edge test proves nothing."""
    assert "torch" in requirement_closure("specsplit-server")


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], check=True)
    committed = ROOT / "shared" / "src" / "specsplit" / "v1"
    generated = sorted((tmp_path / "specsplit" / "v1").glob("*.py*"))
    assert generated, "the generator wrote nothing"
    for path in generated:
        assert (committed / path.name).read_text() == path.read_text(), f"{path.name} is stale: run `make proto`"


def test_stubs_import_as_a_normal_package() -> None:
    from specsplit.v1 import specsplit_pb2, specsplit_pb2_grpc

    assert specsplit_pb2.EdgeMessage(open=specsplit_pb2.Open(prompt_ids=[1])).WhichOneof("kind") == "open"
    assert hasattr(specsplit_pb2_grpc, "SpecSplitStub")


def _floors(pyproject: Path) -> dict[str, Version]:
    """Each dependency's lowest version admitted, where it has one (a >= bound)."""
    import tomllib

    floors = {}
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        req = Requirement(line)
        for spec in req.specifier:
            if spec.operator == ">=":
                floors[canonicalize_name(req.name)] = Version(spec.version)
    return floors


@pytest.mark.parametrize(("constraints", "packages"), [
    ("constraints-oldest.txt", ("shared", "edge", "server")),
    # The edge's own venv: its floors below the server's (ONNX Runtime 1.17) are run there.
    ("constraints-oldest-edge.txt", ("shared", "edge")),
])
def test_the_oldest_constraints_are_the_floors_the_packages_admit(constraints, packages) -> None:
    """make test-oldest and test-oldest-edge test "the oldest the pyproject.toml files admit":
    each pin must be the floor there, the highest of the packages' where they differ, as they
    share one venv (before, onnx 1.16.2 was pinned where onnx>=1.16 admitted 1.16.0, and numpy
    1.24.4 where all three admitted 1.24.0); and every floor of the edge's is pinned in its own."""
    floors: dict[str, Version] = {}
    for package in packages:
        for name, version in _floors(ROOT / package / "pyproject.toml").items():
            floors[name] = max(version, floors.get(name, version))
    pins = [Requirement(line) for line in (ROOT / constraints).read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert pins
    for pin in pins:
        (spec,) = pin.specifier
        name = canonicalize_name(pin.name)
        assert spec.operator == "==" and floors.get(name) == Version(spec.version), \
            f"{constraints} pins {pin}, the pyproject.toml files admit from {floors.get(name)}"
    if "server" not in packages:
        assert {canonicalize_name(p.name) for p in pins} == set(floors), f"{constraints} leaves floors unpinned"
