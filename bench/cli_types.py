"""Argument types for the benchmark scripts' command lines.

A value no run could use is refused while the arguments are parsed, as one usage line,
instead of surfacing as a traceback after models have loaded or a sweep has run.
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from specsplit.common.address import check_host_port
from specsplit.common.export_meta import DraftExportMeta


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}")
    return value


def at_least(low: float, kind: type = int, above: bool = False) -> Callable[[str], float]:
    """A number no lower than `low` (or above it, where `above`)."""

    def parse(text: str) -> float:
        value = _number(text, kind)
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be {'above' if above else 'at least'} {low}, got {text}")
        return value

    return parse


def between(low: int, high: int) -> Callable[[str], int]:
    """An integer from `low` to `high`."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text}")
        return value

    return parse


def fraction(text: str) -> float:
    """A probability: a number from 0 to 1."""
    value = _number(text, float)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """'1,2,4' or '0-3' (or a mix) as integers, at least one, none negative."""
    out: list[int] = []
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            if hi and int(hi) < int(lo):
                raise argparse.ArgumentTypeError(f"the range {part} runs backwards: give {hi}-{lo}")
            out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"give integers separated by commas, or ranges such as 4-7: {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"give at least one integer: {text!r}")
    return tuple(out)


# The cores this process could use when it started (empty where the OS does not say). A
# driver pins itself to the edge's core afterwards (the benchmark does, to keep off the
# server's core); its children must still be placed on the cores it gave up, so they are
# checked against this set, not the current one.
START_CORES = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def check_cores(chosen: Iterable[int]) -> None:
    """Raise ValueError for a core this process may not use: pinning to it would fail, or
    leave the process unpinned while its report says otherwise."""
    missing = sorted(set(chosen) - START_CORES) if START_CORES else []
    if missing:
        raise ValueError(f"core(s) {missing} not available here (available: {sorted(START_CORES)})")


def cores(text: str) -> tuple[int, ...]:
    """Cores to pin to, each one this process may run on."""
    chosen = int_list(text)
    try:
        check_cores(chosen)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return chosen


def core(text: str) -> int:
    """One core to pin to (see `cores`)."""
    chosen = cores(text)
    if len(chosen) != 1:
        raise argparse.ArgumentTypeError(f"give one core, got {text!r}")
    return chosen[0]


def report_name(text: str) -> str:
    """A results name: the stem of NAME.json and NAME.md in the output directory."""
    if not text or text in (".", "..") or Path(text).name != text:
        raise argparse.ArgumentTypeError(f"give a file name without a directory (the directory is its own option): {text!r}")
    return text


def out_dir(text: str) -> Path:
    """An output directory: made if missing, but neither a file already there nor under one,
    and one this process may write (found now, not once a run of minutes ends)."""
    path = Path(text)
    for place in (path.absolute(), *path.absolute().parents):
        if place.exists():
            if not place.is_dir():
                raise argparse.ArgumentTypeError(f"{place} is a file, not a directory" if place == path.absolute()
                                                 else f"{text} cannot be made: {place} is a file")
            if not os.access(place, os.W_OK | os.X_OK):
                raise argparse.ArgumentTypeError(f"{text} cannot be written: {place} is not writable here")
            break
    return path


def model_dir(text: str) -> Path:
    """A Hugging Face model directory (its config.json in it)."""
    path = Path(text)
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"not a model directory (no config.json): {text}")
    return path


def draft_export(text: str) -> Path:
    """A draft exported by `specsplit-server export-draft`."""
    path = Path(text)
    try:
        DraftExportMeta.load(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # missing, or not the metadata an export writes
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def host_port(text: str) -> str:
    """HOST:PORT with a port from 1 to 65535 (`check_host_port`, as the edge takes it)."""
    try:
        check_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}: {text!r}") from None
    return text


def port(text: str) -> int:
    """A port to listen on: 0 (any free one) to 65535."""
    value = int(_number(text, int))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"give a port from 0 to 65535, got {text}")
    return value
