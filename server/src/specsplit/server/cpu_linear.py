"""Faster fp32 linear layers on CPU, for every pass size.

A verification feeds the target a handful of tokens at once. PyTorch's default CPU GEMM
handles a few rows poorly: on a 2-core AVX2 server a whole 1.5B pass over 2 tokens cost
twice one over 1 token, and 8 tokens about three times, although the pass reads the same
weights and a single core could do the arithmetic for about 9 tokens in the time the
weights take to stream from memory. ONNX Runtime's GEMM (MLAS) packs the weights once,
when the layer is built, and keeps small batches near memory speed: the same passes cost
1.2x (2 tokens) and 1.7x (8 tokens) one token. On an AVX-512 server it is also the quicker
path for a single token (212 against 294 ms a pass, one thread), so every pass takes it,
single-token steps included. Measured per pass size by `bench/gpu_passes.py --target default
--device cpu --cpu-linear ...` (`bench/results/cpu-passes-*.md`).
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnx import ModelProto, TensorProto, helper
from torch import nn

from specsplit.server.linear_swap import replace_linears

# Smaller layers stay on PyTorch's path: their weights are read from cache in microseconds,
# and a call into ONNX Runtime costs a few tens of them (the tests' tiny models).
MIN_WEIGHTS = 1 << 18
OPSET = 17


def _session_options(threads: int) -> ort.SessionOptions:
    """Each layer's session gets its own pool of `threads`. Its workers sleep between calls
    instead of spinning: hundreds of layers take turns, and a spinning pool would steal the
    cores from the next layer's. (A process-wide pool would be leaner, but once made it breaks
    every other session in the process that has its own threads, such as an ONNX drafter.)"""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # one node: nothing to fuse
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _external(name: str, array: np.ndarray) -> TensorProto:
    """An initializer whose data the session is handed from memory (no copy into the model)."""
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=array.shape,
                         data_location=TensorProto.EXTERNAL)
    for key, value in (("location", name), ("offset", "0"), ("length", str(array.nbytes))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def gemm_model(in_features: int, out_features: int, inits: dict[str, np.ndarray]) -> ModelProto:
    """One Gemm node, y = x w^T (+ b), its initializers `inits` ("w", and "b" if any) handed
    over from memory. Its IR version is the oldest its opset allows: left to the onnx package,
    it is that package's newest (14 with onnx 1.23), which ONNX Runtime 1.30 refuses to load."""
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", *inits], ["y"], transB=1)], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", in_features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", out_features])],
        [_external(name, array) for name, array in inits.items()],
    )
    opsets = [helper.make_opsetid("", OPSET)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))


class MlasLinear(nn.Module):
    """Wraps an fp32 nn.Linear: ONNX Runtime at inference; the original under autograd, for
    other dtypes and for an empty batch."""

    def __init__(self, linear: nn.Linear, threads: int) -> None:
        super().__init__()
        self.linear = linear
        # Gemm with transB takes PyTorch's (out, in) weight as it is, handed over without a copy;
        # the session packs its own copy once, when it is built.
        inits = {"w": linear.weight.detach().numpy()}
        if linear.bias is not None:
            inits["b"] = linear.bias.detach().numpy()
        options = _session_options(threads)
        options.add_external_initializers(list(inits), [ort.OrtValue.ortvalue_from_numpy(a) for a in inits.values()])
        model = gemm_model(linear.in_features, linear.out_features, inits)
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows == 0 or x.dtype != torch.float32 or torch.is_grad_enabled():
            return self.linear(x)
        (y,) = self.session.run(None, {"x": x.reshape(rows, -1).contiguous().numpy()})
        return torch.from_numpy(y).reshape(*x.shape[:-1], self.linear.out_features)


def use_mlas_linears(model: nn.Module, threads: int | None = None, min_weights: int = MIN_WEIGHTS) -> int:
    """Swap every fp32 nn.Linear of `model` (on CPU) with at least `min_weights` weights for
    MlasLinear; returns how many. `threads` defaults to PyTorch's own thread count."""
    threads = threads or torch.get_num_threads()

    def wrap(linear: nn.Linear) -> nn.Module | None:
        w = linear.weight
        if w.dtype == torch.float32 and w.device.type == "cpu" and w.numel() >= min_weights:
            return MlasLinear(linear, threads)
        return None

    return replace_linears(model, wrap)
