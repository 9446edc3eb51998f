"""The ONNX Runtime draft model with its KV cache; rollback slices the cache's axis 2."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import onnxruntime as ort

from specsplit.common.export_meta import MODEL_FILE, DraftExportMeta


class Drafter(Protocol):
    """What the client drafts with. A drafter that picks tokens without a model may offer
    `next_token(trajectory) -> int` instead, which greedy sessions call inline."""

    def next_logits(self, trajectory: Sequence[int]) -> np.ndarray: ...


class OnnxDrafter:
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
        self.tokens: list[int] = []  # tokens whose keys/values the cache holds
        self._past: list[np.ndarray] = []
        self._last_logits: np.ndarray | None = None
        self.reset()

    def reset(self) -> None:
        empty = np.zeros((1, self.meta.num_kv_heads, 0, self.meta.head_dim), dtype=np.float32)
        self._past = [empty] * len(self._past_names)
        self.tokens = []
        self._last_logits = None

    def _truncate(self, length: int) -> None:
        if length < len(self.tokens):
            self._past = [t[:, :, :length] for t in self._past]
            del self.tokens[length:]
            self._last_logits = None

    def next_logits(self, trajectory: Sequence[int]) -> np.ndarray:
        """Logits for the token after `trajectory`, reusing the cached common prefix."""
        n = min(len(self.tokens), len(trajectory))
        common = 0
        while common < n and self.tokens[common] == trajectory[common]:
            common += 1
        if common == len(trajectory) == len(self.tokens) and self._last_logits is not None:
            return self._last_logits
        keep = min(common, len(trajectory) - 1)
        self._truncate(keep)
        feed_ids = list(trajectory[keep:])
        total = keep + len(feed_ids)
        feed = {
            "input_ids": np.asarray([feed_ids], dtype=np.int64),
            "attention_mask": np.ones((1, total), dtype=np.int64),
            "position_ids": np.arange(keep, total, dtype=np.int64)[None, :],
            **dict(zip(self._past_names, self._past)),
        }
        logits, *present = self._session.run(None, feed)
        self._past = present
        self.tokens = list(trajectory)
        self._last_logits = logits[0, -1].astype(np.float64)
        return self._last_logits
