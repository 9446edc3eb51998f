"""The ONNX Runtime draft model with its KV cache; rollback slices the cache's axis 2.

The drafter keeps a few caches, one per line it drafts along (the main line and a branch
beside it), so that switching between them re-feeds nothing. They cost little: ONNX Runtime
returns fresh arrays each step and a rollback is a view, so caches share what they share.

A line that grows beside another in batched steps keeps its keys where the batch put them:
row 0 or 1 of the batch's arrays, with the columns the other, longer row needed masked out
(`_Cache.mask`). The next batched step then feeds those arrays as they are, where splitting
them after each step and padding them together again before the next copied both caches
twice (31.9 against 30.6 ms a step here, int8 draft). A single-row step drops the padding
once it grows past HOLES_KEPT columns, so that a line that was a padded branch does not
carry it through the rest of the generation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime as ort

from specsplit.common.export_meta import MODEL_FILE, DraftExportMeta
from specsplit.common.prefix import common_prefix


class Drafter(Protocol):
    """What the client drafts with. A drafter that picks tokens without a model may offer
    `next_token(trajectory) -> int` instead, which greedy sessions call inline."""

    def next_logits(self, trajectory: Sequence[int]) -> np.ndarray: ...


@dataclass
class _Cache:
    tokens: list[int] = field(default_factory=list)  # tokens whose keys/values it holds
    past: list[np.ndarray] = field(default_factory=list)
    last_logits: np.ndarray | None = None
    # Per column of `past`: 1 holds a key of this line, 0 is padding left by a batched step.
    mask: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # The batched step's outputs and this line's row in them, while `past` is that row whole.
    batch: tuple[list[np.ndarray], int] | None = None


HOLES_KEPT = 16  # padding columns a line's cache may carry before a single-row step drops them


class OnnxDrafter:
    # The main line, one branch, and the old line a rollback of either forks off: with only
    # two, a rollback of one line pushed the other's cache out, and it was fed again whole.
    CACHES = 3

    def __init__(self, directory: Path, threads: int = 1) -> None:
        self.directory = Path(directory)
        self.meta = DraftExportMeta.load(self.directory)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        self._session = ort.InferenceSession(
            str(self.directory / MODEL_FILE), sess_options=opts, providers=["CPUExecutionProvider"]
        )
        self._past_names = [
            f"past_key_values.{i}.{kind}" for i in range(self.meta.num_layers) for kind in ("key", "value")
        ]
        self._caches: list[_Cache] = []  # least recently used first
        self.reset()

    def reset(self) -> None:
        empty = np.zeros((1, self.meta.num_kv_heads, 0, self.meta.head_dim), dtype=np.float32)
        self._caches = [_Cache(past=[empty] * len(self._past_names))]

    def _cache_for(self, trajectory: Sequence[int]) -> tuple[_Cache, int]:
        """The cache sharing the longest prefix with `trajectory` (the most recent of
        equals), and that length. If the trajectory leaves that cache's line, the cache is
        forked rather than cut back, so its line stays for later; the least recently used
        cache goes when there are too many."""
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
            del self._caches[: -self.CACHES]
        return best, common

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
        """Logits for the token after `trajectory`, reusing the cached common prefix."""
        cache, common = self._cache_for(trajectory)
        if common == len(trajectory) == len(cache.tokens) and cache.last_logits is not None:
            return cache.last_logits
        keep = self._cut_back(cache, common, trajectory)
        if cache.mask.size - keep > HOLES_KEPT:
            columns = cache.mask.astype(bool)
            cache.past, cache.mask = [t[:, :, columns] for t in cache.past], cache.mask[columns]
        feed_ids = list(trajectory[keep:])
        total = keep + len(feed_ids)
        mask = np.concatenate([cache.mask, np.ones(len(feed_ids), dtype=np.int64)])
        feed = {
            "input_ids": np.asarray([feed_ids], dtype=np.int64),
            "attention_mask": mask[None, :],
            "position_ids": np.arange(keep, total, dtype=np.int64)[None, :],
            **dict(zip(self._past_names, cache.past)),
        }
        logits, *present = self._session.run(None, feed)
        cache.past, cache.mask, cache.batch = present, mask, None
        cache.tokens = list(trajectory)
        cache.last_logits = logits[0, -1].astype(np.float64)
        return cache.last_logits

    def next_logits_pair(self, first: Sequence[int], second: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Logits after each of two trajectories (the main line and a branch beside it). When
        each needs one new token over a cache of its own, both go through one run as a batch
        of two rows, which costs about 1.15 one-row runs here (4-bit weights; 1.25 int8), since the weights are read once;
        the shorter cache is padded, and the mask hides the padding."""
        a, common = self._cache_for(first)
        keep_a = self._cut_back(a, common, first)
        b, common = self._cache_for(second)
        keep_b = self._cut_back(b, common, second)
        if a is b or keep_a != len(first) - 1 or keep_b != len(second) - 1:
            return self.next_logits(first), self.next_logits(second)
        if a.batch is not None and b.batch is not None and a.batch[0] is b.batch[0] and a.batch[1] != b.batch[1]:
            # Both rows of the last batched step, uncut since: feed its arrays as they are.
            pasts, rows = a.batch[0], (a.batch[1], b.batch[1])
        else:
            pasts, rows = self._pad_together(a, b), (0, 1)
        masks = np.zeros((2, pasts[0].shape[2] + 1), dtype=np.int64)
        positions = np.zeros((2, 1), dtype=np.int64)
        ids = np.zeros((2, 1), dtype=np.int64)
        for cache, row, trajectory in ((a, rows[0], first), (b, rows[1], second)):
            masks[row, : cache.mask.size], masks[row, -1] = cache.mask, 1
            positions[row], ids[row] = len(trajectory) - 1, trajectory[-1]
        feed = {
            "input_ids": ids,
            "attention_mask": masks,
            "position_ids": positions,
            **dict(zip(self._past_names, pasts)),
        }
        logits, *present = self._session.run(None, feed)
        for cache, row, trajectory in ((a, rows[0], first), (b, rows[1], second)):
            cache.past = [p[row : row + 1] for p in present]
            cache.mask, cache.batch = masks[row], (present, row)
            cache.tokens = list(trajectory)
            cache.last_logits = logits[row, -1].astype(np.float64)
        return a.last_logits, b.last_logits  # type: ignore[return-value]

    @staticmethod
    def _pad_together(a: _Cache, b: _Cache) -> list[np.ndarray]:
        """Two caches as one batch of two rows, the narrower padded at its end (to be masked)."""
        width = max(a.mask.size, b.mask.size)
        pasts = []
        for pa, pb in zip(a.past, b.past):
            batch = np.zeros((2, pa.shape[1], width, pa.shape[3]), dtype=pa.dtype)
            batch[0, :, : pa.shape[2]], batch[1, :, : pb.shape[2]] = pa[0], pb[0]
            pasts.append(batch)
        return pasts
