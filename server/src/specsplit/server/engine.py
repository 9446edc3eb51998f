"""The target model: logits for verifications, with a KV cache per session.

The engine knows nothing about protocols or tokenization: it is given sessions'
committed prefixes and the drafts to check, and returns per session one logit row
per draft plus one (or, for greedy sessions, just each row's argmax: on a GPU the
full rows would cost more to copy than the pass). Each cache keeps the longest prefix
it shares with what it is asked for, so a rejection costs a crop, not a recomputation.

Many sessions share one forward pass: their caches are left-padded to a common
length, their new tokens right-padded, and an attention mask hides the padding;
positions stay each session's own, so every row computes what it would alone. Padded,
one long context among short ones makes every row as long (64 sessions beside one of 32k
positions: some 120 GB for the default target in fp32), so a pass whose padded cache would
take more than its limit goes as several, sessions of like length together
(`max_pass_cache_bytes`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from transformers import DynamicCache

from specsplit.server.kvcache import cache_from_tensors, cache_tensors, output_cache, position_bytes
from specsplit.common.prefix import common_prefix
from specsplit.server.loading import LoadedModel
from specsplit.server.prefix_cache import PrefixCache

PAD_ID = 0  # fed at padded positions; masked out, so any valid id will do


@dataclass
class KVState:
    """One session's keys and values, as one tensor [layers, 2 (key, value), kv heads,
    positions, head dim], and the tokens they belong to. One tensor, so that putting a
    batch together or taking it apart is one copy per session, not one per layer."""

    kv: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    # After a pass that fed branches: (position, tokens) of each; their keys and values sit
    # past the tokens', one branch after another.
    branches: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    # A prompt whose keys and values go to the engine's prefix cache once a pass has computed them.
    prompt: tuple[int, ...] = ()

    def crop(self, length: int) -> None:
        self.branches = []
        if length == 0:
            self.kv = None
        elif self.kv is not None and length < self.kv.shape[3]:
            self.kv = self.kv[:, :, :, :length]
        del self.tokens[length:]

    def take_branch(self, index: int) -> None:
        """Make branch `index` of the last pass this cache's line: its keys and values follow
        those of the drafts (and of the branches before it), and replace them from the
        branch's position on."""
        assert self.kv is not None
        at, tokens = self.branches[index]
        begin = len(self.tokens) + sum(len(t) for _, t in self.branches[:index])
        self.kv = torch.cat((self.kv[:, :, :, :at], self.kv[:, :, :, begin : begin + len(tokens)]), dim=3)
        self.tokens = [*self.tokens[:at], *tokens]
        self.branches = []

    def nbytes(self) -> int:
        """Memory held, including any part a crop cut off but did not free yet."""
        return 0 if self.kv is None else self.kv.untyped_storage().nbytes()

    def reusable(self, prefix: Sequence[int]) -> int:
        """How many positions of the cache a pass over prefix + drafts keeps. The row for
        position len(prefix) needs the token before it fed, so at most len(prefix) - 1,
        whatever the drafts."""
        return min(common_prefix(self.tokens, prefix), len(prefix) - 1)


@dataclass
class VerifyItem:
    """One session's share of a pass. Each of `branches`, (i, tokens), stands beside
    drafts[i]: it is fed after the drafts (and the branches before it), each of its tokens
    seeing the prefix, the drafts before i and the branch up to itself, as if it had been
    fed in their place."""

    kv: KVState
    prefix: Sequence[int]  # the committed sequence
    drafts: Sequence[int]
    greedy: bool = False  # only the argmax of each row is needed
    branches: Sequence[tuple[int, Sequence[int]]] = ()
    # Rows of the pass the feed is split over, each the next piece of it (engines whose
    # split_width allows it): a prompt need not widen every row of a batch to its length.
    pieces: int = 1
    branch_tokens: int = field(init=False)
    # Tokens this item puts through the model (the part of it the cache lacks), as the cache
    # is when the item is made. Computed once here: the scheduler reads it several times
    # for every session of every pass.
    feed_length: int = field(init=False)

    def __post_init__(self) -> None:
        self.branch_tokens = sum(len(tokens) for _, tokens in self.branches)
        self.feed_length = len(self.prefix) + len(self.drafts) + self.branch_tokens - self.kv.reusable(self.prefix)

    def narrowed(self, drafts: Sequence[int], branches: Sequence[tuple[int, Sequence[int]]]) -> VerifyItem:
        """This item verifying fewer drafts or branches: the same prefix and cache, so its feed
        length follows without comparing them again (the scheduler narrows most rows of a
        large batch, and the comparison walks a whole context)."""
        item = object.__new__(VerifyItem)  # a copy without __post_init__, which is the comparison
        item.__dict__.update(self.__dict__)
        item.drafts, item.branches = drafts, branches
        item.branch_tokens = sum(len(tokens) for _, tokens in branches)
        item.feed_length = self.feed_length - len(self.drafts) - self.branch_tokens + len(drafts) + item.branch_tokens
        return item

    def branch_spans(self, feed_length: int) -> list[tuple[int, int, int]]:
        """Per branch, in a feed of `feed_length` tokens: where the draft it replaces sits,
        and where the branch begins and ends."""
        line_end = feed_length - self.branch_tokens
        spans, begin = [], line_end
        for fork, tokens in self.branches:
            spans.append((line_end - len(self.drafts) + fork, begin, begin + len(tokens)))
            begin += len(tokens)
        return spans


