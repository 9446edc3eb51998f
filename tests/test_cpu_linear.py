"""ONNX Runtime's GEMM on CPU computes what the fp32 layers it stands in for do, for any
number of rows; a row-invariant layer takes it only where asked for, for large fp32 layers."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from specsplit.server import row_invariant
from specsplit.server.cpu_linear import MIN_WEIGHTS, OnnxRuntimeProduct, gemm_model
from specsplit.server.row_invariant import ONNXRUNTIME, RowInvariantLinear


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_same_output_as_the_layer(threads: int, bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    product = OnnxRuntimeProduct(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(), threads)
    x = torch.randn(rows, 48)
    with torch.no_grad():
        torch.testing.assert_close(product(x), linear(x), rtol=1e-5, atol=1e-5)


def test_only_fp32_weights() -> None:
    with pytest.raises(ValueError, match="fp32"):
        OnnxRuntimeProduct(torch.zeros(4, 4, dtype=torch.bfloat16), None, 1)


def test_a_layer_takes_it_only_where_asked_for_large_fp32_weights() -> None:
    """A lone row goes through as it is: ONNX Runtime's GEMM keeps its bits from one row on."""
    torch.manual_seed(0)
    large = nn.Linear(512, MIN_WEIGHTS // 512)
    small = nn.Linear(64, 64)
    layer = RowInvariantLinear(large, onnxruntime=True)
    assert (layer.form, layer.fewest) == (ONNXRUNTIME, 1)
    assert RowInvariantLinear(large).form != ONNXRUNTIME
    assert RowInvariantLinear(small, onnxruntime=True).form != ONNXRUNTIME
    assert RowInvariantLinear(nn.Linear(512, MIN_WEIGHTS // 512).to(torch.bfloat16), onnxruntime=True).form != ONNXRUNTIME
    calls = []
    product = layer.product
    layer.product = lambda rows: calls.append(len(rows)) or product(rows)
    with torch.inference_mode():
        layer(torch.randn(1, 1, 512))
    assert calls == [1]


def test_an_empty_batch_gives_no_rows() -> None:
    layer = RowInvariantLinear(nn.Linear(512, MIN_WEIGHTS // 512), onnxruntime=True)
    with torch.inference_mode():
        assert layer(torch.randn(1, 0, 512)).shape == (1, 0, MIN_WEIGHTS // 512)


def test_where_its_probe_keeps_fewer_rows_a_pytorch_form_serves(monkeypatch) -> None:
    monkeypatch.setattr(row_invariant, "_kept", {})
    monkeypatch.setattr(row_invariant, "rows_kept", lambda product, *args:
                        3 if isinstance(product, OnnxRuntimeProduct) else row_invariant.INVARIANT_ROWS)
    layer = RowInvariantLinear(nn.Linear(512, MIN_WEIGHTS // 512), onnxruntime=True)
    assert layer.form != ONNXRUNTIME and layer.rows == row_invariant.INVARIANT_ROWS


def test_the_layers_model_is_one_the_oldest_onnx_runtime_taken_reads() -> None:
    """The server takes ONNX Runtime from 1.17 on, which reads IR versions up to 9; the onnx
    package alone would write its newest (14 with onnx 1.23), which 1.30 refused."""
    model = gemm_model(3, 2, {"w": np.zeros((2, 3), dtype=np.float32)})
    assert model.ir_version <= 9
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
