"""The ONNX Runtime draft model with its KV cache; rollback slices the cache's axis 2.

The drafter keeps a few caches, one per line it drafts along (the main line and a branch
beside it), so that switching between them re-feeds nothing. They cost little: ONNX Runtime
returns fresh arrays each step and a rollback is a view, so caches share what they share.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime as ort

from specsplit.common.export_meta import MODEL_FILE, DraftExportMeta


class Drafter(Protocol):
    """What the client drafts with. A drafter that picks tokens without a model may offer
    `next_token(trajectory) -> int` instead, which greedy sessions call inline."""

    def next_logits(self, trajectory: Sequence[int]) -> np.ndarray: ...


@dataclass
class _Cache:
    tokens: list[int] = field(default_factory=list)  # tokens whose keys/values it holds
    past: list[np.ndarray] = field(default_factory=list)
    last_logits: np.ndarray | None = None

    def common_prefix(self, trajectory: Sequence[int]) -> int:
        n = min(len(self.tokens), len(trajectory))
        common = 0
        while common < n and self.tokens[common] == trajectory[common]:
            common += 1
        return common


class OnnxDrafter:
    CACHES = 2  # the main line and one branch

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
            n = cache.common_prefix(trajectory)
            if n > common:
                best, common = cache, n
        self._caches.remove(best)
        self._caches.append(best)
        if common < len(best.tokens):
            best = _Cache(list(best.tokens), list(best.past), best.last_logits)
            self._caches.append(best)
            del self._caches[: -self.CACHES]
        return best, common

    @staticmethod
    def _cut_back(cache: _Cache, common: int, trajectory: Sequence[int]) -> int:
        """Cut `cache` back to the prefix a run for `trajectory` keeps; returns its length."""
        keep = min(common, len(trajectory) - 1)
        if keep < len(cache.tokens):
            cache.past = [t[:, :, :keep] for t in cache.past]
            del cache.tokens[keep:]
            cache.last_logits = None
        return keep

    def next_logits(self, trajectory: Sequence[int]) -> np.ndarray:
        """Logits for the token after `trajectory`, reusing the cached common prefix."""
        cache, common = self._cache_for(trajectory)
        if common == len(trajectory) == len(cache.tokens) and cache.last_logits is not None:
            return cache.last_logits
        keep = self._cut_back(cache, common, trajectory)
        feed_ids = list(trajectory[keep:])
        total = keep + len(feed_ids)
        feed = {
            "input_ids": np.asarray([feed_ids], dtype=np.int64),
            "attention_mask": np.ones((1, total), dtype=np.int64),
            "position_ids": np.arange(keep, total, dtype=np.int64)[None, :],
            **dict(zip(self._past_names, cache.past)),
        }
        logits, *present = self._session.run(None, feed)
        cache.past = present
        cache.tokens = list(trajectory)
        cache.last_logits = logits[0, -1].astype(np.float64)
        return cache.last_logits

    def next_logits_pair(self, first: Sequence[int], second: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Logits after each of two trajectories (the main line and a branch beside it). When
        each needs one new token over a cache of its own, both go through one run as a batch
        of two rows, which costs about 1.3 one-row runs here, since the weights are read once;
        the shorter cache is padded, and the mask hides the padding."""
        a, common = self._cache_for(first)
        keep_a = self._cut_back(a, common, first)
        b, common = self._cache_for(second)
        keep_b = self._cut_back(b, common, second)
        if a is b or keep_a != len(first) - 1 or keep_b != len(second) - 1:
            return self.next_logits(first), self.next_logits(second)
        width = max(keep_a, keep_b)
        pasts = []
        for pa, pb in zip(a.past, b.past):
            batch = np.zeros((2, pa.shape[1], width, pa.shape[3]), dtype=pa.dtype)
            batch[0, :, :keep_a], batch[1, :, :keep_b] = pa[0], pb[0]
            pasts.append(batch)
        mask = np.zeros((2, width + 1), dtype=np.int64)
        mask[0, :keep_a] = mask[1, :keep_b] = mask[:, width] = 1
        feed = {
            "input_ids": np.asarray([[first[-1]], [second[-1]]], dtype=np.int64),
            "attention_mask": mask,
            "position_ids": np.asarray([[keep_a], [keep_b]], dtype=np.int64),
            **dict(zip(self._past_names, pasts)),
        }
        logits, *present = self._session.run(None, feed)
        for row, (cache, keep, trajectory) in enumerate(((a, keep_a, first), (b, keep_b, second))):
            # This row's keys without the padding: its own, then the new token's.
            cache.past = [np.concatenate([p[row : row + 1, :, :keep], p[row : row + 1, :, width:]], axis=2)
                          for p in present]
            cache.tokens = list(trajectory)
            cache.last_logits = logits[row, -1].astype(np.float64)
        return a.last_logits, b.last_logits  # type: ignore[return-value]
