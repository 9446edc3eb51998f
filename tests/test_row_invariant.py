"""bf16 and fp32 on CPU: a row's logits are the same bits whatever its pass's size (row_invariant).

Greedy verification is only exact if the target scores a position identically alone (a
server-only step) and among drafts or other sessions (a verification). The check runs a
session one token at a time, then feeds the same tokens as drafts in passes of 3 and 5,
and beside another session of a different length, and compares every logit row bitwise.
The same check under a kernel that sums by the row count, with the probe of that kernel
bypassed, must find a difference, or the first check would prove nothing. (PyTorch's own
bf16 model differs too on an AMD EPYC, but not on every machine: on an Intel Xeon with AMX
and PyTorch 2.11, with one thread, it gave these passes the same bits. PyTorch's own fp32 model
differed in all four on an AMD EPYC: its lone rows take a vector kernel.) The bf16 checks need
a CPU with native bf16, where the server serves bf16; the fp32 ones run everywhere.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specsplit.server.engine import TargetEngine, VerifyItem
from specsplit.server.loading import LoadedModel, cpu_has_fast_bf16, load_model
from specsplit.server import row_invariant
from specsplit.server.row_invariant import (ATTENTION, INVARIANT_ROWS, MIN_ROWS, ONNXRUNTIME, RowInvariantLinear,
                                            make_rows_invariant, row_invariant_attention)
from test_kernel_probe import sums_by_row_count

needs_bf16 = pytest.mark.skipif(not cpu_has_fast_bf16(), reason="the CPU has no native bf16; serving stays in fp32 there")
# The server's forms of a CPU target: bf16; fp32 with ONNX Runtime's GEMM for its large layers
# (the default) and without (--cpu-linear default).
SERVED = [pytest.param(torch.bfloat16, False, id="bf16", marks=needs_bf16),
          pytest.param(torch.float32, True, id="fp32-onnxruntime"), pytest.param(torch.float32, False, id="fp32")]

STEPS = 12


def _model(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Qwen2ForCausalLM:
    # As wide as the default target (1536): narrower layers get the same bits from a one-row
    # product as from a matrix one, and would not show what pairing lone rows is for.
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=512, hidden_size=1536, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(config).to(dtype).eval()


def _rows(engine: TargetEngine, prompt: list[int], tokens: list[int], chunk: int,
          other: list[int] | None = None) -> list[np.ndarray]:
    """Logit rows for the positions after `prompt`, feeding `tokens` `chunk` at a time (the
    first of each chunk as committed, the rest as drafts), with `other` in every pass."""
    state, other_state = engine.new_state(), engine.new_state()
    rows: list[np.ndarray] = []
    while len(rows) < len(tokens):
        done = len(rows)
        items = [VerifyItem(state, prompt + tokens[:done], tokens[done:done + chunk - 1])]
        if other is not None:
            items.append(VerifyItem(other_state, other + tokens[:done], []))
        rows.extend(engine.verify_batch(items)[0])
    return rows[: len(tokens)]


def _compare(model: Qwen2ForCausalLM) -> list[bool]:
    engine = TargetEngine(LoadedModel(model, None, "test"))  # type: ignore[arg-type]
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, 512, 9)]
    other = [int(t) for t in rng.integers(0, 512, 21)]
    tokens = [int(t) for t in rng.integers(0, 512, STEPS)]
    alone = _rows(engine, prompt, tokens, 1)
    return [all(np.array_equal(a, b) for a, b in zip(alone, _rows(engine, prompt, tokens, chunk, extra)))
            for chunk, extra in ((3, None), (5, None), (1, other), (4, other))]


@torch.inference_mode()
@pytest.mark.parametrize("dtype, onnxruntime", SERVED)
def test_rows_do_not_depend_on_the_pass(dtype, onnxruntime) -> None:
    model = _model(dtype=dtype)
    assert make_rows_invariant(model, onnxruntime) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    forms = {m.form for m in model.modules() if isinstance(m, RowInvariantLinear)}
    assert (ONNXRUNTIME in forms) == onnxruntime  # every layer is at least MIN_WEIGHTS
    assert _compare(model) == [True, True, True, True]


def _sums_by_row_count(weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """A linear layer's product under a stand-in kernel that sums past MIN_ROWS rows in
    another order."""
    out = sums_by_row_count(rows, weight.T, MIN_ROWS + 1)
    return (out if bias is None else out + bias.double()).to(rows.dtype)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=needs_bf16),
                                   pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("probed", [True, False])
def test_a_kernel_that_sums_by_row_count_is_kept_to_the_rows_it_holds(monkeypatch, probed, dtype) -> None:
    """Under a kernel that sums past MIN_ROWS rows in another order, the probe keeps every
    product to MIN_ROWS rows and the passes give every row its bits; the control: told the
    kernel holds INVARIANT_ROWS, the check finds rows that differ."""
    monkeypatch.setattr(row_invariant, "_kept", {})
    monkeypatch.setattr(row_invariant, "_form", lambda weight, hint: weight if hint is None else None)
    monkeypatch.setattr(row_invariant, "_linear", _sums_by_row_count)
    if not probed:
        monkeypatch.setattr(row_invariant, "rows_kept", lambda *args: INVARIANT_ROWS)
    model = _model(dtype=dtype)
    make_rows_invariant(model)
    assert {m.rows for m in model.modules() if isinstance(m, RowInvariantLinear)} == {MIN_ROWS if probed else INVARIANT_ROWS}
    if probed:
        assert _compare(model) == [True, True, True, True]
    else:
        assert not all(_compare(model))


class _Attention(torch.nn.Module):
    """What the attention functions read of a qwen2 attention module: 12 heads over 2 key/value heads."""

    num_key_value_groups = 6
    training = False


def _alone_and_among_others(attention: Callable, heads: int = 12) -> list[bool]:
    """Per case, whether every query of a pass (causal, over its cache and the pass's
    tokens) has the bits it has fed alone over the keys up to its own. The lengths cross
    several of row_invariant's key windows; 17 queries take several products."""
    torch.manual_seed(0)
    results, module, kw = [], _Attention(), {"scaling": 128**-0.5, "dropout": 0.0}
    for length in range(20, 220, 13):
        for queries in (2, 5, 9, 12, 17):
            q = torch.randn(1, heads, queries, 128, dtype=torch.bfloat16)
            k, v = (torch.randn(1, 2, length, 128, dtype=torch.bfloat16) for _ in range(2))
            mask = torch.zeros(1, 1, queries, length, dtype=torch.bfloat16)
            for i in range(queries):
                mask[0, 0, i, length - queries + i + 1 :] = torch.finfo(torch.bfloat16).min
            together = attention(module, q, k, v, mask, **kw)[0]
            end = length - queries + 1
            results.append(all(torch.equal(attention(module, q[:, :, i : i + 1], k[:, :, : end + i], v[:, :, : end + i],
                                                     None, **kw)[0][0, 0], together[0, i]) for i in range(queries)))
    return results