class Engine(Protocol):
    """What the scheduler and service need of an engine (this module's, or static_engine's)."""

    loaded: LoadedModel

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def new_state(self, prompt: Sequence[int] = ()) -> KVState:
        """A session's cache; given the session's prompt, an engine with a prefix cache starts
        it with the positions that prompt shares with others (KVState.tokens says how many)."""
        ...

    def padded_shape(self, sessions: int, longest: int) -> tuple[int, int]:
        """(rows, tokens per row) a pass over `sessions` feeds of at most `longest` tokens computes."""
        ...

    def forward_shapes(self, items: Sequence[VerifyItem]) -> list[tuple[int, int]]:
        """(rows, tokens per row) of each forward pass verify_batch(items) runs, in order, its
        feeds split as the items say: one but where it feeds a long prompt ahead or splits an
        outsize cache (forward_passes). From the items' feed lengths alone, not their caches:
        the scheduler asks on its event loop, while the target's thread may run a pass."""
        ...

    @property
    def verifies_branches(self) -> bool:
        """Whether items may carry a branch."""
        ...

    @property
    def split_width(self) -> int:
        """The widest row a feed may be split into (VerifyItem.pieces); 0: every feed is one row."""
        ...

    # Forward passes run so far. A verify_batch runs one, or several where it feeds a long
    # prompt ahead (the static engine) or splits an outsize cache (TargetEngine): the scheduler
    # times a pass shape only by verify_batches that ran one.
    forward_passes: int

    def verify_batch(self, items: Sequence[VerifyItem]) -> list[np.ndarray]: ...


