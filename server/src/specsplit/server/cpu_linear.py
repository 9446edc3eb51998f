"""Faster fp32 linear layers on CPU for verification-sized batches.

On CPUs where the default BLAS handles a handful of rows poorly (cost growing almost
linearly from 1 to 16 rows), oneDNN's inner product is up to twice as fast for the
2-48 token batches verification produces. Single-token steps stay on the default
path, which is quicker there. Measured per layer in the benchmark report.
"""
from __future__ import annotations

import torch
from torch import nn

ONEDNN_MIN_ROWS = 2


class OneDNNLinear(nn.Module):
    """Wraps an nn.Linear: oneDNN for >= ONEDNN_MIN_ROWS rows, the original below."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.weight_onednn = linear.weight.detach().to_mkldnn()
        self.bias_onednn = linear.bias.detach().to_mkldnn() if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < ONEDNN_MIN_ROWS or x.dtype != torch.float32 or torch.is_grad_enabled():
            return self.linear(x)
        y = torch._C._nn.mkldnn_linear(x.reshape(rows, -1).to_mkldnn(), self.weight_onednn, self.bias_onednn)
        return y.to_dense().reshape(*x.shape[:-1], -1)


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every fp32 nn.Linear of `model` (on CPU) for OneDNNLinear; returns how many."""
    if not torch.backends.mkldnn.is_available():
        return 0
    swapped = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(module, child_name, OneDNNLinear(child))
                swapped += 1
    return swapped
