"""Every committed result renders again with its own report's renderer.

The reports' JSON grows keys as the benchmarks grow; a renderer that reads a new key
without a fallback can no longer redraw an older result, which the docs cite by name.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import accept_rate
import gpu_passes
import host_cost
import kv_bucket_passes
import pass_split
import replay
import report
from loadtest import capacity
from loadtest import report as loadtest_report

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"

# Result name prefix -> the renderer of the report that wrote it (first match wins).
RENDERERS: list[tuple[tuple[str, ...], Callable[[dict, str], str]]] = [
    (("gpu-passes", "cpu-passes"), lambda r, _: gpu_passes.render(r)),
    (("accept-rate",), accept_rate.render),
    (("host-cost",), lambda r, _: host_cost.render(r)),
    (("kv-bucket-passes",), lambda r, _: kv_bucket_passes.render(r)),
    (("pass-split",), lambda r, _: pass_split.render(r)),
    (("replay",), lambda r, _: replay.render(r)),
    (("loadtest", "capacity-gpu-"), loadtest_report.render_markdown),
    (("capacity-gpu",), capacity.render),
    (("async", "branches", "full", "quick", "rtt50"), lambda r, _: report.render_markdown(r)),
]
UNRENDERED = ("soak",)  # written by bench/soak.py in one go, with no renderer of its own


def _renderer(name: str) -> Callable[[dict, str], str] | None:
    if name.startswith("capacity-gpu") and name.endswith("-summary"):
        return capacity.render  # a load test's capacity summary, named after the load test's result
    for prefixes, render in RENDERERS:
        if name.startswith(prefixes):
            return render
    return None


@pytest.mark.parametrize("path", [p for p in sorted(RESULTS.glob("*.json")) if not p.stem.startswith(UNRENDERED)],
                         ids=lambda p: p.stem)
def test_a_committed_result_renders_again(path: Path) -> None:
    render = _renderer(path.stem)
    assert render is not None, f"{path.name}: no renderer known for this result; add its prefix to RENDERERS"
    text = render(json.loads(path.read_text()), path.stem)
    assert text.startswith("# ") and len(text.splitlines()) > 3
