"""ONNX Runtime linears on CPU compute what the layers they replace do, for any number of rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from specsplit.server.cpu_linear import MlasLinear, gemm_model, use_mlas_linears


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 7), (3, 5)])
def test_same_output_as_the_layer_it_wraps(bias: bool, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    wrapped = MlasLinear(linear, threads=1)
    calls = []
    run = wrapped.session.run
    wrapped.session = type("Counted", (), {"run": lambda _, *a: calls.append(1) or run(*a)})()
    x = torch.randn(*shape, 48)
    with torch.no_grad():
        want, got = linear(x), wrapped(x)
    assert got.shape == want.shape == (*shape, 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [1]  # ONNX Runtime computed it, a single row (a one-token step) too


def test_swaps_fp32_linears_of_a_model_and_keeps_its_logits() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        want = model(x)
        assert use_mlas_linears(model, threads=1, min_weights=0) == 2
        got = model(x)
    assert isinstance(model[0], MlasLinear) and isinstance(model[2][0], MlasLinear)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_leaves_other_dtypes_and_small_layers_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4), nn.Linear(512, 512))
    assert use_mlas_linears(model, threads=1) == 1  # only the layer of 512 x 512 >= MIN_WEIGHTS
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, MlasLinear]


def test_more_threads_give_the_same_output() -> None:
    torch.manual_seed(1)
    layers = [nn.Linear(32, 64) for _ in range(3)]
    x = torch.randn(5, 32)
    with torch.no_grad():
        for linear in layers:
            torch.testing.assert_close(MlasLinear(linear, threads=2)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_an_empty_batch_stays_on_pytorchs_path() -> None:
    wrapped = MlasLinear(nn.Linear(48, 80), threads=1)
    with torch.no_grad():
        assert wrapped(torch.randn(1, 0, 48)).shape == (1, 0, 80)


def test_the_layers_model_is_one_the_oldest_onnx_runtime_taken_reads() -> None:
    """The server takes ONNX Runtime from 1.17 on, which reads IR versions up to 9; the onnx
    package alone would write its newest (14 with onnx 1.23), which 1.30 refused."""
    model = gemm_model(3, 2, {"w": np.zeros((2, 3), dtype=np.float32)})
    assert model.ir_version <= 9
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
