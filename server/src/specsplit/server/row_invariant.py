"""bf16 and fp32 on CPU with a row's logits independent of how many tokens its pass feeds.

Greedy verification is lossless only if the target scores a position the same whether
the position came alone (a server-only step) or among drafts (a verification). In bf16
PyTorch's CPU kernels gave rows up to a quarter of a logit apart, flipping near-tied
choices; in fp32 the default target's rows moved by up to 1e-5 and no greedy choice flipped,
but only bitwise equality makes that a guarantee. Two kernel choices did that, and both
depend only on the pass's shape:

- a linear layer over a single row takes a vector kernel, over two or more a matrix kernel,
  and the two sum in different orders. The matrix kernel gives a row the same bits over a
  range of row counts, at any position among them, but past it picks its blocking by the row
  count, and rows come out other bits at some counts and not at others (on the default
  target, on an Intel Xeon with AMX and PyTorch 2.13: the 8960-wide down projection from 33
  rows on, the gate, up and vocabulary projections from 33 or 37; a batch of four sessions'
  9 tokens moved a logit by a quarter; with PyTorch 2.11 there, from 5 to 18 rows by shape).
  A pass of a long prompt, or of several sessions' drafts, holds more rows than that;
- scaled-dot-product attention's CPU kernel splits its queries into blocks by the pass's
  size. The eager path (a matmul, a softmax in fp32, a matmul) gave every query row the
  same bits on an AMD EPYC as long as no masked key came before a row's own (a batch
  left-pads the shorter sessions' caches: 3 of 170 random cases came out other bits), but
  on an Intel Xeon with AMX its products take other kernels by the number of queries and
  keys: a query among drafts came out other bits than the same query alone from the third
  draft on, and 12 prompts' greedy outputs parted in 7 of them.

So every linear takes its rows at most as many at a time as this machine's kernel keeps a
row's bits over (measured when the layer is built: kernel_probe.py), at most INVARIANT_ROWS,
and at least MIN_ROWS (one through ONNX Runtime's GEMM, fp32's), a short piece padded with
copies of a row (the weights are read once
either way, and oneDNN's kernel for one or two rows is slower than for four); a pass over more
rows reads the weights once per piece, which a prompt's prefill and a large batch pay for (a
44-token prefill of the default target: 616 ms against 469 on one core of that Xeon).

Attention is computed as eager attention computes it (products in the model's dtype, the
softmax in fp32), but a query's products have one shape wherever it is fed: its keys are taken in a
window from the first it sees, KEY_BUCKET wide or a multiple of that, the keys past its own
masked out (they weigh exactly 0, and a zero adds nothing to a sum), and queries that share a
window go through as the rows of one product, at least MIN_ROWS and at most as many as the
matrix kernel gives each row the same bits over, probed as for the linear layers (for key
windows of 64, 512 and 4096 keys; INVARIANT_ROWS on every machine measured).
One product per window, not per query: taken one query at a time (a Python loop of small
products, each mostly call overhead), attention was 13 to 19% of a pass over 8 tokens of the
default target on one core of an AMD EPYC; in windows it takes about 40% of that time.
Shown bitwise by `tests/test_row_invariant.py` on a small model, and on the default target by `bench/gpu_passes.py --target default --device cpu --dtype bf16` (its
divergence check: `bench/results/cpu-passes-bf16-invariant.md`; in fp32,
`cpu-passes-fp32-invariant.md`). The static engine swaps in
its own attention and is not made so.
"""
from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from specsplit.server.cpu_linear import MIN_WEIGHTS, OnnxRuntimeProduct
from specsplit.server.kernel_probe import Product, rows_kept, sensitive_weight
from specsplit.server.kvcache import kv_shape
from specsplit.server.linear_swap import replace_linears

log = logging.getLogger(__name__)

ATTENTION = "specsplit_row_invariant"


