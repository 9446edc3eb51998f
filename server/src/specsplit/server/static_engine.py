"""The target with one preallocated KV cache for all sessions, and CUDA graphs on a GPU.

On a GPU an eager transformers forward costs 20 to 60 ms of Python and kernel launches
whatever the batch, several times what the GPU computes. Graph replay removes that, but
needs fixed shapes and fixed memory: so every session owns a slot (a row) of one cache
of `max_len` positions, its tokens at positions 0..n-1 of its row, and a pass writes
each session's new keys and values at its own offset in its own row. A pass is padded
to a bucket of sessions and of tokens per session (and, with bucket_kv, of the positions its
rows attend over: kv_buckets); one graph is captured per bucket pair (triple), for every one
the scheduler's limits allow, before serving starts. Rollback is
free: a session's length is just where its next tokens will be written. Attention sees a session's own row up to each query's
position, so padding changes nothing and results match the dynamic engine's. A long feed
(a prompt) may take several rows of a pass, each the next piece of it in the same slot.

On a GPU the model's norms and MLPs are also compiled (fusion.py) before the graphs are
captured, so that each of their elementwise chains is one kernel in the graph.

Without CUDA (tests, CPU servers) the same code runs eagerly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import AttentionInterface

from specsplit.server.engine import KVState, VerifyItem
from specsplit.server.fusion import fuse_pointwise, unfuse
from specsplit.server.kvcache import kv_shape, position_bytes
from specsplit.server.loading import LoadedModel

# Past 32 rows, steps of 8, and past 128 of an eighth of the power of two below: 132 rows pad
# to 144, not 256 (a load test spent 37% of its pass rows on padding with powers of two
# alone) or 160 (quarter steps). Once split passes were bound by the GPU's arithmetic, a
# padded position cost what a real one does: these rows and the 12-token bucket cut the
# padded tokens fed per committed token by 4% in a load test (docs/capacity.md).
SESSION_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 144, 160, 176, 192,
                   208, 224, 240, 256, 288, 320, 352, 384, 416, 448, 480, 512)
TOKEN_BUCKETS = (1, 2, 4, 8, 12, 16, 32)
# With bucket_kv, attention reads each row's slot up to the pass's KV bucket, not the whole
# slot: gathering all `max_len` positions of every row and attending over them cost 1.4 to
# 2.6 times the pass at 2048 positions and short sessions (docs/capacity.md).
SMALLEST_KV_BUCKET = 128
# Buckets are the default only for slots longer than this. At 2048 positions a load test's
# server committed 40% more tokens/s with them (server-only sessions) and split sessions
# met the SLO where they missed it without; at 512 the same load test went either way from
# one machine to another, and every bucket is another set of graphs to capture.
KV_BUCKETS_BY_DEFAULT_ABOVE = 512

log = logging.getLogger(__name__)


def bucket(n: int, sizes: Sequence[int]) -> int:
    return next(s for s in sizes if s >= n)


def kv_buckets_by_default(max_len: int) -> bool:
    """Whether a static engine of `max_len`-position slots buckets its KV unless told."""
    return max_len > KV_BUCKETS_BY_DEFAULT_ABOVE


def kv_buckets(max_len: int) -> tuple[int, ...]:
    """The KV lengths a pass may attend over: doublings from SMALLEST_KV_BUCKET, then max_len."""
    sizes = [SMALLEST_KV_BUCKET]
    while sizes[-1] < max_len:
        sizes.append(2 * sizes[-1])
    return (*sizes[:-1], max_len)


class SlotCache:
    """Keys and values of every slot, [layers, slots, positions, kv heads, head dim]. It
    stands in for a transformers cache: `update` writes the pass's new keys and values
    at their (slot, position) and returns the rows of the sessions in the pass. Slot and
    position lead, so a write is one index_copy_ over (slot x position) rows; with heads
    before positions, PyTorch copies the layer's whole cache to scatter into it."""

    def __init__(self, model: torch.nn.Module, slots: int, max_len: int) -> None:
        layers, heads, dim = kv_shape(model.config)
        p = next(model.parameters())
        shape = (layers, slots, max_len, heads, dim)
        self.max_len = max_len
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        # Read by the KV gauge for every session after every pass: computed once.
        self.bytes_per_slot = position_bytes(model) * max_len
        self.rows: torch.Tensor | None = None  # [batch]: slot of each row of the pass
        self.flat: torch.Tensor | None = None  # [batch * tokens]: slot * max_len + position of each new token
        self.kv_len = max_len  # the positions of its slot each row of the pass attends over

    def place(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int) -> None:
        self.rows = rows
        self.flat = (rows[:, None] * self.max_len + positions).reshape(-1)
        self.kv_len = kv_len

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = []
        for store, new in ((self.k[layer], key), (self.v[layer], value)):
            heads, dim = store.shape[-2:]
            store.view(-1, heads, dim).index_copy_(0, self.flat, new.transpose(1, 2).reshape(-1, heads, dim))
            out.append(store[self.rows, : self.kv_len].transpose(1, 2))  # [batch, heads, positions, dim]
        return out[0], out[1]

    def get_seq_length(self, layer: int = 0) -> int:
        return 0  # positions and masks are always given explicitly


