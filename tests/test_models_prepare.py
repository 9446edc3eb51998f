"""Preparing the pair: what is saved loads back as the same model, a checkpoint that lacks
weights is refused instead of served with random ones, and mistakes show before any download."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specsplit.server import cli as server_cli
from specsplit.server import models
from specsplit.server.loading import MissingWeights, load_model
from specsplit.server.models import PREPARED_FORMAT, prepare_target


def _logits(path: str) -> torch.Tensor:
    model = load_model(path, dtype="bf16").model
    with torch.inference_mode():
        return model(torch.tensor([[5, 6, 7, 8, 9]])).logits.float()


def test_a_prepared_bf16_target_loads_back_with_every_weight(tiny, tmp_path) -> None:
    """bf16 on CPU is served with wrappers around every linear layer; the prepared directory
    holds the plain model (a wrapped one saved every linear weight under another name, and
    loading it back left them all random)."""
    out = prepare_target(tiny.target_dir, tmp_path / "prepared", dtype="bf16")
    assert json.loads((out / "specsplit-prepared.json").read_text())["format"] == PREPARED_FORMAT
    assert not any(".linear." in key for key in load_file(str(out / "model.safetensors")))
    assert torch.equal(_logits(str(out)), _logits(str(tiny.target_dir)))


def test_a_directory_prepared_by_an_older_format_is_made_again(tiny, tmp_path) -> None:
    out = prepare_target(tiny.target_dir, tmp_path / "prepared", dtype="bf16")
    marker, sentinel = out / "specsplit-prepared.json", out / "sentinel"
    made = json.loads(marker.read_text())
    sentinel.touch()  # gone if the directory is made again (it is written beside and swapped in)
    assert prepare_target(tiny.target_dir, out, dtype="bf16") == out  # current: kept
    assert sentinel.exists()
    marker.write_text(json.dumps({k: v for k, v in made.items() if k != "format"}))  # as format 1 wrote it
    prepare_target(tiny.target_dir, out, dtype="bf16")
    assert not sentinel.exists()
    assert json.loads(marker.read_text())["format"] == PREPARED_FORMAT


def test_a_checkpoint_that_lacks_weights_is_refused(tiny, tmp_path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny.target_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    key = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[key.replace("q_proj.", "q_proj.linear.")] = weights.pop(key)  # what format 1 saved
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingWeights, match="lacks 1 of the model's weights"):
        load_model(str(broken))


@pytest.mark.parametrize("damage", ["cut-weights", "config-field"])
def test_a_damaged_checkpoint_is_one_error_line(tiny, tmp_path, capsys, damage) -> None:
    """Both were a traceback (safetensors' and huggingface_hub's own errors, no ValueErrors)."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny.target_dir, broken)
    if damage == "cut-weights":
        with open(broken / "model.safetensors", "r+b") as weights:
            weights.truncate(1000)
    else:
        config = json.loads((broken / "config.json").read_text())
        config["num_hidden_layers"] = "two"
        (broken / "config.json").write_text(json.dumps(config))
    assert server_cli.main(["serve", "--target", str(broken), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"cannot load the target {broken}" in err and "cannot read it as a model" in err
    assert "Traceback" not in err


def test_a_missing_source_is_refused_before_anything_is_pulled(tmp_path, monkeypatch) -> None:
    def pulled(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the default pair was pulled first")

    monkeypatch.setattr(models, "pull_one", pulled)
    with pytest.raises(FileNotFoundError, match="--target /no/such/target does not exist"):
        models.prepare(root=tmp_path, target_source="/no/such/target")
    with pytest.raises(FileNotFoundError, match="--draft ./missing.gguf does not exist"):
        models.prepare(root=tmp_path, draft_source="./missing.gguf")
    with pytest.raises(KeyError, match="unknown model pair"):
        models.prepare("no-such-pair", root=tmp_path)
    (tmp_path / "not-a-model").mkdir()  # read only at the end, after the draft's pull and export
    with pytest.raises(FileNotFoundError, match="--target .*not-a-model holds no config.json"):
        models.prepare(root=tmp_path, target_source=str(tmp_path / "not-a-model"))


def test_loading_and_preparing_read_a_source_by_one_rule(tiny, tmp_path, monkeypatch) -> None:
    # Written as a path and missing: refused before transformers takes it for a hub id.
    for missing in (".hidden/model", "../no/such/model", "nowhere.gguf", "~/no/such/model", "no-such-model"):
        with pytest.raises(FileNotFoundError, match=f"model {missing} does not exist"):
            load_model(missing)
    monkeypatch.setenv("HOME", str(tiny.target_dir.parent))
    assert load_model(f"~/{tiny.target_dir.name}").fingerprint == load_model(str(tiny.target_dir)).fingerprint
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a GGUF file"):
        load_model(str(tmp_path / "dir.gguf"))
    # Paths written without ./ (each was looked up on the hub, a minute of retries offline):
    # more parts than ORG/NAME, or an ORG that is a directory here.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for typo in ("models/tiny_typo", "exports/drafts/tiny"):
        with pytest.raises(FileNotFoundError, match=f"model {typo} does not exist \\(a path"):
            load_model(typo)


def test_a_draft_exported_with_another_tokenizer_is_refused(tiny, tmp_path) -> None:
    models.check_same_tokenizer(tiny.target_dir, tiny.draft_dir)  # the tiny pair shares one
    other = tmp_path / "other-draft"
    shutil.copytree(tiny.draft_dir, other)
    meta = json.loads((other / "specsplit.json").read_text())
    meta["tokenizer_fingerprint"] = "0" * 16
    (other / "specsplit.json").write_text(json.dumps(meta))
    with pytest.raises(models.TokenizerMismatch, match="has another tokenizer than the target"):
        models.check_same_tokenizer(tiny.target_dir, other)


def test_models_prepare_turns_the_users_errors_into_one_line_and_no_other(tmp_path, monkeypatch, capsys) -> None:
    """A pair whose tokenizers differ is the user's to mend: one line, exit 2. An error of
    ours (any other ValueError) must not pass for one."""
    def mismatched(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise models.TokenizerMismatch("the draft D has another tokenizer than the target T")

    monkeypatch.setattr(models, "prepare", mismatched)
    assert server_cli.main(["models", "prepare", "--cache-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: the draft D has another tokenizer than the target T\n"

    def faulty(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("a fault of ours")

    monkeypatch.setattr(models, "prepare", faulty)
    with pytest.raises(ValueError, match="a fault of ours"):
        server_cli.main(["models", "prepare", "--cache-dir", str(tmp_path)])


def test_a_draft_that_fails_its_parity_check_is_one_error_line(tmp_path, monkeypatch, capsys) -> None:
    """export-draft said so in one line; models prepare --draft showed a traceback."""
    from specsplit.server.export import ExportParityError

    def refused(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ExportParityError("ONNX Runtime logits differ from torch by 1e+00 (tolerance 1e-03); refusing")

    monkeypatch.setattr(models, "prepare", refused)
    assert server_cli.main(["models", "prepare", "--cache-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == "error: ONNX Runtime logits differ from torch by 1e+00 (tolerance 1e-03); refusing\n"


@pytest.mark.parametrize("failure", ["disk-full", "interrupted"])
def test_a_target_whose_saving_fails_leaves_no_copy_behind(tiny, tmp_path, monkeypatch, failure) -> None:
    """The bf16 copy (several GB for the default target) was left beside the output when its
    saving failed or was interrupted; a full disk showed as safetensors' own traceback."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def failing(self, directory, **kwargs):  # type: ignore[no-untyped-def]
        real(self, directory, **kwargs)  # the weights written, then it fails
        raise (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
               if failure == "disk-full" else KeyboardInterrupt())

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", failing)
    expected = (OSError, "writing .*prepared failed .*No space left") if failure == "disk-full" else (KeyboardInterrupt, None)
    with pytest.raises(expected[0], match=expected[1]):
        prepare_target(tiny.target_dir, tmp_path / "prepared", dtype="bf16")
    assert list(tmp_path.iterdir()) == []


def test_a_sources_checksum_covers_its_config_and_tokenizer_and_expands_home(tiny, tmp_path, monkeypatch) -> None:
    """Only a directory's weights were hashed, so an export made before its tokenizer was
    edited was reused; and "~/x" was hashed unexpanded, as no file: "" matched nothing."""
    from specsplit.server.loading import source_sha256

    source = tmp_path / "source"
    shutil.copytree(tiny.target_dir, source)
    before = source_sha256(str(source))
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    (source / "tokenizer.json").write_text(json.dumps(tokenizer | {"truncation": {"max_length": 7, "strategy": "longest_first",
                                                                                   "stride": 0, "direction": "right"}}))
    assert source_sha256(str(source)) != before
    monkeypatch.setenv("HOME", str(tmp_path))
    assert source_sha256("~/source") == source_sha256(str(source)) != ""


def test_a_replacement_stopped_while_the_old_copy_is_deleted_leaves_the_new_one_whole(tiny, tmp_path, monkeypatch) -> None:
    """The old directory was deleted file by file before the new one took its place: a stop
    part way (Ctrl-C, a kill) could leave its record beside a missing model file, which every
    later prepare took as complete ("already prepared"), and serving failed."""
    out = prepare_target(tiny.target_dir, tmp_path / "prepared", dtype="bf16")
    marker = out / "specsplit-prepared.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "format": 1}))  # to be made again
    real = shutil.rmtree

    def stopped(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        weights = Path(path) / "model.safetensors"
        if weights.exists():  # the old copy's weights go first, then the stop
            weights.unlink()
            raise KeyboardInterrupt
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt):
        prepare_target(tiny.target_dir, out, dtype="bf16")
    monkeypatch.setattr(shutil, "rmtree", real)
    assert json.loads(marker.read_text())["format"] == PREPARED_FORMAT
    assert (out / "model.safetensors").is_file()  # the new copy, whole
    assert prepare_target(tiny.target_dir, out, dtype="bf16") == out  # kept as it is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]  # the old copy's rest swept
    assert torch.equal(_logits(str(out)), _logits(str(tiny.target_dir)))


def test_what_killed_runs_left_beside_a_prepared_directory_is_swept(tiny, tmp_path) -> None:
    """A killed export's hidden work directory (2 GB for the default draft) had a name of its
    own each time and was never removed: each killed run left another."""
    out = prepare_target(tiny.target_dir, tmp_path / "prepared", dtype="bf16")
    for leftover in (".prepared.k3x9q2ab", ".prepared.old", ".prepared.tmp"):
        (tmp_path / leftover / "fp32").mkdir(parents=True)
        (tmp_path / leftover / "fp32" / "model.onnx").write_bytes(b"\0" * 1024)
    (tmp_path / ".prepared-other.k3x9q2ab").mkdir()  # another directory's: not this one's to sweep
    assert prepare_target(tiny.target_dir, out, dtype="bf16") == out
    assert sorted(p.name for p in tmp_path.iterdir()) == [".prepared-other.k3x9q2ab", "prepared"]


def test_a_cache_on_a_read_only_file_system_is_read_without_its_lock(tmp_path, monkeypatch) -> None:
    """A volume mounted read-only raises EROFS, not the PermissionError that was caught: the
    edge's container could not even look up the prepared paths."""
    import errno

    def read_only(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(models, "open", read_only, raising=False)
    with models.cache_lock(tmp_path):
        pass


def test_the_demo_says_a_failed_download_in_one_line(monkeypatch, capsys) -> None:
    """`make demo` on a machine without a package index showed a traceback with pip's output
    inside; the benchmarks' preparation now ends as `models prepare` does."""
    import demo

    def unreachable(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise models.DownloadError("pip could not download specsplit-models-qwen2.5-coder-0.5b: no index")

    monkeypatch.setattr(models, "prepare", unreachable)
    with pytest.raises(SystemExit) as ended:
        demo.main([])
    assert ended.value.code == 1
    assert capsys.readouterr().err == "error: pip could not download specsplit-models-qwen2.5-coder-0.5b: no index\n"


def test_a_pulled_source_is_not_hashed_again_to_find_its_preparation_current(tiny, tmp_path, monkeypatch) -> None:
    """Each prepare hashed both GGUF files (1.6 GB for the default pair, tens of seconds on a
    board's SD card) though the pull had just found them verified by their recorded checksum."""
    from specsplit.common.export_meta import DraftExportMeta
    from specsplit.server import loading
    from specsplit.server.models import prepare_draft

    target = prepare_target(tiny.target_dir, tmp_path / "target", dtype="bf16", sha256="a" * 64)
    draft = prepare_draft(tiny.target_dir, tmp_path / "draft", "int8")
    recorded = DraftExportMeta.load(draft).source_sha256
    stamps = [(d / name).stat().st_mtime_ns for d, name in ((target, "model.safetensors"), (draft, "model.onnx"))]

    def hashed(path: str) -> str:
        raise AssertionError(f"{path} was hashed again")

    monkeypatch.setattr(loading, "source_sha256", hashed)
    assert prepare_target(tiny.target_dir, target, dtype="bf16", sha256="a" * 64) == target
    assert prepare_draft(tiny.target_dir, draft, "int8", sha256=recorded) == draft
    assert [(d / name).stat().st_mtime_ns for d, name in ((target, "model.safetensors"), (draft, "model.onnx"))] == stamps
    # prepare hands each pulled file's checksum on, from its spec
    given: dict[str, str | None] = {}
    monkeypatch.setattr(models, "pull_one", lambda spec, root: tmp_path / spec.filename)
    monkeypatch.setattr(models, "prepare_target", lambda gguf, out, sha256=None: given.setdefault("target", sha256) and out)
    monkeypatch.setattr(models, "prepare_draft", lambda gguf, out, q, sha256=None: given.setdefault("draft", sha256) and out)
    monkeypatch.setattr(models, "check_same_tokenizer", lambda target, draft: None)
    models.prepare(root=tmp_path / "cache")
    draft_spec, target_spec = models._specs(models.DEFAULT_PAIR)
    assert given == {"target": target_spec.sha256, "draft": draft_spec.sha256}
