"""The target's decoder linears in FP8 (e4m3), for GPUs with FP8 matrix units (Hopper on).

Where verification passes are bound by the matrix products (a 7B target's split passes on an
H200 run them at the card's bf16 peak: docs/capacity.md), FP8 products double that peak.
Weights get one scale per output channel, activations one per token as they come, so a row's
result depends only on that row: batching does not mix rows' scales. The output head stays
in the model's dtype, since the argmax over a large vocabulary is where rounding shows first.

This changes the model's numbers: the FP8 target is the target that is served, and speculative
decoding stays lossless with respect to it (every mode, server-only included, runs the same
weights). `torch._scaled_mm` also runs on CPU, which the tests use; there it is no faster.
"""
from __future__ import annotations

import torch
from torch import nn

from specsplit.server.linear_swap import replace_linears

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# The layers FP8 serves: every decoder linear. _scaled_mm wants both of a product's inner
# dimensions in multiples of 16, which every Qwen2 shape's projections are.
ALIGN = 16


def _scales(x: torch.Tensor) -> torch.Tensor:
    """One scale per row of `x`, mapping its largest magnitude to FP8's."""
    return (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)


def _quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _scales(rows)
    return (rows.float() / scale).to(FP8), scale


# Eager, quantizing a pass's activations takes five kernels per linear, each reading the
# whole activation: on a GPU they cost more than FP8 saves. Compiled, one or two.
_quantize_compiled = torch.compile(_quantize, dynamic=True)


class Fp8Linear(nn.Module):
    """nn.Linear with e4m3 weights and per-token e4m3 activations."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        scale = _scales(weight)  # [out, 1]
        self.register_buffer("weight", (weight.float() / scale).to(FP8))
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out], as _scaled_mm takes it
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_dtype = weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        quantized, scale = (_quantize_compiled if rows.is_cuda else _quantize)(rows)
        out = torch._scaled_mm(quantized, self.weight.t(), scale_a=scale, scale_b=self.weight_scale,
                               out_dtype=self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def _servable(linear: nn.Linear) -> bool:
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


def use_fp8_linears(model: nn.Module) -> int:
    """Serve every linear of `model`'s decoder in FP8; returns how many were replaced."""
    return replace_linears(model.get_decoder(), lambda linear: Fp8Linear(linear) if _servable(linear) else None)
