"""The target model: logits for a verification, with a per-session KV cache.

The engine knows nothing about protocols or tokenization: it is given a session's
committed prefix and the drafts to check, and returns one logit row per draft plus
one. The cache keeps the longest prefix it shares with what it is asked for, so a
rejection costs a crop, not a recomputation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from specsplit.server.kvcache import cache_tensors, crop_cache, output_cache
from specsplit.server.loading import LoadedModel


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class KVState:
    """One session's cache and the tokens whose keys and values it holds."""

    cache: DynamicCache | None = None
    tokens: list[int] = field(default_factory=list)

    def crop(self, length: int) -> None:
        if length == 0:
            self.cache = None
        elif self.cache is not None and length < len(self.tokens):
            crop_cache(self.cache, length)
        del self.tokens[length:]

    def nbytes(self) -> int:
        if self.cache is None:
            return 0
        return sum(k.nbytes + v.nbytes for k, v in cache_tensors(self.cache))


class TargetEngine:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 32768))

    @torch.inference_mode()
    def verify_logits(self, state: KVState, prefix: Sequence[int], drafts: Sequence[int]) -> np.ndarray:
        """Logit rows predicting positions len(prefix) .. len(prefix) + len(drafts).

        `prefix` is the committed sequence; the cache is reused for the part of it
        (and of earlier drafts) it already holds.
        """
        seq = [*prefix, *drafts]
        # The row for position len(prefix) needs the token before it fed, so keep at most len(prefix) - 1.
        keep = min(common_prefix(state.tokens, seq), len(prefix) - 1)
        state.crop(keep)
        feed = torch.tensor([seq[keep:]], dtype=torch.long, device=self.device)
        positions = torch.arange(keep, len(seq), device=self.device).unsqueeze(0)
        cache = state.cache if state.cache is not None else DynamicCache()
        # Only the last len(drafts) + 1 positions need logits: skip the vocabulary
        # projection for the rest (most of a prompt's prefill cost on CPU).
        out = self.model(feed, None, positions, cache, use_cache=True, logits_to_keep=len(drafts) + 1)
        state.cache = output_cache(out)
        state.tokens = seq
        rows = out.logits[0, -(len(drafts) + 1) :]
        return rows.float().cpu().numpy()
