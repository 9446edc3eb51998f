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
  size. The eager path (a matmul, a softmax in fp32, a matmul) gives every query row the
  same bits, and masked keys after a row's own cost nothing, but masked keys before them
  do: a batch left-pads the shorter sessions' caches, which shifts where their keys fall
  in the vector lanes of the softmax's sum and of the product with the values (3 of 170
  random cases came out other bits).

So every linear takes its rows INVARIANT_ROWS at a time, a lone row as two copies of itself
(two rows cost what one does: the weights are read once either way); a pass over more rows
reads the weights once per INVARIANT_ROWS of them, which a prompt's prefill and a large batch
pay for (a 44-token prefill of the default target: 616 ms against 469 on one core of that Xeon). Attention is the model's own eager
attention, run per batch row from the first key that row can see. Shown
bitwise by `tests/test_row_invariant.py` on a small model, and on the default target by
`bench/gpu_passes.py --target default --device cpu --dtype bf16` (its divergence check:
`bench/results/cpu-passes-bf16-invariant.md`). The static engine swaps in its own attention
and is not made so.
"""
from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from specsplit.server.linear_swap import replace_linears

ATTENTION = "specsplit_row_invariant"


# The most rows one matrix product takes: up to here the kernel sums every row in one order.
INVARIANT_ROWS = 32


class RowInvariantLinear(nn.Module):
    """Wraps a bf16 nn.Linear so that its products take at most INVARIANT_ROWS rows at a time
    and at least two (a lone row goes through as two copies of itself)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if 1 < rows <= INVARIANT_ROWS:
            return self.linear(x)
        out = torch.cat([self._product(piece) for piece in x.reshape(rows, -1).split(INVARIANT_ROWS)])
        return out.reshape(*x.shape[:-1], self.linear.out_features)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if len(rows) > 1:
            return self.linear(rows)
        return self.linear(torch.cat((rows, rows)))[:1]


def row_invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """The model's eager attention, each batch row over its keys from the first it may see.

    `attention_mask` is eager's additive mask [batch, 1, queries, keys]; a key no query of a
    row may see is left padding. Queries that may not see some key between the row's first
    and their last (a branch's tokens, which skip the drafts they replace and any branches
    fed before theirs) attend over just the keys they see, gathered, branch by branch: the
    same keys, in the same places, as when fed in line."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    if attention_mask is None:
        return eager(module, query, key, value, None, **kwargs)[0], None
    allowed = attention_mask[:, 0] > torch.finfo(attention_mask.dtype).min  # [batch, queries, keys]
    visible = allowed.any(dim=1)
    firsts = visible.to(torch.int8).argmax(dim=1).tolist()  # argmax: the first visible key
    # A query's keys are one run from its row's first when it sees every key up to its last.
    last = allowed.shape[2] - 1 - allowed.flip(2).to(torch.int8).argmax(dim=2)
    holes = allowed.sum(dim=2) != last + 1 - torch.tensor(firsts)[:, None]
    if not any(firsts) and not holes.any():
        return eager(module, query, key, value, attention_mask, **kwargs)[0], None
    rows = []
    for b, first in enumerate(firsts):
        def part(queries: torch.Tensor | slice, keys: torch.Tensor | slice) -> torch.Tensor:
            return eager(module, query[b : b + 1, :, queries], key[b : b + 1, :, keys], value[b : b + 1, :, keys],
                         attention_mask[b : b + 1, :, queries][..., keys], **kwargs)[0]

        if not holes[b].any():
            rows.append(part(slice(None), slice(first, None)))
            continue
        out = query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))
        inline, aside = (~holes[b]).nonzero()[:, 0], holes[b].nonzero()[:, 0]
        out[:, inline] = part(inline, slice(first, None))
        # A branch's tokens skip one run of keys, which ends where the branch begins: that
        # end tells branches apart.
        columns = torch.arange(allowed.shape[2])
        skipped = ~allowed[b, aside] & (columns >= first) & (columns < last[b, aside, None])
        ends = (skipped * columns).amax(dim=1)
        for end in ends.unique().tolist():
            group = aside[ends == end]
            # The keys any of them sees, in order; each sees a run of them from the first.
            out[:, group] = part(group, allowed[b, group].any(dim=0).nonzero()[:, 0])
        rows.append(out)
    return torch.cat(rows), None


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
