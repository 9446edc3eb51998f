"""The probe of how many rows a matrix product keeps a row's bits over (kernel_probe), on
products made to lose them at known counts, and a layer built on what it finds."""
from __future__ import annotations

import logging

import pytest
import torch

from specsplit.server import row_invariant
from specsplit.server.kernel_probe import rows_kept, sensitive_weight
from specsplit.server.row_invariant import INVARIANT_ROWS, MIN_ROWS, RowInvariantLinear


def _product(loses_at: set[int] | None = None, from_row: int = 1):
    """Each row times 3 plus 1, exact; over a count in `loses_at` the rows from `from_row` on
    come out a little off, as a kernel that sums them in another order would."""
    def product(rows: torch.Tensor) -> torch.Tensor:
        out = rows.float() * 3 + 1
        if loses_at and len(rows) in loses_at:
            out[from_row:] += 1e-3
        return out
    return product


def _probe(product) -> int:  # type: ignore[no-untyped-def]
    return rows_kept(product, 16, torch.float32, INVARIANT_ROWS, MIN_ROWS)


def test_a_kernel_that_keeps_every_count_keeps_the_most() -> None:
    assert _probe(_product()) == INVARIANT_ROWS


def test_the_probe_stops_before_the_first_count_that_loses_bits() -> None:
    assert _probe(_product(set(range(8, 100)))) == 7
    assert _probe(_product({20})) == 19  # one count alone: the counts after it are not taken
    assert _probe(_product(set(range(8, 100)), from_row=7)) == 7  # a row at the end only


def sums_by_row_count(a: torch.Tensor, b: torch.Tensor, split_from: int) -> torch.Tensor:
    """a @ b (float64) as a kernel that changes its blocking by the row count would give it:
    exact below `split_from` rows of `a` (no order changes a bf16 result), and as two halves'
    float32 sums from there on. The stand-in kernel of these tests and test_row_invariant's."""
    if a.shape[-2] < split_from:
        return a.double() @ b.double()
    half, x, w = a.shape[-1] // 2, a.float(), b.float()
    return (x[..., :half] @ w[..., :half, :] + x[..., half:] @ w[..., half:, :]).double()


@pytest.mark.parametrize("shape", [(512, 1536), (48, 64)])
def test_the_probes_rows_show_a_kernel_that_sums_in_another_order(shape) -> None:
    weight = sensitive_weight(*shape, torch.bfloat16)
    def product(split_from: int):  # type: ignore[no-untyped-def]
        return lambda rows: sums_by_row_count(rows, weight.T, split_from).to(rows.dtype)

    assert rows_kept(product(18), shape[1], torch.bfloat16, INVARIANT_ROWS, MIN_ROWS) == 17
    assert rows_kept(product(99), shape[1], torch.bfloat16, INVARIANT_ROWS, MIN_ROWS) == INVARIANT_ROWS


def test_a_kernel_that_loses_bits_among_the_fewest_rows_takes_one_row_at_a_time() -> None:
    assert _probe(_product(set(range(MIN_ROWS, 100)))) == 1


def test_the_layer_takes_the_form_that_keeps_the_most_rows(monkeypatch) -> None:
    found = iter([5, 20, 12])  # packed for 32 rows, packed for one, plain
    monkeypatch.setattr(row_invariant, "_kept", {})
    monkeypatch.setattr(row_invariant, "rows_kept", lambda *args: next(found))
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16)
    forms = [hint for hint in (INVARIANT_ROWS, 1, None) if row_invariant._form(linear.weight, hint) is not None]
    layer = RowInvariantLinear(linear)
    if forms == [INVARIANT_ROWS, 1, None]:
        assert (layer.rows, layer.packed) == (20, True)
    else:  # this build packs no bf16 weight: the plain one is all there is
        assert (forms, layer.rows, layer.packed) == ([None], 5, False)
    x = torch.randn(45, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        pieces = torch.cat([layer(x[i : i + layer.rows]) for i in range(0, 45, layer.rows)])
        assert torch.equal(layer(x), pieces)  # the pieces are `rows` long


def test_a_layer_whose_kernel_keeps_no_rows_goes_row_by_row_and_says_so(monkeypatch, caplog) -> None:
    monkeypatch.setattr(row_invariant, "_kept", {})
    monkeypatch.setattr(row_invariant, "rows_kept", lambda *args: 1)
    with caplog.at_level(logging.INFO, logger=row_invariant.__name__):
        layer = RowInvariantLinear(torch.nn.Linear(64, 48).to(torch.bfloat16))
    assert layer.rows == 1
    assert any(r.levelno == logging.WARNING and "one row at a time" in r.getMessage() for r in caplog.records)
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(6)]))