@needs_bf16
@torch.inference_mode()
@pytest.mark.parametrize("heads", [12, 4, 2])
def test_a_query_gets_the_same_attention_alone_and_among_others(heads) -> None:
    """Eager attention's products take other kernels by the number of queries and keys on a
    CPU with AMX (the control, where the CPU shows it: 8 of 675 queries); the row-invariant
    attention gives every query the bits it gets alone, with 6, 2 or 1 query heads per
    key/value head (a lone query's one or two rows are padded as the linear layers' are)."""
    assert all(_alone_and_among_others(row_invariant_attention, heads))
    if heads == 12 and "amx_bf16" in _cpu_flags():
        eager = sys.modules[Qwen2ForCausalLM.__module__].eager_attention_forward
        assert not all(_alone_and_among_others(eager))


@pytest.mark.parametrize("dtype, onnxruntime", SERVED)
def test_row_invariant_linear_computes_the_layer(monkeypatch, dtype, onnxruntime) -> None:
    monkeypatch.setattr(row_invariant, "MIN_WEIGHTS", 0)  # ONNX Runtime's GEMM for a layer this small too
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 384).to(dtype)
    x = torch.randn(5, 256, dtype=dtype)
    wrapped = RowInvariantLinear(linear, onnxruntime)
    assert (wrapped.form == ONNXRUNTIME) == onnxruntime
    with torch.inference_mode():
        whole = wrapped(x)
        for i in range(5):
            assert torch.equal(wrapped(x[i : i + 1]), whole[i : i + 1])
        assert wrapped(x[None, 2:3]).shape == (1, 1, 384)
        assert torch.allclose(whole.float(), linear(x).float(), rtol=0.02, atol=0.02)