GQA_ATTENTION = "specsplit_gqa_sdpa"


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0, **kwargs):  # type: ignore[no-untyped-def]
    """Attention for grouped-query models that never copies keys and values per query head.

    transformers' SDPA path, given a mask, repeats every key/value head for its query heads:
    for a slot cache that is a copy of every slot's whole row per layer, most of a batched
    pass's GPU time. Here the query heads sharing a key/value head are stacked along the
    query axis instead (the mask repeated to match), which computes the same attention."""
    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    q = query.reshape(b, kv_heads, group * q_len, dim)
    mask = attention_mask.repeat(1, 1, group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, q_len, dim).transpose(1, 2).contiguous(), None


class SlotState(KVState):
    """A session's slot; its cached tokens are positions 0..len(tokens)-1 of that row."""

    def __init__(self, engine: StaticEngine) -> None:
        super().__init__()
        self.engine = engine
        self.slot: int | None = None

    def crop(self, length: int) -> None:
        del self.tokens[length:]
        if length == 0 and self.slot is not None:
            self.engine.free.append(self.slot)
            self.slot = None

    def nbytes(self) -> int:
        return 0 if self.slot is None else self.engine.cache.bytes_per_slot


def pass_shapes(max_sessions: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every padded (rows, tokens per row) shape a pass can take when the scheduler puts at
    most `max_sessions` rows in a pass (a session's row, or the pieces of a split feed) and at
    most `max_tokens` tokens (rows times the widest), except that one row may exceed the
    tokens alone."""
    shapes = []
    for i, b in enumerate(SESSION_BUCKETS):
        fewest = SESSION_BUCKETS[i - 1] + 1 if i else 1  # the fewest sessions that pad to b
        if fewest > max_sessions:
            break
        for j, f in enumerate(TOKEN_BUCKETS):
            if b == 1 or fewest * (TOKEN_BUCKETS[j - 1] + 1 if j else 1) <= max_tokens:
                shapes.append((b, f))
    return shapes


class StaticEngine:
    def __init__(self, loaded: LoadedModel, slots: int, max_len: int, graphs: bool | None = None,
                 fuse: bool | None = None, bucket_kv: bool = False) -> None:
        """`graphs` (default: on a GPU) captures a CUDA graph per pass shape; `fuse` (default:
        with graphs) compiles the model's norms and MLPs in place (`fusion.fuse_pointwise`);
        `bucket_kv` has a pass attend over its KV bucket (kv_buckets), not the whole slot.

        `serve` turns bucket_kv on for slots longer than 512 positions (kv_buckets_by_default):
        it makes every pass faster, but at 512 the load test's server-only sessions fared
        better or worse by machine (docs/capacity.md)."""
        self.loaded = loaded
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.max_len = max_len
        # One slot more than sessions: padding rows of a pass write there.
        self.cache = SlotCache(self.model, slots + 1, max_len)
        self.kv_buckets = kv_buckets(max_len) if bucket_kv else (max_len,)
        self.scratch = slots
        self.forward_passes = 0  # (Engine.forward_passes)
        self.free = list(range(slots - 1, -1, -1))
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        AttentionInterface.register(GQA_ATTENTION, grouped_sdpa)
        self.fused = self._fuse() if (self.graphs if fuse is None else fuse) else 0
        self._captured: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, dict, dict]] = {}
        self._logits: torch.Tensor | None = None  # the graphs' shared logits output (flat)
        self._pool = None

    @torch.inference_mode()
    def _fuse(self) -> int:
        """Compile the norms and MLPs, and compile them now with small eager passes into the
        spare slot: where compiling fails, the engine falls back to eager modules here rather
        than failing in the first graph capture, and no session waits for a compile (without
        graphs nothing else would compile them before serving). Returns how many.

        Compiling can fail in more ways than one: no C compiler for Triton's or inductor's
        code (a slim container image), or modules dynamo cannot trace (the row-invariant
        linear layers of a CPU target, `row_invariant`). The probe passes are throwaway, so any error
        in them means: serve the modules as they were."""
        replaced = fuse_pointwise(self.model)
        try:
            # Sizes of 1 are compiled apart, and two equal sizes would be taken as one (duck sizing).
            for rows, tokens in ((2, 3), (2, 1), (1, 2), (1, 1)):
                self._forward(self._inputs(rows, tokens), self.kv_buckets[0])
        except Exception as exc:  # noqa: BLE001 - whatever failed, the modules as they were still serve
            unfuse(replaced)
            log.warning("cannot compile the target's norms and MLPs, running them eagerly: %s: %s",
                        type(exc).__name__, (str(exc).strip().splitlines() or [""])[0])
            return 0
        return len(replaced)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int:
        # The largest pass writes up to TOKEN_BUCKETS[-1] positions past a session's end.
        return min(int(getattr(self.model.config, "max_position_embeddings", 32768)), self.max_len - TOKEN_BUCKETS[-1])

    def new_state(self, prompt: Sequence[int] = ()) -> SlotState:
        return SlotState(self)  # a slot starts empty: no prefix cache (the dynamic engine's)

    verifies_branches = False  # a slot's positions are its tokens': no room for a branch beside them
    split_width = TOKEN_BUCKETS[-1]  # pieces of a feed are rows of one slot (verify_batch)

    def padded_shape(self, sessions: int, longest: int) -> tuple[int, int]:
        # Longer feeds (prefills) go through in pieces of the widest bucket.
        return bucket(sessions, SESSION_BUCKETS), bucket(min(longest, TOKEN_BUCKETS[-1]), TOKEN_BUCKETS)

    def _row_width(self, items: Sequence[VerifyItem]) -> int:
        """The padded width of a pass's rows: pieces are cut at it, since a row's padding is
        written to the positions after it, where the next piece of its feed lies."""
        widest = max(-(-it.feed_length // it.pieces) for it in items)
        return bucket(min(widest, TOKEN_BUCKETS[-1]), TOKEN_BUCKETS)

    def forward_shapes(self, items: Sequence[VerifyItem]) -> list[tuple[int, int]]:
        # As verify_batch runs them: the leads in pieces of the widest bucket, then the main pass.
        # Only the feeds themselves, never `it.kv`: the scheduler asks on its event loop.
        width, step = self._row_width(items), TOKEN_BUCKETS[-1]
        mains = [min(it.feed_length, it.pieces * width) for it in items]
        leads = [lead for it, main in zip(items, mains) if (lead := it.feed_length - main) > 0]  # few: prompts
        early = [self.padded_shape(sum(lead > offset for lead in leads),
                                   max(min(step, lead - offset) for lead in leads if lead > offset))
                 for offset in range(0, max(leads, default=0), step)]
        return [*early, self.padded_shape(sum(-(-main // width) for main in mains), width)]

    def _inputs(self, b: int, f: int) -> dict:
        zeros = torch.zeros((b, f), dtype=torch.long, device=self.device)
        return {"ids": zeros, "start": torch.zeros(b, dtype=torch.long, device=self.device),
                "rows": torch.full((b,), self.scratch, dtype=torch.long, device=self.device)}

    def _forward(self, inp: dict, kv_len: int) -> dict:
        """The pass, on static inputs: ids [b, f], start [b] (each row's first new position),
        rows [b] (each row's slot); every real token's position is below kv_len."""
        ids, start = inp["ids"], inp["start"]
        f = ids.shape[1]
        positions = start[:, None] + torch.arange(f, device=ids.device)
        # Query j of a row sees its row's positions 0..start + j (a padding query past kv_len
        # sees what there is: its row is thrown away).
        keys = torch.arange(kv_len, device=ids.device)
        mask = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        self.cache.place(inp["rows"], positions.clamp(max=self.max_len - 1), kv_len)
        # Grouped attention for this engine's passes only: the model object stays as loaded.
        config = self.model.config
        loaded_attention, config._attn_implementation = config._attn_implementation, GQA_ATTENTION
        try:
            out = self.model(ids, {"full_attention": mask}, positions, self.cache, use_cache=True)
        finally:
            config._attn_implementation = loaded_attention
        return {"logits": out.logits, "best": out.logits.argmax(-1)}

    @torch.inference_mode()
    def capture_graphs(self, max_sessions: int, max_tokens: int,
                       progress: Callable[[int, int], None] | None = None) -> None:
        """Capture, before serving, the graph of every pass shape the scheduler's limits allow
        (pass_shapes, at every KV bucket), so that no session waits behind a capture (each
        costs a couple of eager passes). `progress` is told (captured, of) after each. Without
        graphs, nothing."""
        if not self.graphs:
            return
        # Rows, not sessions: a feed split over rows (VerifyItem.pieces) takes several of one slot.
        shapes = pass_shapes(max_sessions, max_tokens)
        # The largest first sizes the logits buffer (and the pool).
        order = [(b, f, kv_len) for b, f in sorted(shapes, key=lambda s: -s[0] * s[1])
                 for kv_len in reversed(self.kv_buckets)]
        for done, (b, f, kv_len) in enumerate(order, 1):
            self._capture(b, f, kv_len)
            if progress is not None:
                progress(done, len(order))

    def _capture(self, b: int, f: int, kv_len: int) -> None:
        if (b, f, kv_len) in self._captured:
            return
        inp = self._inputs(b, f)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # One eager pass outside the graph first, as capture requires (lazy initialisation,
        # the compiled modules meeting this size). A second, as before, made start-up 28%
        # longer on an H200 (39.3 against 30.6 s for 245 graphs) and replays no different:
        # in both, every probed replay equalled an eager pass bit for bit (docs/capacity.md).
        with torch.cuda.stream(stream):
            warm = self._forward(inp, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        vocab, dtype = warm["logits"].shape[-1], warm["logits"].dtype
        del warm
        if self._logits is None or self._logits.numel() < b * f * vocab:
            self._logits = torch.empty(b * f * vocab, dtype=dtype, device=self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(inp, kv_len)
            # Every graph writes its logits into one shared buffer (graphs never run at once),
            # so that the pool can reuse the memory of each graph's own logits: kept per graph,
            # the logits of a hundred-odd shapes outgrow an 80 GB card.
            logits = self._logits[: b * f * vocab].view(b, f, vocab)
            logits.copy_(out["logits"])
            out = {"logits": logits, "best": out["best"]}
        self._pool = graph.pool()  # one memory pool for all graphs: they never run at once
        self._captured[(b, f, kv_len)] = (graph, inp, out)

    def _run(self, b: int, f: int, kv_len: int, host: dict) -> dict:
        if not self.graphs:
            return self._forward({k: v.to(self.device) for k, v in host.items()}, kv_len)
        self._capture(b, f, kv_len)  # a shape outside the limits captured at start
        graph, inp, out = self._captured[(b, f, kv_len)]
        for k, v in host.items():
            inp[k].copy_(v, non_blocking=True)
        graph.replay()
        return out

    @torch.inference_mode()
    def verify_batch(self, items: Sequence[VerifyItem]) -> list[np.ndarray]:
        """Per item: its len(drafts) + 1 logit rows (float32), or their argmax ids if greedy."""
        step = TOKEN_BUCKETS[-1]
        feeds, starts = [], []
        for it in items:
            state = it.kv
            assert isinstance(state, SlotState)
            if len(it.drafts) + 1 > step:
                raise ValueError(f"at most {step - 1} drafts per verification with the static engine")
            if len(it.prefix) + len(it.drafts) > self.max_context:
                raise ValueError(f"{len(it.prefix) + len(it.drafts)} tokens exceed the {self.max_context} positions a "
                                 f"session may fill in a {self.max_len}-position KV slot")
            keep = state.reusable(it.prefix)
            state.crop(keep)
            if state.slot is None:
                if not self.free:
                    raise RuntimeError("no free KV slot (more sessions than the server was started for)")
                state.slot = self.free.pop()
            feeds.append([*it.prefix[keep:], *it.drafts])
            starts.append(keep)
        # Each feed's last `pieces` rows' worth goes into one pass, a row per piece: the cache
        # takes a layer's keys and values of every row before any row attends, so a piece
        # sees the pieces before it as if they were cached. What is left of a longer feed (a
        # prompt) goes in first, in pieces of the widest bucket that need no logits.
        width = self._row_width(items)
        mains = [f[-min(len(f), it.pieces * width):] for it, f in zip(items, feeds)]
        leads = [len(f) - len(m) for f, m in zip(feeds, mains)]
        for offset in range(0, max(leads), step):
            early = [(it, s + offset, f[offset : min(offset + step, lead)])
                     for it, s, f, lead in zip(items, starts, feeds, leads) if lead > offset]
            self._pass([e[0] for e in early], [e[1] for e in early], [e[2] for e in early])
        rows: list[tuple[VerifyItem, int, list[int]]] = []
        spans = []  # each item's rows in the pass
        for it, s, m, lead in zip(items, starts, mains, leads):
            first = len(rows)
            rows += [(it, s + lead + i, m[i : i + width]) for i in range(0, len(m), width)]
            spans.append(range(first, len(rows)))
        out = self._pass([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        best = out["best"].cpu().numpy() if any(it.greedy for it in items) else None
        results = []
        for it, span in zip(items, spans):
            it.kv.tokens = [*it.prefix, *it.drafts]  # only now does the slot hold them: a failed pass leaves it cropped
            n = len(it.drafts) + 1  # the logit rows wanted: the feed's last n
            full_before_last = max(0, -(-(n - len(rows[span[-1]][2])) // width))  # pieces they reach back into
            last = span[len(span) - 1 - full_before_last :]
            if it.greedy:
                results.append(np.concatenate([best[r, : len(rows[r][2])] for r in last])[-n:])  # type: ignore[index]
            else:
                rows_out = torch.cat([out["logits"][r, : len(rows[r][2])] for r in last])
                results.append(rows_out[-n:].float().cpu().numpy())
        return results

    def _pass(self, items: Sequence[VerifyItem], starts: list[int], chunks: list[list[int]]) -> dict:
        self.forward_passes += 1
        b, f = self.padded_shape(len(items), max(len(c) for c in chunks))
        kv_len = bucket(max(s + len(c) for s, c in zip(starts, chunks)), self.kv_buckets)
        # Filled in numpy and handed over whole: a torch op per row costs more host time
        # than the rest of a row's share of a graph replay.
        ids = np.zeros((b, f), dtype=np.int64)
        for i, c in enumerate(chunks):
            ids[i, : len(c)] = c
        start = np.zeros(b, dtype=np.int64)
        start[: len(starts)] = starts
        rows = np.full(b, self.scratch, dtype=np.int64)
        rows[: len(items)] = [it.kv.slot for it in items]  # type: ignore[attr-defined]
        return self._run(b, f, kv_len, {k: torch.from_numpy(v) for k, v in (("ids", ids), ("start", start), ("rows", rows))})