def test_probes_are_kept_per_shape_and_thread_count(monkeypatch) -> None:
    """One probe per layer shape and thread count (a product's rows may split between threads
    by its size): layers of a shape probed before are not probed again; under another
    thread count they are."""
    calls = []
    monkeypatch.setattr(row_invariant, "_kept", {})
    monkeypatch.setattr(row_invariant, "rows_kept", lambda *args: calls.append(args) or INVARIANT_ROWS)
    before = torch.get_num_threads()
    probes = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            for _ in range(3):
                RowInvariantLinear(torch.nn.Linear(64, 48).to(torch.bfloat16))
            RowInvariantLinear(torch.nn.Linear(64, 40).to(torch.bfloat16))
            probes.append(len(calls))
    finally:
        torch.set_num_threads(before)
    assert probes == [2, 4, 4]


def test_the_attention_probe_finds_a_product_that_sums_by_row_count(monkeypatch) -> None:
    """Attention's products, probed as attention calls them, under a matmul that sums past 12
    rows in another order."""
    row_invariant._attention_rows.cache_clear()
    monkeypatch.setattr(torch, "matmul", lambda a, b: sums_by_row_count(a, b, 13).to(a.dtype))
    try:
        assert row_invariant.attention_rows(2, 128, torch.bfloat16) == 12
    finally:
        row_invariant._attention_rows.cache_clear()


def test_attention_takes_as_many_queries_a_product_as_the_kernel_keeps(monkeypatch) -> None:
    """Kept to 12 rows, a pass's products take two queries of 6 heads, and every query still
    gets the bits it gets alone."""
    monkeypatch.setattr(row_invariant, "attention_rows", lambda *args: 12)
    widths = []
    plan = row_invariant._plan
    monkeypatch.setattr(row_invariant, "_plan", lambda *args: widths.append(args[-1]) or plan(*args))

    class Attention(torch.nn.Module):
        num_key_value_groups = 6
        training = False

    torch.manual_seed(0)
    q = torch.randn(1, 12, 9, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 40, 128, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.zeros(1, 1, 9, 40, dtype=torch.bfloat16)
    for i in range(9):
        mask[0, 0, i, 40 - 9 + i + 1 :] = torch.finfo(torch.bfloat16).min
    with torch.inference_mode():
        together = row_invariant.row_invariant_attention(Attention(), q, k, v, mask, scaling=128**-0.5)[0]
        assert widths == [2]
        for i in range(9):
            end = 40 - 9 + i + 1
            alone = row_invariant.row_invariant_attention(Attention(), q[:, :, i : i + 1], k[:, :, :end], v[:, :, :end],
                                                          None, scaling=128**-0.5)[0]
            assert torch.equal(alone[0, 0], together[0, i])


def test_a_shape_is_probed_once_and_said_once(monkeypatch, caplog) -> None:
    """Every layer of a shape takes what its first layer's probe found, and only the first
    says so; a form this build cannot make is asked for once too."""
    calls = []
    monkeypatch.setattr(row_invariant, "_kept", {})
    monkeypatch.setattr(row_invariant, "rows_kept", lambda *args: calls.append(args) or 1)
    monkeypatch.setattr(row_invariant, "_form", lambda weight, hint: weight if hint is None else calls.append(hint))
    with caplog.at_level(logging.WARNING, logger=row_invariant.__name__):
        layers = [RowInvariantLinear(torch.nn.Linear(64, 48).to(torch.bfloat16)) for _ in range(3)]
    assert [layer.rows for layer in layers] == [1, 1, 1]
    assert len(calls) == 3  # packing for 32 rows and for one refused, the plain weight probed
    assert sum("one row at a time" in r.getMessage() for r in caplog.records) == 1