# The most rows one matrix product takes: up to here oneDNN's kernel summed every row in one
# order on the CPUs and PyTorch builds measured, for some of them only with the weight handed
# over in one of the ways below (kernel_probe.py).
INVARIANT_ROWS = 32
# The fewest: oneDNN's kernel takes one and two rows through slower paths than three to six
# (the default target's linear layers on one core of an AMD EPYC: 224 ms over two rows, 145
# over four), and on that EPYC it gave a lone row other bits than a row among others.
MIN_ROWS = 4


# How a layer may hand its weight to a matrix kernel: oneDNN's blocked layout packed for
# INVARIANT_ROWS rows or for one (an int), as it is (None), or to ONNX Runtime's GEMM (fp32).
Form = int | str | None
ONNXRUNTIME = "onnxruntime"


class RowInvariantLinear(nn.Module):
    """A bf16 or fp32 nn.Linear on CPU whose products take at most `rows` rows at a time and
    at least `fewest` (a short piece is padded with copies of its last row).

    `rows`, at most INVARIANT_ROWS, is how many rows this machine's kernel gives each of them
    the bits it gets alone over, measured for the layer's shape (kernel_probe.py) for each way
    of handing the weight over (`Form`), the first that keeps INVARIANT_ROWS or else the one
    that keeps the most: with `onnxruntime`, an fp32 layer of at least MIN_WEIGHTS weights
    first tries ONNX Runtime's GEMM (cpu_linear.py) from a lone row on; then the weight packed
    once into oneDNN's blocked layout for INVARIANT_ROWS rows, packed for one row, or plain,
    each from MIN_ROWS rows on. The probe runs at the thread count of the layer's making, which
    the kernel's choices depend on: set it first (serve and bench/gpu_passes.py do).
    Unpacked, every call repacks the weight: PyTorch's bf16 product on CPU is oneDNN's with a
    reorder of the weight first, which cost the default target's passes about as much again as
    the product itself (4 rows: 238 ms against 125 for its transformer layers)."""

    def __init__(self, linear: nn.Linear, onnxruntime: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        weight = linear.weight.detach()
        forms: list[Form] = [INVARIANT_ROWS, 1, None]
        if onnxruntime and weight.dtype == torch.float32 and weight.numel() >= MIN_WEIGHTS:
            forms.insert(0, ONNXRUNTIME)
        self.form, self.rows = _best_form(weight, self.bias, forms)
        self.fewest = _fewest(self.form)
        product = _product(weight, self.bias, self.form)
        assert product is not None  # _best_form takes only forms this build can make
        self.product = product

    @property
    def packed(self) -> bool:
        return isinstance(self.form, int)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # no row to pad a piece with
            return x.new_empty(*x.shape[:-1], self.out_features)
        pieces = [self._piece(piece) for piece in x.reshape(-1, self.in_features).split(self.rows)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _piece(self, rows: torch.Tensor) -> torch.Tensor:
        return self.product(_at_least(rows, 0, self.fewest))[: len(rows)]


def _fewest(form: Form) -> int:
    """ONNX Runtime's GEMM gave a lone row the bits it gets among others on the CPU measured (an
    AMD EPYC; the probe checks it on each machine), and a lone row costs it less than four do;
    oneDNN's and PyTorch's kernels take one or two rows through other, slower paths (MIN_ROWS)."""
    return 1 if form == ONNXRUNTIME else MIN_ROWS


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return nn.functional.linear(rows, weight, bias)


def _at_least(rows: torch.Tensor, dim: int, fewest: int = MIN_ROWS) -> torch.Tensor:
    """`rows` (along `dim`) padded to `fewest` with copies of its last one."""
    short = fewest - rows.shape[dim]
    if short <= 0:
        return rows
    last = rows.narrow(dim, rows.shape[dim] - 1, 1)
    return torch.cat((rows, last.expand(*[short if d == dim else -1 for d in range(rows.dim())])), dim)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # as --dtype names them, in log lines

# Rows kept, by (form, weight shape, dtype, bias, threads): a model's layers share a few
# shapes, and each is probed once per form, on a weight made for it.
_kept: dict[tuple, int] = {}


def _best_form(weight: torch.Tensor, bias: torch.Tensor | None, forms: list[Form]) -> tuple[Form, int]:
    """The form the layer's products take, and how many rows a product may take."""
    best: tuple[Form, int] | None = None
    probed = False  # here, for this shape: the first layer of its shape says what was found
    shape, kind = "x".join(map(str, weight.shape)), _DTYPE_NAMES.get(weight.dtype, str(weight.dtype))
    for form in forms:
        key = (form, tuple(weight.shape), weight.dtype, bias is not None, torch.get_num_threads())
        if key not in _kept:
            probed = True
            probe = _product(sensitive_weight(*weight.shape, weight.dtype), bias, form)
            # 0: this build cannot make it (asked once per shape, not once per layer)
            _kept[key] = 0 if probe is None else rows_kept(probe, weight.shape[1], weight.dtype, INVARIANT_ROWS,
                                                           _fewest(form))
            del probe  # a vocabulary projection's probe holds gigabytes in fp32: one at a time
            if 0 < _kept[key] < INVARIANT_ROWS:
                log.info("%s products of %s weights (%s) keep a row's bits over %d rows on this machine",
                         kind, shape, _form_name(form), _kept[key])
        if _kept[key] == 0:
            continue
        if best is None or _kept[key] > best[1]:
            best = (form, _kept[key])
        if best[1] == INVARIANT_ROWS:
            break
    assert best is not None  # the plain weight is always there
    if probed and best[1] == 1:
        log.warning("%s products of %s weights give a row other bits among other rows on this machine: "
                    "they go one row at a time, and verification passes cost about a one-token step a "
                    "token%s", kind, shape, " (--dtype fp32 may serve faster)" if weight.dtype == torch.bfloat16 else "")
    return best


def _form_name(form: Form) -> str:
    if form is None:
        return "plain"
    return "ONNX Runtime's GEMM" if form == ONNXRUNTIME else f"packed for {form}"


def _product(weight: torch.Tensor, bias: torch.Tensor | None, form: Form) -> Product | None:
    """The layer's product with the weight in `form`; None where this build cannot make it."""
    if form == ONNXRUNTIME:
        return OnnxRuntimeProduct(weight, bias, torch.get_num_threads())
    packed = _form(weight, form)
    return None if packed is None else functools.partial(_linear, packed, bias)


def _form(weight: torch.Tensor, hint: int | None) -> torch.Tensor | None:
    """The weight packed into oneDNN's layout for products of `hint` rows (None: as it is);
    None where this build of PyTorch cannot pack it."""
    if hint is None:
        return weight
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, hint)
    except (RuntimeError, AttributeError):  # a build without the op, or a CPU oneDNN cannot pack for
        return None


# Key windows are a multiple of this wide: a query's window, so its products' shapes, change
# once every this many positions, and a window holds at most this many keys past its own.
KEY_BUCKET = 64


@dataclass
class _Product:
    """Consecutive queries of batch row `row`, from `q0` on, that go through one product: the
    i-th sees the first `seen[i]` keys of a window `width` wide, which begins at key `first`
    of the row (a run of keys) or holds the keys at `positions` (gathered: a branch's tokens
    skip the drafts they replace, and each sees the keys the one before it sees and its own)."""

    row: int
    q0: int
    seen: list[int]
    width: int
    first: int = 0
    positions: torch.Tensor | None = None

    def takes(self, row: int, first: int, seen: int, width: int, positions: torch.Tensor | None) -> bool:
        """Whether the row's next query, with that window, can be one of this product's."""
        if row != self.row or width != self.width:
            return False
        if positions is None or self.positions is None:
            return positions is None and self.positions is None and first == self.first
        return seen == self.seen[-1] + 1 and torch.equal(positions[:-1], self.positions)


def row_invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention whose every query gets the bits it gets fed alone (see the module's docstring).

    `attention_mask` is eager's additive mask [batch, 1, queries, keys] (None: every query
    sees every key). A query of a one-token step and the same query among drafts, other
    sessions' rows or a branch see the same keys at the same places of a window of one
    width: a branch's tokens, which skip the drafts they replace and any branches fed before
    theirs, attend over the keys they see gathered, as when fed in line. A query's heads go
    through as rows of one product per key/value head: no copy of the keys per query head."""
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scaling = kwargs.get("scaling") or dim**-0.5
    grouped = query.reshape(batch, kv_heads, group, queries, dim)
    out = query.new_empty((batch, queries, heads, dim))
    per_product = max(1, attention_rows(kv_heads, dim, query.dtype) // group)
    for p in _plan(attention_mask, batch, queries, key.shape[2], per_product):
        m = len(p.seen)
        taken = slice(p.first, p.first + p.width) if p.positions is None else p.positions
        keys, values = _padded(key[p.row, :, taken], p.width), _padded(value[p.row, :, taken], p.width)
        rows = grouped[p.row, :, :, p.q0 : p.q0 + m].transpose(1, 2).reshape(kv_heads, m * group, dim)
        rows = _at_least(rows, 1)  # as for the linear layers: one or two rows take another kernel
        scores = torch.matmul(rows, keys.transpose(1, 2)) * scaling  # [kv heads, rows, width]
        for i, seen in enumerate(p.seen):
            scores[:, i * group : (i + 1) * group, seen:] = float("-inf")
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        result = torch.matmul(weights, values)[:, : m * group].reshape(kv_heads, m, group, dim)
        out[p.row, p.q0 : p.q0 + m] = result.transpose(0, 1).reshape(m, heads, dim)
    return out, None


# Key windows the attention probe tries: a window's width is the sum the second product takes
# (weights times values), and a kernel may block a long sum otherwise than a short one.
PROBED_WIDTHS = (KEY_BUCKET, 8 * KEY_BUCKET, 64 * KEY_BUCKET)


@functools.cache
def _attention_rows(kv_heads: int, dim: int, dtype: torch.dtype, threads: int) -> int:
    kept = INVARIANT_ROWS
    for width in PROBED_WIDTHS:
        # Scores sum over the head's dimension (queries times keys), the result over the window
        # (weights times values): each probed as attention calls it, a key/value head a batch.
        for weight, inputs in ((sensitive_weight(width, dim, dtype), dim), (sensitive_weight(dim, width, dtype), width)):
            other = weight.repeat(kv_heads, 1, 1).transpose(1, 2)  # [kv heads, inputs, outputs], as keys.transpose
            kept = min(kept, rows_kept(lambda rows, b=other: torch.matmul(rows.repeat(kv_heads, 1, 1), b)[0],
                                       inputs, dtype, kept, MIN_ROWS))
    return kept


def attention_rows(kv_heads: int, dim: int, dtype: torch.dtype) -> int:
    """How many rows attention's products may take (at most INVARIANT_ROWS): probed once per
    head shape and thread count (kernel_probe.py), as for the linear layers."""
    return _attention_rows(kv_heads, dim, dtype, torch.get_num_threads())


# The plan of the pass in flight. Every layer of a pass gets the same mask object, and reading
# it (and comparing a branch's keys with its previous token's) is done once per pass: the weak
# reference lets the mask go with its pass, and another pass's mask is another object.
_last_plan: tuple[weakref.ref[torch.Tensor], int, list[_Product]] | None = None


def _plan(mask: torch.Tensor | None, batch: int, queries: int, keys: int, per_product: int) -> list[_Product]:
    """The products of a pass, at most `per_product` queries each: consecutive queries of a
    row whose windows begin at one key and have one width, or a branch's consecutive tokens."""
    global _last_plan
    cached = _last_plan
    if mask is not None and cached is not None and cached[0]() is mask and cached[1] == per_product:
        return cached[2]
    products: list[_Product] = []
    for row, q, first, seen, positions in _seen_keys(mask, batch, queries, keys):
        width = -(-seen // KEY_BUCKET) * KEY_BUCKET
        last = products[-1] if products else None
        if last is not None and len(last.seen) < per_product and last.takes(row, first, seen, width, positions):
            last.seen.append(seen)
            last.positions = positions
        else:
            products.append(_Product(row, q, [seen], width, first, positions))
    if mask is not None:
        _last_plan = (weakref.ref(mask), per_product, products)
    return products


def _seen_keys(mask: torch.Tensor | None, batch: int, queries: int,
               keys: int) -> Iterator[tuple[int, int, int, int, torch.Tensor | None]]:
    """(row, query, first key, keys seen, their positions where they are not one run), for
    every query of every batch row in order."""
    allowed = None if mask is None else mask[:, 0] > torch.finfo(mask.dtype).min  # [batch, queries, keys]
    if allowed is None or bool(allowed.all()):  # a one-token step's mask mostly: read no further
        yield from ((b, q, 0, keys, None) for b in range(batch) for q in range(queries))
        return
    first = allowed.to(torch.int8).argmax(dim=2)
    last = allowed.shape[2] - 1 - allowed.flip(2).to(torch.int8).argmax(dim=2)
    count = allowed.sum(dim=2)
    whole = count == last + 1 - first  # every key from the first seen to the last
    for b, (fs, ns, runs) in enumerate(zip(first.tolist(), count.tolist(), whole.tolist())):
        for q, (f, n, run) in enumerate(zip(fs, ns, runs)):
            yield b, q, f, n, None if run else allowed[b, q].nonzero()[:, 0]


def _padded(keys: torch.Tensor, width: int) -> torch.Tensor:
    """`keys` ([kv heads, keys, dim]: a window cut short by the cache's end, or keys gathered)
    with zeros after them up to `width`."""
    short = width - keys.shape[1]
    return keys if short == 0 else torch.cat((keys, keys.new_zeros(keys.shape[0], short, keys.shape[2])), 1)


AttentionInterface.register(ATTENTION, row_invariant_attention)
AttentionMaskInterface.register(ATTENTION, eager_mask)


def make_rows_invariant(model: PreTrainedModel, onnxruntime: bool = False) -> int:
    """Row-invariant attention, and every bf16 or fp32 nn.Linear on CPU wrapped in
    RowInvariantLinear (`onnxruntime`: large fp32 layers may take ONNX Runtime's GEMM);
    returns how many."""
    model.set_attn_implementation(ATTENTION)
    started = time.perf_counter()
    replaced = replace_linears(model, lambda linear: _wrap_on_cpu(linear, onnxruntime))
    if replaced:
        layers = [m for m in model.modules() if isinstance(m, RowInvariantLinear)]
        rows = sorted({m.rows for m in layers})
        through = sum(m.form == ONNXRUNTIME for m in layers)
        _, kv_heads, dim = kv_shape(model.config)
        heads = model.config.num_attention_heads
        attention = attention_rows(kv_heads, dim, model.dtype)
        kind = _DTYPE_NAMES.get(model.dtype, str(model.dtype))
        log.info("%s on CPU made row-invariant: %d linear layers (%d through ONNX Runtime's GEMM), products of %s "
                 "rows at most, attention's of %d (the kernel probed in %.1f s)", kind, replaced, through,
                 "/".join(map(str, rows)), attention, time.perf_counter() - started)
        if attention < heads // kv_heads:
            log.warning("attention's products give a row other bits past %d rows on this machine, fewer than a "
                        "query's %d heads: a session's %s results may differ batched and alone here",
                        attention, heads // kv_heads, kind)
    return replaced


def _wrap_on_cpu(linear: nn.Linear, onnxruntime: bool) -> nn.Module | None:
    w = linear.weight
    if w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float32):
        return RowInvariantLinear(linear, onnxruntime)
    return None