# Row counts of one product: a prompt's prefill or a batch of several sessions' drafts holds
# more than INVARIANT_ROWS; 65 leaves a lone row in the last piece.
ROW_COUNTS = (1, 2, 9, 32, 33, 36, 45, 57, 64, 65, 80)


def _rows_by_count(linear: torch.nn.Module, x: torch.Tensor) -> list[bool]:
    """Per row count, whether every row of a product over that many rows has the bits it has
    in a two-row product."""
    with torch.inference_mode():
        pairs = torch.cat([linear(x[i : i + 2]) for i in range(0, len(x), 2)])
        return [torch.equal(linear(x[None, :n])[0], pairs[:n]) for n in ROW_COUNTS]


@pytest.mark.parametrize("dtype, onnxruntime", SERVED)
@pytest.mark.parametrize("shape", [(8960, 1536), (1536, 8960), (1536, 256)])
def test_row_invariant_linear_over_many_rows(shape, dtype, onnxruntime) -> None:
    """The default target's down, up and key projections: in the pieces this machine's kernel
    keeps a row's bits over, every count gives the bits of two rows. (The plain layer's rows
    differ at some of these counts on some machines and not on others: test_kernel_probe.py
    shows the probe finding such counts, and the model-level control below shows a
    difference everywhere.)"""
    torch.manual_seed(0)
    linear = torch.nn.Linear(*shape, bias=False).to(dtype)
    x = torch.randn(max(ROW_COUNTS) + 1, shape[0], dtype=dtype)
    wrapped = RowInvariantLinear(linear, onnxruntime)
    assert all(_rows_by_count(wrapped, x))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def _padded_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """(query, keys, values, left padding) of one row, at lengths and paddings a batch makes."""
    torch.manual_seed(0)
    cases = []
    for length in range(20, 120, 3):
        for pad in (1, 5, 13, 16, 31):
            q = torch.randn(1, 12, 1, 128, dtype=torch.bfloat16)
            k, v = (torch.randn(1, 2, length, 128, dtype=torch.bfloat16) for _ in range(2))
            cases.append((q, k, v, pad))
    return cases


def _alone_and_left_padded(attention) -> list[bool]:  # type: ignore[no-untyped-def]
    layer = _model().model.layers[0].self_attn
    same = []
    for q, k, v, pad in _padded_cases():
        alone = attention(layer, q, k, v, None, scaling=128**-0.5)[0]
        # A batch of two: this row left-padded by `pad`, beside a row that is not.
        zeros = torch.zeros(1, 2, pad, 128, dtype=torch.bfloat16)
        padded_k, padded_v = torch.cat([zeros, k], 2), torch.cat([zeros, v], 2)
        keys = torch.cat([padded_k, torch.randn_like(padded_k)])
        values = torch.cat([padded_v, torch.randn_like(padded_v)])
        mask = torch.zeros(2, 1, 1, pad + k.shape[2], dtype=torch.bfloat16)
        mask[0, ..., :pad] = torch.finfo(torch.bfloat16).min
        batched = attention(layer, torch.cat([q, torch.randn_like(q)]), keys, values, mask, scaling=128**-0.5)[0]
        same.append(torch.equal(batched[:1], alone))
    return same


@needs_bf16
@torch.inference_mode()
def test_left_padding_does_not_change_a_row() -> None:
    """Eager attention over a left-padded row sums in other lanes than alone (the control
    finds some case that differs); row_invariant_attention skips the padding."""
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    assert all(_alone_and_left_padded(row_invariant_attention))
    assert not all(_alone_and_left_padded(eager_attention_forward))


def _alone_and_with_a_hole(attention) -> list[bool]:  # type: ignore[no-untyped-def]
    layer = _model().model.layers[0].self_attn
    same = []
    for q, k, v, hole in _padded_cases():
        alone = attention(layer, q, k, v, None, scaling=128**-0.5)[0]
        # A branch's token: the keys of the drafts it replaces lie among its own, masked.
        split = k.shape[2] // 2
        junk = torch.randn(1, 2, hole, 128, dtype=torch.bfloat16)
        keys, values = (torch.cat([t[:, :, :split], junk, t[:, :, split:]], 2) for t in (k, v))
        mask = torch.zeros(1, 1, 1, keys.shape[2], dtype=torch.bfloat16)
        mask[..., split : split + hole] = torch.finfo(torch.bfloat16).min
        same.append(torch.equal(attention(layer, q, keys, values, mask, scaling=128**-0.5)[0], alone))
    return same


