"""Packaging guarantees: current stubs, and an edge that never needs torch."""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
