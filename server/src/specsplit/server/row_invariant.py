"""bf16 on CPU with a row's logits independent of how many tokens its pass feeds.

Greedy verification is lossless only if the target scores a position the same whether
the position came alone (a server-only step) or among drafts (a verification). In fp32 the
rows differ by about 3e-5 and no greedy choice flips; in bf16 PyTorch's CPU kernels gave
rows up to a quarter of a logit apart, flipping near-tied choices. Two kernel choices did
that, and both depend only on the pass's shape:

- a linear layer over a single row takes a vector kernel, over two or more a matrix kernel,
  and the two sum in different orders. The matrix kernel gives a row the same bits whether
  its product holds 2 rows or 32, at any position among them, but past 32 rows it picks its
  blocking by the row count, and rows come out other bits at some counts and not at others
  (on the default target, on an Intel Xeon with AMX: the 8960-wide down projection from 33 rows on,
  the gate, up and vocabulary projections from 33 or 37; a batch of four sessions' 9 tokens
  moved a logit by a quarter). A pass of a long prompt, or of several sessions' drafts,
  holds more rows than that;
- scaled-dot-product attention's CPU kernel splits its queries into blocks by the pass's
  size. The eager path (a matmul, a softmax in fp32, a matmul) gave every query row the
  same bits on an AMD EPYC as long as no masked key came before a row's own (a batch
  left-pads the shorter sessions' caches: 3 of 170 random cases came out other bits), but
  on an Intel Xeon with AMX its products take other kernels by the number of queries and
  keys: a query among drafts came out other bits than the same query alone from the third
  draft on, and 12 prompts' greedy outputs parted in 7 of them.

So every linear takes its rows INVARIANT_ROWS at a time and at least MIN_ROWS, a short piece
padded with copies of a row (the weights are read once either way, and oneDNN's kernel for
one or two rows is slower than for four); a pass over more rows
reads the weights once per INVARIANT_ROWS of them, which a prompt's prefill and a large batch
pay for (a 44-token prefill of the default target: 616 ms against 469 on one core of that Xeon). Attention is
computed as eager attention computes it, but one query at a time over exactly the keys it
sees: a query's products have one shape wherever it is fed. Shown
bitwise by `tests/test_row_invariant.py` on a small model, and on the default target by
`bench/gpu_passes.py --target default --device cpu --dtype bf16` (its divergence check:
`bench/results/cpu-passes-bf16-invariant.md`). The static engine swaps in its own attention
and is not made so.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from specsplit.server.linear_swap import replace_linears

ATTENTION = "specsplit_row_invariant"


# The most rows one matrix product takes: up to here the kernel sums every row in one order.
INVARIANT_ROWS = 32
# The fewest: oneDNN's kernel takes one and two rows through slower paths than three to six
# (the default target's linear layers on one core of an AMD EPYC: 224 ms over two rows, 145
# over four), and gives a row the same bits from two rows to INVARIANT_ROWS.
MIN_ROWS = 4


class RowInvariantLinear(nn.Module):
    """A bf16 nn.Linear whose products take at most INVARIANT_ROWS rows at a time and at least
    MIN_ROWS (a short piece is padded with copies of its last row).

    The weight is packed once into oneDNN's blocked layout. Unpacked, every call repacks it:
    PyTorch's bf16 product on CPU is oneDNN's with a reorder of the weight first, which cost
    the default target's passes about as much again as the product itself (4 rows: 238 ms
    against 125 for its transformer layers). Packed or not, a row gets the same bits: it is
    the same kernel. Where this build of PyTorch cannot pack, the plain weight serves."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.weight = _pack(linear.weight.detach())

    @property
    def packed(self) -> bool:
        return self.weight.is_mkldnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = [self._product(piece) for piece in x.reshape(-1, self.in_features).split(INVARIANT_ROWS)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        n = len(rows)
        if n < MIN_ROWS:
            rows = torch.cat((rows, rows[-1:].expand(MIN_ROWS - n, -1)))
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        else:
            out = nn.functional.linear(rows, self.weight, self.bias)
        return out[:n]


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's layout, or as it is where this build cannot pack it."""
    if not torch.backends.mkldnn.is_available():
        return weight
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, INVARIANT_ROWS)
    except (RuntimeError, AttributeError):  # a build without the op, or a CPU oneDNN cannot pack for
        return weight


def row_invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention one query at a time over exactly the keys it may see, as eager attention
    computes it (products in the model's dtype, the softmax in fp32; no dropout: serving).

    `attention_mask` is eager's additive mask [batch, 1, queries, keys] (None: every query
    sees every key). A query of a one-token step and the same query among drafts, other
    sessions' rows or a branch then go through products of one shape over the same keys, in
    the same order: a branch's tokens, which skip the drafts they replace and any branches
    fed before theirs, attend over the keys they see gathered, as when fed in line. A query's
    heads go through as one product per key/value head: no copy of the keys per query head."""
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    scaling = kwargs.get("scaling") or dim**-0.5
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, queries, dim)
    out = query.new_empty((batch, queries, heads, dim))
    if attention_mask is None:
        spans = [[(0, key.shape[2], True)] * queries] * batch
    else:
        allowed = attention_mask[:, 0] > torch.finfo(attention_mask.dtype).min  # [batch, queries, keys]
        first = allowed.to(torch.int8).argmax(dim=2)
        last = allowed.shape[2] - 1 - allowed.flip(2).to(torch.int8).argmax(dim=2)
        whole = allowed.sum(dim=2) == last + 1 - first  # every key from the first seen to the last
        spans = [list(zip(f, e, w)) for f, e, w in zip(first.tolist(), (last + 1).tolist(), whole.tolist())]
    for b, row in enumerate(spans):
        for q, (begin, end, run) in enumerate(row):
            keys = slice(begin, end) if run else allowed[b, q].nonzero()[:, 0]
            k, v = key[b, :, keys], value[b, :, keys]  # [kv heads, keys, dim]
            scores = torch.matmul(grouped[b, :, :, q], k.transpose(1, 2)) * scaling  # [kv heads, group, keys]
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            out[b, q] = torch.matmul(weights, v).reshape(heads, dim)
    return out, None


AttentionInterface.register(ATTENTION, row_invariant_attention)
AttentionMaskInterface.register(ATTENTION, eager_mask)


def make_rows_invariant(model: PreTrainedModel) -> int:
    """Row-invariant attention, and every bf16 nn.Linear on CPU wrapped in RowInvariantLinear;
    returns how many."""
    model.set_attn_implementation(ATTENTION)
    return replace_linears(model, _pair_if_bf16_on_cpu)


def _pair_if_bf16_on_cpu(linear: nn.Linear) -> nn.Module | None:
    w = linear.weight
    return RowInvariantLinear(linear) if w.dtype == torch.bfloat16 and w.device.type == "cpu" else None
