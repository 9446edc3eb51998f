"""Keys and values of the prompt prefixes that different prompts share.

Requests to one server mostly begin alike: a chat template's system turn (24 of the 37 to 51
tokens of the benchmark's prompts under the default pair's template), a few-shot preamble.
The engine keeps the keys and values of recent prompts, and a new session whose prompt
begins as another one did starts from those positions instead of computing them again: over
the benchmark's 12 prompts on one core of an Intel Xeon, `none`'s time to first token was
518 ms against 884 without it (`bench/results/rtt50-amx*.md`).

Only what a prompt shares with a *different* prompt is taken, never its own earlier keys
past that: this is a cache of what requests have in common, not of whole requests, and a
benchmark that runs the same prompt in several modes gives each mode the same start.

On CPU, made row-invariant (bf16 and fp32), a position's keys and values are the same bits
computed in another prompt's prefill (`tests/test_prefix_cache.py`). On a GPU, where rows
depend on the pass they were computed in, reused keys differ from recomputed ones by
rounding, as a batch's do.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from specsplit.common.prefix import common_prefix

MIN_SHARED = 8  # fewer shared positions than this are computed again: a lookup would save little
MAX_ENTRIES = 64  # prompts kept at most; a new session compares its prompt with each


class PrefixCache:
    """Recent prompts' keys and values ([layers, 2, kv heads, positions, head dim] each), at
    most `max_bytes` of them; the least recently used go first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._bytes = 0
        # Sessions are opened on the event loop's thread, prompts kept on the target's.
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def lookup(self, prompt: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """(n, a copy of the keys and values of `prompt`'s first n positions): the longest
        prefix it shares with another prompt kept here, at most len(prompt) - 1 positions (the
        last must be fed for the row after it), or (0, None) under MIN_SHARED."""
        key = tuple(prompt)
        with self._lock:
            best, source = 0, None
            for tokens in self._entries:
                if tokens != key:
                    shared = common_prefix(tokens, key)
                    if shared > best:
                        best, source = shared, tokens
            best = min(best, len(key) - 1)
            if source is None or best < MIN_SHARED:
                return 0, None
            self._entries.move_to_end(source)
            return best, self._entries[source][:, :, :, :best].clone()

    def keep(self, prompt: Sequence[int], kv: torch.Tensor) -> None:
        """Keep the keys and values of `prompt`, the first len(prompt) positions of `kv`."""
        key = tuple(prompt)
        if len(key) < MIN_SHARED:
            return
        entry = kv[:, :, :, : len(key)].clone()
        size = entry.untyped_storage().nbytes()
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.untyped_storage().nbytes()
            self._entries[key] = entry
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._entries) > MAX_ENTRIES:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.untyped_storage().nbytes()
