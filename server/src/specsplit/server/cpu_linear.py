"""ONNX Runtime's GEMM for fp32 linear layers on CPU: quicker at every pass size.

A verification feeds the target a handful of tokens at once. PyTorch's default CPU GEMM
handles a few rows poorly: on a 2-core AVX2 server a whole 1.5B pass over 2 tokens cost
twice one over 1 token, and 8 tokens about three times, although the pass reads the same
weights and a single core could do the arithmetic for about 9 tokens in the time the
weights take to stream from memory. ONNX Runtime's GEMM (MLAS) packs the weights once,
when the layer is built, and keeps small batches near memory speed: the same passes cost
1.2x (2 tokens) and 1.7x (8 tokens) one token. On an AVX-512 server it is also the quicker
path for a single token (212 against 294 ms a pass, one thread), so every pass takes it,
single-token steps included. Measured per pass size by `bench/gpu_passes.py --target default
--device cpu --cpu-linear ...` (`bench/results/cpu-passes-*.md`). It is one of the ways a
row-invariant layer may hand over its weight (row_invariant.py), taken where its probe finds
that it gives every row its own bits.
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnx import ModelProto, TensorProto, helper

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


class OnnxRuntimeProduct:
    """rows [n, in] -> rows [n, out] of an fp32 linear layer (weight [out, in], bias), by ONNX
    Runtime's GEMM with `threads` threads."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> None:
        if weight.dtype != torch.float32:
            raise ValueError(f"ONNX Runtime's linear layers take fp32 weights, not {weight.dtype}")
        # Gemm with transB takes PyTorch's (out, in) weight as it is, handed over without a copy
        # (so the arrays are kept here); the session packs its own copy once, when it is built.
        self._inits = {"w": weight.detach().numpy()}
        if bias is not None:
            self._inits["b"] = bias.detach().numpy()
        options = _session_options(threads)
        options.add_external_initializers(list(self._inits),
                                          [ort.OrtValue.ortvalue_from_numpy(a) for a in self._inits.values()])
        model = gemm_model(weight.shape[1], weight.shape[0], self._inits)
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        (y,) = self.session.run(None, {"x": rows.detach().contiguous().numpy()})
        return torch.from_numpy(y)
