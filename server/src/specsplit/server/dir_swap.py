"""Putting a newly made directory where an older one stands, so that an interruption at any
moment (Ctrl-C, a kill, a full disk) leaves the whole old one, the whole new one, or none,
which the next run makes again. Deleting the old one file by file first could stop part way
and leave its record of what it holds beside a missing model file, which the next run took
as complete."""
from __future__ import annotations

import shutil
from pathlib import Path


def side_name(out: Path) -> Path:
    """Where the old `out` waits while the new one takes its place: hidden beside it."""
    return out.with_name(f".{out.name}.old")


def replace_dir(new: Path, out: Path) -> None:
    """Move the directory `new` to `out`, replacing whatever `out` held (on one filesystem:
    each step is a rename)."""
    side = side_name(out)
    shutil.rmtree(side, ignore_errors=True)  # a run killed after its swap, deleting the old one
    if out.exists():
        out.rename(side)
    new.rename(out)
    shutil.rmtree(side, ignore_errors=True)


def sweep_leftovers(out: Path) -> None:
    """Remove what killed runs left beside `out`: hidden work directories (`.{name}.*`, gigabytes
    for a model) and the old copy a swap had set aside. Only for a caller that alone makes `out`
    (under the model cache's lock): another process's work in progress looks the same."""
    for leftover in out.parent.glob(f".{out.name}.*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
