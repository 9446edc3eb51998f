"""Over how many rows a matrix product gives every row the bits it gets alone, on this machine.

Row-invariant bf16 and fp32 on CPU (row_invariant.py) rest on the matrix kernel summing a row in one
order whatever else shares its product, up to some number of rows. That number is the
kernel's, not PyTorch's API's, and it moves with the CPU, the PyTorch build, the layer's
shape, the thread count and how the weight is handed over. With PyTorch 2.13 on an AMD EPYC
and on an Intel Xeon with AMX, oneDNN's product kept a row's bits from 2 to 32 rows for every
layer shape of the default target; with PyTorch 2.11 on an Intel Xeon with AMX, the weight
packed for 32 rows lost them from 5 to 18 rows by shape, the weight packed for one row kept
them for most shapes but not all (the 8960-wide down projection from 28 rows on; with 16
threads the 256-wide key and value projections from 8), and the plain weight kept them for
most but lost them from 10 rows on for that down projection with one thread. So the rows a layer's products may take are measured when the layer is built,
once per shape, way of handing over the weight and thread count.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

Product = Callable[[torch.Tensor], torch.Tensor]  # rows [n, in features] -> [n, out features]

# Products of n rows start at row n % SHIFTS of the probe's rows: rows move to other positions
# from one count to the next, and the probe needs no more than SHIFTS rows past the most.
SHIFTS = 5
# Each probe row holds +BIG and -BIG at two inputs whose weight columns are equal: the two
# terms cancel exactly, and the small terms summed between them lose bits to rounding at
# BIG's scale, so a row's result depends on the order of its sum far more than in plain data.
# With plain random rows a kernel that summed another way (with 16 threads on an Intel Xeon
# with AMX, the 512-wide head of the test model at even counts from 18 rows) changed a row's
# bf16 result in 12 of 200 products, and a probe of one product a count missed it. Summing
# the two halves of a row apart changes 11% of a row's bf16 results with these rows, against
# 0.04% with plain ones (1536 inputs).
BIG = 2.0**16
PAIRS = 16  # pairs of equal weight columns, spread over the inputs
WEIGHT_BLOCK = 4096


def _pair_columns(in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = min(PAIRS, in_features // 2)
    columns = torch.randperm(in_features, generator=torch.Generator().manual_seed(0))[: 2 * pairs]
    return columns[:pairs], columns[pairs:]


def sensitive_weight(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """A weight of a layer's shape to probe with: random, with pairs of equal columns. (Its
    rows repeat every WEIGHT_BLOCK: a vocabulary projection's weight is made in a second, not
    ten, and a sum's order is the kernel's, whatever the values.)"""
    block = torch.randn(min(out_features, WEIGHT_BLOCK), in_features, generator=torch.Generator().manual_seed(1))
    first, second = _pair_columns(in_features)
    block[:, second] = block[:, first]
    block = (block / in_features**0.5).to(dtype)
    return block.repeat(-(-out_features // len(block)), 1)[:out_features]


def _sensitive_rows(n: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, each with +BIG and -BIG at the inputs of one pair of equal weight columns."""
    generator = torch.Generator().manual_seed(2)
    first, second = _pair_columns(in_features)
    x = torch.randn(n, in_features, generator=generator)
    pair = torch.randint(0, len(first), (n,), generator=generator)
    x[torch.arange(n), first[pair]] = BIG
    x[torch.arange(n), second[pair]] = -BIG
    return x.to(dtype)


def rows_kept(product: Product, in_features: int, dtype: torch.dtype, most: int, fewest: int) -> int:
    """The largest n up to `most` such that every product of `fewest` to n rows gives each of
    them the bits it gets in a product of `fewest` copies of itself (a lone row, padded as
    row_invariant pads it); 1 where even `fewest` rows do not, since a lone row is that product.
    `product` should multiply by sensitive_weight's weight, which the probe's rows are made for."""
    x = _sensitive_rows(most + SHIFTS, in_features, dtype)
    with torch.inference_mode():
        alone = [product(row.repeat(fewest, 1))[0] for row in x.split(1)]
        kept = 1
        for n in range(fewest, most + 1):
            start = n % SHIFTS
            out = product(x[start : start + n])
            if not all(torch.equal(out[i], alone[start + i]) for i in range(n)):
                break
            kept = n
    return kept
