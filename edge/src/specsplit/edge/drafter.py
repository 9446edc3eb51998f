"""The ONNX Runtime draft model with its KV cache; rollback slices the cache's axis 2.

The drafter keeps a few caches, one per line it drafts along (the main line and the
branches beside it), so that switching between them re-feeds nothing. They cost little: ONNX
Runtime returns fresh arrays each step and a rollback is a view, so caches share what they share.

A line that grows beside others in batched steps keeps its keys where the batch put them:
its row of the batch's arrays, with the columns other, longer rows needed masked out
(`_Cache.mask`). The next batched step of the same lines then feeds those arrays as they
are, where splitting them after each step and padding them together again before the next
copied every cache twice (31.9 against 30.6 ms a two-row step here, int8 draft). A
single-row step drops the padding once it grows past HOLES_KEPT columns, so that a line
that was a padded branch does not carry it through the rest of the generation.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from specsplit.common.export_meta import INPUTS, META_FILE, MODEL_FILE, DraftExportMeta, past_names
from specsplit.common.prefix import common_prefix
from specsplit.edge.runtime import ort


class Drafter(Protocol):
    """What the client drafts with. It may also be a TokenPicker, a BranchOffering or a
    BatchDrafter, which the client uses where it is."""

    def next_logits(self, trajectory: Sequence[int]) -> np.ndarray: ...


@runtime_checkable
class TokenPicker(Protocol):
    """A drafter that picks tokens without a model (prompt lookup, the load test's simulated
    edges): greedy sessions call it inline instead of next_logits."""

    def next_token(self, trajectory: Sequence[int]) -> int: ...


@runtime_checkable
class BranchOffering(Protocol):
    """A TokenPicker that offers branches itself (it has no runner-up to draft them from)."""

    def branch_beside(self, position: int, drafted: int, length: int) -> tuple[int, ...] | None:
        """None where the draft at `position` is right, else the branch to send beside it, up
        to `length` tokens (() for none)."""


@runtime_checkable
class VocabSized(Protocol):
    """A drafter that says how many token ids it can read (its embedding's rows)."""

    @property
    def vocab_size(self) -> int: ...


@runtime_checkable
class EndAware(Protocol):
    """A drafter that knows its tokenizer's end-of-sequence ids: the edge drafts nothing past
    one (EdgeSession's end_ids)."""

    @property
    def eos_ids(self) -> tuple[int, ...]: ...


@runtime_checkable
class BatchDrafter(Protocol):
    """A drafter that steps several trajectories (the main line and its branches) in one run."""

    def next_logits_batch(self, trajectories: Sequence[Sequence[int]]) -> list[np.ndarray]: ...


@dataclass(eq=False)  # caches are told apart by identity: comparing their arrays would fail
class _Cache:
    tokens: list[int] = field(default_factory=list)  # tokens whose keys/values it holds
    past: list[np.ndarray] = field(default_factory=list)
    last_logits: np.ndarray | None = None
    # Per column of `past`: 1 holds a key of this line, 0 is padding left by a batched step.
    mask: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # The batched step's outputs and this line's row in them, while `past` is that row whole.
    batch: tuple[list[np.ndarray], int] | None = None


HOLES_KEPT = 16  # padding columns a line's cache may carry before a single-row step drops them


BRANCHES = 2  # branches beside the main line that the drafter keeps a cache for


def _check_not_empty(trajectory: Sequence[int]) -> None:
    if len(trajectory) == 0:
        raise ValueError("a trajectory needs at least one token: there is no next one to draft after none")


def _read_only(logits: np.ndarray) -> np.ndarray:
    """Cached logits are handed out as they are, to every caller that asks again."""
    logits.flags.writeable = False
    return logits


def allowed_cores() -> int:
    """The cores this process may run on (taskset, a container's cpuset): what ONNX Runtime's
    own default (0) ignores, starting a thread for every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class OnnxDrafter:
    # The main line, its branches, and the old line a rollback of any forks off: with one
    # fewer, a rollback of one line pushed another's cache out, and it was fed again whole.
    CACHES = BRANCHES + 2

    def __init__(self, directory: Path, threads: int = 1) -> None:
        self.directory = Path(directory)
        self.meta = DraftExportMeta.load(self.directory)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or allowed_cores()
        opts.inter_op_num_threads = 1
        model = self.directory / MODEL_FILE
        if not model.is_file():
            raise FileNotFoundError(f"{self.directory} has no {MODEL_FILE}: copy the whole draft export over")
        try:
            self._session = ort.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ONNX Runtime's own exception types, one per kind of failure
            raise ValueError(f"ONNX Runtime cannot load {model} ({type(exc).__name__}: {exc}); "
                             "a truncated copy? export the draft again") from None
        self._past_names = past_names(self.meta.num_layers)
        expected, taken = {*INPUTS, *self._past_names}, {i.name for i in self._session.get_inputs()}
        # Either way the first draft step fails, once the server has opened the session.
        if missing := sorted(expected - taken):
            raise ValueError(f"{model} does not take the inputs its {META_FILE} describes (no {', '.join(missing[:3])}): "
                             "its model and metadata come from different exports")
        if extra := sorted(taken - expected):
            raise ValueError(f"{model} takes inputs its {META_FILE} does not describe ({', '.join(extra[:3])}): "
                             "its model and metadata come from different exports")
        self._check_cache_shape(model)
        self._caches: list[_Cache] = []  # least recently used first
        # Generations run their drafting in threads of their own; one drafter shared by
        # several takes their steps one at a time, as its caches must be.
        self._lock = threading.Lock()
        self.reset()

    def _check_cache_shape(self, model: Path) -> None:
        """ValueError where the graph's cache inputs have other heads or head sizes than the
        metadata says: the first drafting step would fail, a session already open."""
        shapes = {i.name: i.shape for i in self._session.get_inputs()}
        for name in self._past_names:
            if len(shapes[name]) != 4:
                raise ValueError(f"{model} takes {name} with {len(shapes[name])} axes, not (batch, heads, "
                                 "positions, head size): not a specsplit draft export")
            heads, dim = shapes[name][1], shapes[name][3]
            for axis, size, field in ((heads, self.meta.num_kv_heads, "num_kv_heads"), (dim, self.meta.head_dim, "head_dim")):
                if isinstance(axis, int) and axis != size:  # a named (dynamic) axis takes any size
                    raise ValueError(f"{model} takes {name} with {axis} where its {META_FILE} says {field} {size}: "
                                     "its model and metadata come from different exports")

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.meta.eos_ids

    def reset(self) -> None:
        empty = np.zeros((1, self.meta.num_kv_heads, 0, self.meta.head_dim), dtype=np.float32)
        with self._lock:
            self._caches = [_Cache(past=[empty] * len(self._past_names))]

    def _cache_for(self, trajectory: Sequence[int]) -> tuple[_Cache, int]:
        """The cache sharing the longest prefix with `trajectory` (the most recent of
        equals), and that length. If the trajectory leaves that cache's line, the cache is
        forked rather than cut back, so its line stays for later (until _trim)."""
        best, common = self._caches[-1], -1
        for cache in reversed(self._caches):
            n = common_prefix(cache.tokens, trajectory)
            if n > common:
                best, common = cache, n
        self._caches.remove(best)
        self._caches.append(best)
        if common < len(best.tokens):
            best = _Cache(list(best.tokens), list(best.past), best.last_logits, best.mask)  # to be cut: no batch
            self._caches.append(best)
        return best, common

    def _trim(self, in_use: Sequence[_Cache]) -> None:
        """Drop the least recently used caches past CACHES, never one that the step is using.
        A batched step chooses all its rows' caches before any goes: trimming after each
        choice dropped the line a later row would fork off, or the main line's own fork."""
        spare = [c for c in self._caches if c not in in_use][: max(0, len(self._caches) - self.CACHES)]
        self._caches = [c for c in self._caches if c not in spare]

    @staticmethod
    def _cut_back(cache: _Cache, common: int, trajectory: Sequence[int]) -> int:
        """Cut `cache` back to the prefix a run for `trajectory` keeps; returns its length."""
        keep = min(common, len(trajectory) - 1)
        if keep < len(cache.tokens):
            # Cut after the keep-th key of the line, past any padding before it.
            cut = int(np.flatnonzero(cache.mask)[keep - 1]) + 1 if keep else 0
            cache.past = [t[:, :, :cut] for t in cache.past]
            cache.mask = cache.mask[:cut]
            cache.batch = None
            del cache.tokens[keep:]
            cache.last_logits = None
        return keep

    def next_logits(self, trajectory: Sequence[int]) -> np.ndarray:
        """Logits for the token after `trajectory`, reusing the cached common prefix. The
        array is the cache's own, read-only: the next call for the same trajectory returns it."""
        _check_not_empty(trajectory)
        with self._lock:
            return self._next_logits(trajectory)

    def _check_fed(self, ids: Sequence[int]) -> None:
        """ValueError for ids the model cannot take: ONNX Runtime's Gather would read a negative
        one from the vocabulary's end. Only the ids a step feeds: the cached ones were fed before."""
        if not 0 <= min(ids) <= max(ids) < self.meta.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.meta.vocab_size)
            raise ValueError(f"token id {bad} is outside the draft's vocabulary [0, {self.meta.vocab_size})")

    def _next_logits(self, trajectory: Sequence[int]) -> np.ndarray:
        cache, common = self._cache_for(trajectory)
        self._trim([cache])
        if common == len(trajectory) == len(cache.tokens) and cache.last_logits is not None:
            return cache.last_logits
        keep = self._cut_back(cache, common, trajectory)
        if cache.mask.size - keep > HOLES_KEPT:
            columns = cache.mask.astype(bool)
            cache.past, cache.mask = [t[:, :, columns] for t in cache.past], cache.mask[columns]
        feed_ids = list(trajectory[keep:])
        self._check_fed(feed_ids)
        total = keep + len(feed_ids)
        mask = np.concatenate([cache.mask, np.ones(len(feed_ids), dtype=np.int64)])
        feed = {
            **dict(zip(INPUTS, (np.asarray([feed_ids], dtype=np.int64), mask[None, :],
                                np.arange(keep, total, dtype=np.int64)[None, :]))),
            **dict(zip(self._past_names, cache.past)),
        }
        logits, *present = self._session.run(None, feed)
        cache.past, cache.mask, cache.batch = present, mask, None
        cache.tokens = list(trajectory)
        cache.last_logits = _read_only(logits[0, -1].astype(np.float64))
        return cache.last_logits

    def next_logits_batch(self, trajectories: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Logits after each of a few trajectories (the main line and branches beside it).
        When each needs one new token over a cache of its own, all go through one run as a
        batch, one row each, which costs far less than a run per row (two rows about 1.15
        one-row runs here, 4-bit weights; 1.25 int8), since the weights are read once; the
        shorter caches are padded, and the mask hides the padding."""
        for trajectory in trajectories:
            _check_not_empty(trajectory)
        with self._lock:
            return self._next_logits_batch(trajectories)

    def _next_logits_batch(self, trajectories: Sequence[Sequence[int]]) -> list[np.ndarray]:
        caches = []
        for trajectory in trajectories:
            cache, common = self._cache_for(trajectory)
            caches.append((cache, self._cut_back(cache, common, trajectory)))
        self._trim([c for c, _ in caches])
        if len({id(c) for c, _ in caches}) < len(caches) or any(
                keep != len(t) - 1 for (_, keep), t in zip(caches, trajectories)):
            return [self._next_logits(t) for t in trajectories]
        self._check_fed([t[-1] for t in trajectories])
        last = caches[0][0].batch
        rows = [c.batch[1] if c.batch is not None and last is not None and c.batch[0] is last[0] else -1
                for c, _ in caches]
        if last is not None and sorted(rows) == list(range(last[0][0].shape[0])):
            pasts = last[0]  # the rows of the last batched step, uncut since: feed its arrays as they are
        else:
            pasts, rows = self._pad_together([c for c, _ in caches]), list(range(len(caches)))
        masks = np.zeros((len(caches), pasts[0].shape[2] + 1), dtype=np.int64)
        positions = np.zeros((len(caches), 1), dtype=np.int64)
        ids = np.zeros((len(caches), 1), dtype=np.int64)
        for (cache, _), row, trajectory in zip(caches, rows, trajectories):
            masks[row, : cache.mask.size], masks[row, -1] = cache.mask, 1
            positions[row], ids[row] = len(trajectory) - 1, trajectory[-1]
        feed = {**dict(zip(INPUTS, (ids, masks, positions))), **dict(zip(self._past_names, pasts))}
        logits, *present = self._session.run(None, feed)
        for (cache, _), row, trajectory in zip(caches, rows, trajectories):
            cache.past = [p[row : row + 1] for p in present]
            cache.mask, cache.batch = masks[row], (present, row)
            cache.tokens = list(trajectory)
            cache.last_logits = _read_only(logits[row, -1].astype(np.float64))
        return [c.last_logits for c, _ in caches]  # type: ignore[misc]

    @staticmethod
    def _pad_together(caches: Sequence[_Cache]) -> list[np.ndarray]:
        """Caches as one batch, a row each, the narrower padded at their end (to be masked)."""
        width = max(c.mask.size for c in caches)
        pasts = []
        for layer in zip(*(c.past for c in caches)):
            batch = np.zeros((len(caches), layer[0].shape[1], width, layer[0].shape[3]), dtype=layer[0].dtype)
            for row, past in enumerate(layer):
                batch[row, :, : past.shape[2]] = past[0]
            pasts.append(batch)
        return pasts
