"""The exporter refuses an export whose ONNX Runtime logits disagree with torch."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from specsplit.common.export_meta import INT4_BLOCK_SIZE, DraftExportMeta
from specsplit.server import export as export_mod
from specsplit.server.export import ExportParityError, check_replaceable, export_draft, parity_check
from specsplit.server.loading import load_model


def test_parity_check_fails_on_a_broken_export(tiny, tmp_path, monkeypatch) -> None:
    real_export = export_mod._export_graph

    def broken_export(loaded, path):
        real_export(loaded, path)
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
    assert DraftExportMeta.load(tiny.same_dir).weights == "fp32"  # not quantized: said so in reports


def test_int8_export_scales_each_output_channel(tiny, tmp_path) -> None:
    out = tmp_path / "int8"
    meta = export_draft(str(tiny.target_dir), out, quantize="int8")
    assert meta.weights == "int8 per-channel"
    model = onnx.load(str(out / "model.onnx"))
    scales = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_scale")}
    # A weight's scale is a vector (one per output channel); the activations' stay scalars.
    assert any(s.ndim == 1 and s.size > 1 for s in scales.values())


@pytest.mark.parametrize("block", [None, 16])  # the tiny model is 64 wide: a block of 64 is a row
def test_int4_export_stores_matrices_in_blocks_and_drafts(tiny, tmp_path, block) -> None:
    from specsplit.edge.drafter import OnnxDrafter

    out = tmp_path / "int4"
    meta = export_draft(str(tiny.target_dir), out, quantize="int4", **({"int4_block_size": block} if block else {}))
    block = block or INT4_BLOCK_SIZE
    assert meta.weights == f"int4 blocks of {block}, asymmetric; embeddings int8"
    model = onnx.load(str(out / "model.onnx"))
    ops = {node.op_type for node in model.graph.node}
    blocks = {a.i for node in model.graph.node if node.op_type == "MatMulNBits" for a in node.attribute
              if a.name in ("bits", "block_size")}
    assert blocks == {4, block} and "MatMulInteger" not in ops
    # No float weight matrix is left: the biggest float initializer is far smaller than the embedding table.
    floats = [np.prod(t.dims) for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert max(floats) < meta.vocab_size * 64
    logits = OnnxDrafter(out).next_logits([5, 6, 7, 8])
    want = OnnxDrafter(tiny.same_dir).next_logits([5, 6, 7, 8])
    assert logits.shape == want.shape and np.corrcoef(logits, want)[0, 1] > 0.9


def test_export_refuses_an_int4_block_size_onnx_runtime_has_no_kernel_for(tiny, tmp_path) -> None:
    with pytest.raises(ValueError, match="block size must be one of"):
        export_draft(str(tiny.target_dir), tmp_path / "int4", quantize="int4", int4_block_size=48)
    assert not (tmp_path / "int4").exists()


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_prepare_redoes_an_export_made_with_an_older_scheme(tiny, tmp_path, quantize) -> None:
    from specsplit.common.export_meta import DraftExportMeta
    from specsplit.server.export import SCHEMES
    from specsplit.server.models import prepare_draft

    out = tmp_path / "draft"
    export_draft(str(tiny.target_dir), out, quantize=quantize)
    old = DraftExportMeta.load(out)
    stamp = (out / "model.onnx").stat().st_mtime_ns
    prepare_draft(tiny.target_dir, out, quantize)  # current scheme: kept as it is
    assert (out / "model.onnx").stat().st_mtime_ns == stamp
    extra = {k: v for k, v in old.extra.items() if k != f"{quantize}_scheme"}
    DraftExportMeta(**{**old.__dict__, "extra": extra}).save(out)  # as an older version wrote it
    prepare_draft(tiny.target_dir, out, quantize)
    assert DraftExportMeta.load(out).weights == f"{quantize} {SCHEMES[quantize]}"
    assert (out / "model.onnx").stat().st_mtime_ns != stamp


def test_export_refuses_to_replace_a_directory_that_is_not_an_export(tiny, tmp_path, capsys) -> None:
    from specsplit.server.cli import main

    victim = tmp_path / "thesis"
    victim.mkdir()
    (victim / "chapter1.txt").write_text("years of work")
    assert main(["export-draft", "--model", str(tiny.target_dir), "--out", str(victim)]) == 2
    assert "holds files but no earlier export" in capsys.readouterr().err
    assert (victim / "chapter1.txt").read_text() == "years of work"
    assert main(["export-draft", "--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_an_out_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path) -> None:
    """Both ran the whole export first (a minute for the default draft), then failed: one
    where --out could not be made, the other on removing the link it replaced."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(FileExistsError, match="afile is a file: --out"):
        check_replaceable(tmp_path / "afile" / "draft")
    (tmp_path / "exp1").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "exp1")
    with pytest.raises(FileExistsError, match="is a symbolic link"):
        check_replaceable(tmp_path / "link")


