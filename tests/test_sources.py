"""How the server tells a model source's kind, and what name it gives edges."""
from __future__ import annotations

import pytest

from specsplit.server.sources import local_source, served_name


def test_edges_are_told_a_local_model_by_its_name_and_a_hub_model_by_its_id(tmp_path, monkeypatch) -> None:
    model = tmp_path / "models" / "coder-1.5b"
    model.mkdir(parents=True)
    (tmp_path / "models" / "coder.gguf").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert served_name(str(model)) == "coder-1.5b"
    assert served_name(str(model) + "/") == "coder-1.5b"
    assert served_name(str(tmp_path / "models" / "coder.gguf")) == "coder.gguf"
    assert served_name("~/models/coder-1.5b") == "coder-1.5b"
    monkeypatch.chdir(tmp_path / "models")
    assert served_name("coder-1.5b") == "coder-1.5b" and served_name(".") == "models"
    assert served_name("Qwen/Qwen2.5-Coder-1.5B-Instruct") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    blob = tmp_path / "blobs" / "7f3a9c"
    blob.parent.mkdir()
    blob.write_text("")
    (tmp_path / "models" / "model.gguf").symlink_to(blob)  # as a hub cache keeps its files
    assert served_name(str(tmp_path / "models" / "model.gguf")) == "model.gguf"


def test_a_missing_path_or_bare_name_is_no_hub_id(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        local_source(str(tmp_path / "nothing"), "--target")
    with pytest.raises(FileNotFoundError, match="a hub id is written ORG/NAME"):
        local_source("nothing-here", "--target")
    assert local_source("Qwen/Qwen2.5-Coder-1.5B-Instruct", "--target") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
