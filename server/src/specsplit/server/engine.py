"""The target model: logits for verifications, with a KV cache per session.

The engine knows nothing about protocols or tokenization: it is given sessions'
committed prefixes and the drafts to check, and returns per session one logit row
per draft plus one (or, for greedy sessions, just each row's argmax: on a GPU the
full rows would cost more to copy than the pass). Each cache keeps the longest prefix
it shares with what it is asked for, so a rejection costs a crop, not a recomputation.

Many sessions share one forward pass: their caches are left-padded to a common
length, their new tokens right-padded, and an attention mask hides the padding;
positions stay each session's own, so every row computes what it would alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from specsplit.server.kvcache import cache_from_tensors, cache_tensors, crop_cache, output_cache
from specsplit.server.loading import LoadedModel

PAD_ID = 0  # fed at padded positions; masked out, so any valid id will do


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

    def reusable(self, prefix: Sequence[int], drafts: Sequence[int]) -> int:
        """How many positions of the cache a pass over prefix + drafts keeps. The row for
        position len(prefix) needs the token before it fed, so at most len(prefix) - 1."""
        seq = [*prefix, *drafts]
        return min(common_prefix(self.tokens, seq), len(prefix) - 1)


@dataclass
class VerifyItem:
    """One session's share of a pass."""

    kv: KVState
    prefix: Sequence[int]  # the committed sequence
    drafts: Sequence[int]
    greedy: bool = False  # only the argmax of each row is needed

    def feed_length(self) -> int:
        """Tokens this item puts through the model (the part of it the cache lacks)."""
        return len(self.prefix) + len(self.drafts) - self.kv.reusable(self.prefix, self.drafts)


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

    def verify_logits(self, state: KVState, prefix: Sequence[int], drafts: Sequence[int]) -> np.ndarray:
        """Logit rows predicting positions len(prefix) .. len(prefix) + len(drafts)."""
        return self.verify_batch([VerifyItem(state, prefix, drafts)])[0]

    @torch.inference_mode()
    def verify_batch(self, items: Sequence[VerifyItem]) -> list[np.ndarray]:
        """Per item: its len(drafts) + 1 logit rows (float32), or their argmax ids if greedy."""
        seqs = [[*it.prefix, *it.drafts] for it in items]
        past = []
        for it in items:
            keep = it.kv.reusable(it.prefix, it.drafts)
            it.kv.crop(keep)
            past.append(keep)
        feeds = [seq[keep:] for seq, keep in zip(seqs, past)]
        wanted = [len(it.drafts) + 1 for it in items]
        if len(items) == 1:
            logits, caches = self._forward_one(feeds[0], past[0], items[0].kv.cache, wanted[0])
        else:
            logits, caches = self._forward_padded(feeds, past, [it.kv for it in items], wanted)
        results = []
        for it, seq, rows, cache in zip(items, seqs, logits, caches):
            it.kv.cache, it.kv.tokens = cache, seq
            results.append(rows.argmax(-1).cpu().numpy() if it.greedy else rows.float().cpu().numpy())
        return results

    def _forward_one(self, feed: list[int], past: int, cache: DynamicCache | None, wanted: int):  # type: ignore[no-untyped-def]
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)
        positions = torch.arange(past, past + len(feed), device=self.device).unsqueeze(0)
        # Only the last `wanted` positions need logits: skip the vocabulary projection for
        # the rest (most of a prompt's prefill cost on CPU).
        out = self.model(ids, None, positions, cache if cache is not None else DynamicCache(), use_cache=True,
                         logits_to_keep=wanted)
        return [out.logits[0]], [output_cache(out)]

    def _forward_padded(self, feeds: list[list[int]], past: list[int], states: list[KVState], wanted: list[int]):  # type: ignore[no-untyped-def]
        b, width, longest = len(feeds), max(past), max(len(f) for f in feeds)
        ids = torch.full((b, longest), PAD_ID, dtype=torch.long)
        mask = torch.zeros((b, width + longest), dtype=torch.long)
        positions = torch.zeros((b, longest), dtype=torch.long)
        for i, (feed, p) in enumerate(zip(feeds, past)):
            ids[i, : len(feed)] = torch.tensor(feed)
            mask[i, width - p : width + len(feed)] = 1  # own cache and own new tokens
            positions[i] = torch.arange(p, p + longest)
        cache = self._padded_cache(states, past, width)
        keep = max(longest - len(f) + w for f, w in zip(feeds, wanted))
        out = self.model(ids.to(self.device), mask.to(self.device), positions.to(self.device), cache,
                         use_cache=True, logits_to_keep=keep)
        layers = cache_tensors(output_cache(out))
        logits, caches = [], []
        for i, (feed, p, w) in enumerate(zip(feeds, past, wanted)):
            end = len(feed) - (longest - keep)  # row i's last real position among the kept ones
            logits.append(out.logits[i, end - w : end])
            span = slice(width - p, width + len(feed))
            # Copies, so a session's cache does not hold the whole batch's memory.
            caches.append(cache_from_tensors([(k[i : i + 1, :, span].clone(), v[i : i + 1, :, span].clone())
                                              for k, v in layers]))
        return logits, caches

    def _padded_cache(self, states: list[KVState], past: list[int], width: int) -> DynamicCache:
        """The sessions' caches left-padded with zeros to `width` positions, stacked."""
        if width == 0:
            return DynamicCache()
        rows = [cache_tensors(s.cache) if p else None for s, p in zip(states, past)]
        source = next(r for r in rows if r is not None)
        layers = []
        for layer, (k0, v0) in enumerate(source):
            k = k0.new_zeros((len(states), k0.shape[1], width, k0.shape[3]))
            v = v0.new_zeros((len(states), v0.shape[1], width, v0.shape[3]))
            for i, (row, p) in enumerate(zip(rows, past)):
                if row is not None:
                    k[i, :, width - p :] = row[layer][0][0]
                    v[i, :, width - p :] = row[layer][1][0]
            layers.append((k, v))
        return cache_from_tensors(layers)