@needs_bf16
@torch.inference_mode()
def test_keys_a_query_skips_do_not_change_it() -> None:
    """Masked keys among a query's own shift the rest to other lanes, as left padding does
    (the control finds some case that differs); row_invariant_attention gathers the keys
    the query sees."""
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

    assert all(_alone_and_with_a_hole(row_invariant_attention))
    assert not all(_alone_and_with_a_hole(eager_attention_forward))


def _branches_see_each_other(module, query, key, value, mask, **kwargs):  # type: ignore[no-untyped-def]
    """The control: the later branch also sees the earlier one's keys, as a tree mask that
    left them visible would have it."""
    seen = mask.clone()
    seen[0, 0, 1] = torch.maximum(mask[0, 0, 0], mask[0, 0, 1])
    return row_invariant_attention(module, query, key, value, seen, **kwargs)


def _two_branches_alone_and_together(attention) -> list[bool]:  # type: ignore[no-untyped-def]
    layer = _model().model.layers[0].self_attn
    same = []
    for q, k, v, n in _padded_cases():
        # The last token of each of two branches, fed after the line's keys: the first stands
        # beside the draft at fork[0], the second beside the one at fork[1].
        length, sizes, forks = k.shape[2], (n % 4 + 1, 2), (k.shape[2] // 3, k.shape[2] // 2)
        branch_k, branch_v = ([torch.randn(1, 2, size, 128, dtype=torch.bfloat16) for size in sizes] for _ in range(2))
        queries = torch.cat([q, torch.randn_like(q)], 2)
        mask = torch.full((1, 1, 2, length + sum(sizes)), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16)
        begin = length
        for i, (size, fork) in enumerate(zip(sizes, forks)):
            mask[0, 0, i, :fork] = mask[0, 0, i, begin : begin + size] = 0
            begin += size
        together = attention(layer, queries, torch.cat([k, *branch_k], 2), torch.cat([v, *branch_v], 2), mask,
                             scaling=128**-0.5)[0]
        for i, fork in enumerate(forks):
            keys, values = torch.cat([k[:, :, :fork], branch_k[i]], 2), torch.cat([v[:, :, :fork], branch_v[i]], 2)
            alone = row_invariant_attention(layer, queries[:, :, i : i + 1], keys, values, None, scaling=128**-0.5)[0]
            same.append(torch.equal(together[:, i : i + 1], alone))
    return same


@needs_bf16
@torch.inference_mode()
def test_a_branch_is_not_changed_by_another_fed_before_it() -> None:
    """Two branches in one row: the later one's tokens skip the earlier one's keys as well as
    the drafts from its own position on. row_invariant_attention gathers the keys per branch.
    (Gathered with the keys either sees, the ones a branch skips masked, the later one's keys
    shifted lanes and changed bits in some cases on an AMD EPYC, not on an Intel Xeon with
    AMX and PyTorch 2.11.) The control sees what a branch should not, and must differ."""
    assert all(_two_branches_alone_and_together(row_invariant_attention))
    assert not all(_two_branches_alone_and_together(_branches_see_each_other))


def test_a_pass_goes_through_few_products() -> None:
    """A row of a pass (a cache of 20 keys, a line of 10 tokens, a branch of 7 beside its third
    token and one of 3 beside its fourth) takes five products, not one per query: the line in
    two windows of 5 queries (30 rows of 6 heads), each branch's consecutive tokens together
    over its keys gathered, at most 5 at a time."""
    from specsplit.server.row_invariant import _plan

    cache, line, queries = 20, 10, 20
    visible = torch.zeros(queries, cache + queries, dtype=torch.bool)
    visible[:, :cache] = True
    visible[:, cache:] = torch.ones(queries, queries, dtype=torch.bool).tril()
    visible[line:17, cache + 2 : cache + line] = False  # the first branch skips the drafts from its own place on
    visible[17:, cache + 3 : cache + 17] = False  # the second, those and the first branch
    mask = torch.zeros(1, 1, queries, cache + queries, dtype=torch.bfloat16)
    mask[0, 0].masked_fill_(~visible, torch.finfo(torch.bfloat16).min)
    plan = _plan(mask, 1, queries, cache + queries, per_product=5)
    assert [(p.q0, p.seen) for p in plan] == [(0, [21, 22, 23, 24, 25]), (5, [26, 27, 28, 29, 30]),
                                              (10, [23, 24, 25, 26, 27]), (15, [28, 29]), (17, [24, 25, 26])]
    assert [p.positions is None for p in plan] == [True, True, False, False, False]
    assert _plan(mask, 1, queries, cache + queries, per_product=5) is plan  # read once per pass


def test_loading_on_cpu_makes_rows_invariant(tiny, monkeypatch) -> None:
    """The server loads through load_model: on CPU, bf16 and fp32 come out row-invariant, the
    large fp32 layers through ONNX Runtime's GEMM where asked for; a model to be saved stays
    as it was loaded."""
    monkeypatch.setattr(row_invariant, "MIN_WEIGHTS", 0)  # the tiny model's layers are all small
    for dtype, onnxruntime in (("bf16", True), ("fp32", False), ("fp32", True)):
        model = load_model(str(tiny.target_dir), dtype=dtype, onnxruntime_linears=onnxruntime).model
        assert model.config._attn_implementation == ATTENTION
        layers = [m for m in model.modules() if isinstance(m, RowInvariantLinear)]
        assert layers and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert all((m.form == ONNXRUNTIME) == (onnxruntime and dtype == "fp32") for m in layers), dtype
    kept = load_model(str(tiny.target_dir), dtype="fp32", rows_invariant=False).model
    assert kept.config._attn_implementation != ATTENTION
    assert not any(isinstance(m, RowInvariantLinear) for m in kept.modules())


def _in_line(engine: TargetEngine, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """Logit rows after prompt, prompt + tokens[:1], ...: one token a pass."""
    return _rows(engine, prompt, tokens, 1) + [engine.verify_batch([VerifyItem(engine.new_state(), prompt + tokens, [])])[0][0]]


@torch.inference_mode()
@pytest.mark.parametrize("dtype, onnxruntime", SERVED)
@pytest.mark.parametrize("beside", [False, True])
def test_a_branch_scores_as_if_fed_in_place_of_the_drafts(beside, dtype, onnxruntime) -> None:
    """A pass that feeds drafts and, after them, two branches standing beside two of them:
    every row is the bits the same tokens get fed in line, and after the cache takes up the
    second branch, the next pass's rows are too (alone, and beside a session of another length)."""
    model = _model(dtype=dtype)
    make_rows_invariant(model, onnxruntime)
    engine = TargetEngine(LoadedModel(model, None, "test"))  # type: ignore[arg-type]
    rng = np.random.default_rng(2)
    prompt, other = ([int(t) for t in rng.integers(0, 512, n)] for n in (9, 17))
    first, drafts, early, branch, after = ([int(t) for t in rng.integers(0, 512, n)] for n in (1, 9, 7, 3, 2))
    state = engine.new_state()
    engine.verify_batch([VerifyItem(state, prompt, [])])
    extra = [VerifyItem(engine.new_state(), other, [])] if beside else []
    item = VerifyItem(state, prompt + first, drafts, branches=[(1, early), (2, branch)])
    rows = engine.verify_batch([item, *extra])[0]
    main, aside = rows[: len(drafts) + 1], rows[len(drafts) + 1 :]
    assert all(np.array_equal(a, b) for a, b in zip(main, _in_line(engine, prompt + first, drafts), strict=True))
    line = [*_in_line(engine, prompt + first, drafts[:1] + early)[2:],
            *_in_line(engine, prompt + first, drafts[:2] + branch)[3:]]
    assert all(np.array_equal(a, b) for a, b in zip(aside, line, strict=True))
    state.take_branch(1)
    assert state.tokens == prompt + first + drafts[:2] + branch
    committed = prompt + first + drafts[:2] + branch
    rows = engine.verify_batch([VerifyItem(state, committed, after), *extra])[0]
    assert all(np.array_equal(a, b) for a, b in zip(rows, _in_line(engine, committed, after), strict=True))
