"""The exporter refuses an export whose ONNX Runtime logits disagree with torch."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from specsplit.server import export as export_mod
from specsplit.server.export import ExportParityError, export_draft, parity_check
from specsplit.server.loading import load_model


def test_parity_check_fails_on_a_broken_export(tiny, tmp_path, monkeypatch) -> None:
    real_export = export_mod._export_graph

    def broken_export(loaded, path, opset):
        real_export(loaded, path, opset)
        model = onnx.load(str(path))
        weight = max(model.graph.initializer, key=lambda t: np.prod(t.dims))  # embedding or lm head
        arr = numpy_helper.to_array(weight).copy()
        arr[: arr.shape[0] // 2] *= 1.5
        weight.CopyFrom(numpy_helper.from_array(arr, weight.name))
        onnx.save(model, str(path))

    monkeypatch.setattr(export_mod, "_export_graph", broken_export)
    out = tmp_path / "broken"
    with pytest.raises(ExportParityError, match="refusing"):
        export_draft(str(tiny.target_dir), out)
    assert not out.exists()


def test_good_export_passes_parity_with_kv(tiny) -> None:
    loaded = load_model(str(tiny.target_dir), attn="eager")
    report = parity_check(loaded, tiny.same_dir / "model.onnx")
    assert report.max_abs_diff <= export_mod.DEFAULT_TOLERANCE and report.top1_agreement == 1.0


def test_int8_export_scales_each_output_channel(tiny, tmp_path) -> None:
    out = tmp_path / "int8"
    meta = export_draft(str(tiny.target_dir), out, quantize="int8")
    assert meta.weights == "int8 per-channel"
    model = onnx.load(str(out / "model.onnx"))
    scales = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_scale")}
    # A weight's scale is a vector (one per output channel); the activations' stay scalars.
    assert any(s.ndim == 1 and s.size > 1 for s in scales.values())


def test_prepare_redoes_an_export_made_with_the_older_int8_scheme(tiny, tmp_path) -> None:
    from specsplit.common.export_meta import DraftExportMeta
    from specsplit.server.models import prepare_draft

    out = tmp_path / "draft"
    export_draft(str(tiny.target_dir), out, quantize="int8")
    old = DraftExportMeta.load(out)
    stamp = (out / "model.onnx").stat().st_mtime_ns
    prepare_draft(tiny.target_dir, out)  # current scheme: kept as it is
    assert (out / "model.onnx").stat().st_mtime_ns == stamp
    extra = {k: v for k, v in old.extra.items() if k != "int8_scheme"}
    DraftExportMeta(**{**old.__dict__, "extra": extra}).save(out)  # as an older version wrote it
    prepare_draft(tiny.target_dir, out)
    assert DraftExportMeta.load(out).weights == "int8 per-channel"
    assert (out / "model.onnx").stat().st_mtime_ns != stamp