def attends_in_windows(config: object) -> bool:
    """Whether some of the model's layers attend over a sliding window (Mistral, Gemma 2, a
    Qwen2 with use_sliding_window), which transformers builds its own masks for. Where the
    config lists its layers' kinds, they say it: a Qwen2-MoE keeps a sliding_window of 0, a
    Qwen2 one of 4096 with use_sliding_window off, and neither has a windowed layer."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return "sliding_attention" in kinds
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", None) is not False


class TargetEngine:
    def __init__(self, loaded: LoadedModel, prefix_cache_bytes: int = 0, max_pass_cache_bytes: int = 0) -> None:
        """`prefix_cache_bytes`: memory for prompts' keys and values that later sessions whose
        prompts begin alike start from (prefix_cache.py); 0 keeps none. `max_pass_cache_bytes`:
        the most a pass's padded cache may take (0: no limit); a pass that would take more
        goes as several (pass_groups), each within it but for a session that is over it alone."""
        self.loaded = loaded
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.prefixes = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.position_bytes = position_bytes(self.model)  # what a pass pads, per row and position
        self.max_pass_positions = max_pass_cache_bytes // self.position_bytes if max_pass_cache_bytes > 0 else None
        # A pass with branches gives the model one mask of its own (_tree_mask), which every
        # layer then takes: sliding-window layers would attend past their window.
        self.verifies_branches = not attends_in_windows(self.model.config)
        self.forward_passes = 0

    def new_state(self, prompt: Sequence[int] = ()) -> KVState:
        state = KVState()
        if self.prefixes is not None and prompt:
            shared, kv = self.prefixes.lookup(prompt)
            if kv is not None:
                state.kv, state.tokens = kv, list(prompt[:shared])
            state.prompt = tuple(prompt)
        return state

    def padded_shape(self, sessions: int, longest: int) -> tuple[int, int]:
        return sessions, longest  # right-padded to the longest feed, no more

    def forward_shapes(self, items: Sequence[VerifyItem]) -> list[tuple[int, int]]:
        # From the feed lengths each item reckoned as it was made (its cache unchanged since),
        # not from the caches again: the event loop asks this of every pass.
        feeds = [it.feed_length for it in items]
        past = [len(it.prefix) + len(it.drafts) + it.branch_tokens - feed for it, feed in zip(items, feeds)]
        return [self.padded_shape(len(group), max(feeds[i] for i in group)) for group in self._groups(past, feeds)]

    split_width = 0  # a session's cache grows by one pass at a time

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 32768))

    @torch.inference_mode()
    def verify_batch(self, items: Sequence[VerifyItem]) -> list[np.ndarray]:
        """Per item: its len(drafts) + 1 + branch tokens logit rows (float32), or their argmax
        ids if greedy: the rows after the prefix, after each draft, after each branch token
        (branch by branch)."""
        past, _, groups = self.pass_plan(items)
        for it, keep in zip(items, past):
            it.kv.crop(keep)
        if len(groups) == 1:
            return self._pass(items, past)
        results: list[np.ndarray] = [np.empty(0)] * len(items)
        for group in groups:
            for i, result in zip(group, self._pass([items[i] for i in group], [past[i] for i in group])):
                results[i] = result
        return results

    def pass_plan(self, items: Sequence[VerifyItem]) -> tuple[list[int], list[int], list[list[int]]]:
        """How verify_batch takes `items`: each one's cached positions it keeps, the tokens it
        feeds, and the groups of items its passes take (one group under no limit)."""
        past = [it.kv.reusable(it.prefix) for it in items]
        feeds = [len(it.prefix) + len(it.drafts) + it.branch_tokens - keep for it, keep in zip(items, past)]
        return past, feeds, self._groups(past, feeds)

    def _groups(self, past: list[int], feeds: list[int]) -> list[list[int]]:
        if self.max_pass_positions is None:
            return [list(range(len(past)))]
        return pass_groups(past, feeds, self.max_pass_positions)

    def _pass(self, items: Sequence[VerifyItem], past: list[int]) -> list[np.ndarray]:
        """verify_batch's results for `items`, in one forward pass; `past`: the positions of
        each item's cache it keeps (cropped to them)."""
        self.forward_passes += 1
        seqs = [[*it.prefix, *it.drafts] for it in items]
        feeds = [[*seq[keep:], *(t for _, tokens in it.branches for t in tokens)]
                 for seq, keep, it in zip(seqs, past, items)]
        b, width, longest = len(items), max(past), max(len(f) for f in feeds)
        wanted = [len(it.drafts) + 1 + it.branch_tokens for it in items]
        # Only the positions whose logits someone needs go through the vocabulary projection
        # (most of a prompt's prefill cost on CPU). Row i's last real position is len(feed) - 1.
        keep = max(longest - len(f) + w for f, w in zip(feeds, wanted))
        ids = torch.full((b, longest), PAD_ID, dtype=torch.long)
        positions = torch.zeros((b, longest), dtype=torch.long)
        for i, (feed, p, it) in enumerate(zip(feeds, past, items)):
            ids[i, : len(feed)] = torch.tensor(feed)
            positions[i] = torch.arange(p, p + longest)
            # A branch takes the positions of the drafts it replaces.
            for fork, begin, end in it.branch_spans(len(feed)):
                positions[i, begin:end] = torch.arange(p + fork, p + fork + end - begin)
        mask = None
        if any(it.branches for it in items):
            mask = self._tree_mask(items, feeds, past, width, longest).to(self.device)
        elif b > 1:  # left-padded caches, right-padded feeds: hide the padding
            mask = torch.zeros((b, width + longest), dtype=torch.long)
            for i, (feed, p) in enumerate(zip(feeds, past)):
                mask[i, width - p : width + len(feed)] = 1
            mask = mask.to(self.device)
        out = self.model(ids.to(self.device), mask, positions.to(self.device),
                         self._batch_cache([it.kv for it in items], past, width), use_cache=True, logits_to_keep=keep)
        # All keys and values in one tensor [layers, 2, batch, heads, positions, dim].
        layers = cache_tensors(output_cache(out))
        new = torch.stack([t for pair in layers for t in pair]).unflatten(0, (len(layers), 2))
        spans = [(len(f) - (longest - keep) - w, len(f) - (longest - keep)) for f, w in zip(feeds, wanted)]
        greedy_ids = out.logits.argmax(-1).cpu().numpy() if any(it.greedy for it in items) else None
        results = []
        for i, (it, seq, feed, p, (lo, hi)) in enumerate(zip(items, seqs, feeds, past, spans)):
            kv = new[:, :, i, :, width - p : width + len(feed)]
            # A copy when batched, so that a session's cache does not hold the whole batch's memory.
            it.kv.kv, it.kv.tokens = (kv.clone() if b > 1 else kv), seq
            it.kv.branches = [(len(it.prefix) + fork, tuple(tokens)) for fork, tokens in it.branches]
            if it.kv.prompt and self.prefixes is not None:  # the session's first pass: its prompt is computed
                self.prefixes.keep(it.kv.prompt, it.kv.kv)
                it.kv.prompt = ()
            if it.greedy:
                results.append(greedy_ids[i, lo:hi])  # type: ignore[index]
            else:
                results.append(out.logits[i, lo:hi].float().cpu().numpy())
        return results

    def _tree_mask(self, items: Sequence[VerifyItem], feeds: list[list[int]], past: list[int], width: int,
                   longest: int) -> torch.Tensor:
        """The additive attention mask [batch, 1, queries, keys] of a pass with branches: every
        query sees its row's cache and the new tokens up to itself, except that a branch's
        tokens see neither the drafts from the one they replace on nor the branches before."""
        dtype = self.model.dtype
        visible = torch.zeros((len(items), longest, width + longest), dtype=torch.bool)
        causal = torch.ones((longest, longest), dtype=torch.bool).tril()
        for i, (it, feed, p) in enumerate(zip(items, feeds, past)):
            visible[i, :, width - p : width] = True
            visible[i, :, width:] = causal
            visible[i, :, width + len(feed) :] = False
            for fork, begin, end in it.branch_spans(len(feed)):
                visible[i, begin:end, width + fork : width + begin] = False
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[:, None]

    def _batch_cache(self, states: list[KVState], past: list[int], width: int) -> DynamicCache:
        """The sessions' caches, left-padded with zeros to `width` positions and stacked."""
        if width == 0:
            return DynamicCache()
        source = next(s.kv for s, p in zip(states, past) if p > 0)
        assert source is not None
        layers, _, heads, _, dim = source.shape
        if len(states) == 1:
            batch = source.unsqueeze(2)
        else:
            batch = source.new_zeros((layers, 2, len(states), heads, width, dim))
            for i, (s, p) in enumerate(zip(states, past)):
                if p:
                    batch[:, :, i, :, width - p :] = s.kv
        return cache_from_tensors([(batch[layer, 0], batch[layer, 1]) for layer in range(layers)])