def test_an_export_ended_by_sigterm_leaves_no_temporary_files(tiny, tmp_path) -> None:
    """`docker compose stop`, a timeout or systemd end an export with SIGTERM, which Python
    does not turn into an exception by itself: the hidden directory of the fp32 graph (2 GB
    for the default draft) stayed behind, never removed."""
    import signal
    import subprocess
    import sys

    # The export holds on in its parity check, its temporary directory made, until ended.
    script = ("import sys, time\n"
              "from specsplit.server import export, cli\n"
              "def held(*a, **k):\n"
              "    print('in the export', flush=True)\n"
              "    for _ in range(1200):\n"  # short waits: a signal that lands on another thread
              "        time.sleep(0.1)\n"  # is handled once the main thread is back in Python
              "export.parity_check = held\n"
              "sys.exit(cli.main(sys.argv[1:]))\n")
    out = tmp_path / "out" / "draft"
    proc = subprocess.Popen([sys.executable, "-c", script, "export-draft", "--model", str(tiny.target_dir),
                             "--out", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "in the export"
        assert [p.name for p in out.parent.iterdir() if p.name.startswith(".draft.")]  # its temporary directory
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert list(out.parent.iterdir()) == []


def test_a_damaged_prepared_draft_is_exported_again(tiny, tmp_path) -> None:
    """Its metadata cut short (a full disk, a crash): before, every later prepare failed with
    a traceback telling the user to export the draft again, which prepare is there to do."""
    from specsplit.server.models import prepare_draft

    out = tmp_path / "prepared"
    prepare_draft(tiny.target_dir, out, "int8")
    (out / "specsplit.json").write_text('{"num_layers": 2')
    prepare_draft(tiny.target_dir, out, "int8")
    assert DraftExportMeta.load(out).quantization == "int8"


def test_an_earlier_export_or_an_empty_directory_may_be_replaced(tiny, tmp_path) -> None:
    check_replaceable(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty")
    check_replaceable(tiny.draft_dir)  # an export: it holds specsplit.json
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        check_replaceable(tmp_path / "file")


def test_an_out_that_holds_the_current_directory_is_refused(tiny, tmp_path, monkeypatch) -> None:
    """--out . in an earlier export: the work directory went inside it, and replacing it
    deleted both exports, then failed on renaming onto '.'."""
    earlier = tmp_path / "earlier"
    shutil.copytree(tiny.draft_dir, earlier)
    monkeypatch.chdir(earlier)
    (earlier / "sub").mkdir()
    for out in (".", "sub/..", f"../{earlier.name}"):
        with pytest.raises(FileExistsError, match="is the current directory or holds it"):
            check_replaceable(Path(out))
    monkeypatch.chdir(earlier / "sub")
    with pytest.raises(FileExistsError, match="is the current directory or holds it"):
        check_replaceable(Path(".."))
    assert (earlier / "specsplit.json").is_file()


def test_logits_that_are_nan_fail_the_parity_check(tiny, monkeypatch) -> None:
    """max(0, nan) is 0: a graph that gave NaN logits passed with a difference of 0."""
    real = export_mod._ort_step

    def nan_logits(*args):  # type: ignore[no-untyped-def]
        logits, present = real(*args)
        return np.full_like(logits, np.nan), present

    monkeypatch.setattr(export_mod, "_ort_step", nan_logits)
    loaded = load_model(str(tiny.target_dir), attn="eager")
    report = parity_check(loaded, tiny.same_dir / "model.onnx")
    assert np.isnan(report.max_abs_diff)


def test_a_killed_export_s_work_directory_is_swept_by_the_next_prepare(tiny, tmp_path) -> None:
    """Its name was its own each time (a temporary directory's), and nothing removed it: 2 GB
    for the default draft, again with each killed run."""
    from specsplit.server.models import prepare_draft

    out = tmp_path / "prepared"
    prepare_draft(tiny.target_dir, out, "int8")
    (tmp_path / ".prepared.k3x9q2ab" / "fp32").mkdir(parents=True)
    prepare_draft(tiny.target_dir, out, "int8")  # current: kept, and what was left beside it swept
    assert [p.name for p in tmp_path.iterdir()] == ["prepared"]


def test_a_quantized_graph_whose_logits_are_not_finite_is_refused(tiny, tmp_path, monkeypatch) -> None:
    """Only the fp32 graph was held to the tolerance; the quantized one, which is what ships,
    was written whatever its parity said."""
    from specsplit.server.export import ExportParityError

    real = export_mod.parity_check

    def nan_when_quantized(loaded, path):  # type: ignore[no-untyped-def]
        report = real(loaded, path)
        return report if path.parent.name == "fp32" else export_mod.ParityReport(float("nan"), report.top1_agreement)

    monkeypatch.setattr(export_mod, "parity_check", nan_when_quantized)
    with pytest.raises(ExportParityError, match="the int8 graph's logits are not finite"):
        export_draft(str(tiny.target_dir), tmp_path / "draft", quantize="int8")
    assert not (tmp_path / "draft").exists()