def pass_groups(past: Sequence[int], feeds: Sequence[int], most: int) -> list[list[int]]:
    """The items of a pass (their cached positions `past` and fed tokens `feeds`) in groups
    whose padded caches, rows x (the longest cache + the longest feed), hold at most `most`
    positions (an item over it alone goes alone), the longest first: sessions of like length
    share a pass. One group where the whole pass is within `most`: each more costs a pass
    over the weights."""
    everyone = list(range(len(past)))
    if len(past) * (max(past, default=0) + max(feeds, default=0)) <= most:
        return [everyone]
    groups: list[list[int]] = []
    top = feed = 0  # the last group's longest cache and longest feed
    for i in sorted(everyone, key=lambda i: -(past[i] + feeds[i])):
        if groups and (len(groups[-1]) + 1) * (max(top, past[i]) + max(feed, feeds[i])) <= most:
            groups[-1].append(i)
            top, feed = max(top, past[i]), max(feed, feeds[i])
        else:
            groups.append([i])
            top, feed = past[i], feeds[i]
    return groups


# The warm-up's prompt and drafts: its passes need 38 positions of a slot (serve_checks.MIN_STATIC_LEN).
WARM_UP_PROMPT = 32
WARM_UP_DRAFTS = 4


def warm_up(engine: Engine) -> None:
    """Run a prefill, a one-token step and a verification on a throwaway session before
    serving. The first passes of a fresh process pay for paging the weights in and for the
    math library's first calls (seconds on a CPU); without this the first user's time to
    first token would carry them, and a benchmark's first run with it."""
    state = engine.new_state()
    prompt = list(range(1, WARM_UP_PROMPT + 1))
    for prefix, proposed in ((prompt, []), (prompt + [1], []), (prompt + [1, 2], list(range(3, 3 + WARM_UP_DRAFTS)))):
        engine.verify_batch([VerifyItem(state, prefix, proposed, greedy=True)])
    state.crop(0)  # a static engine's slot goes back
