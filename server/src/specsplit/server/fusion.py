"""torch.compile of a decoder's pointwise-heavy modules, for the static engine's graphs.

A GPU pass of the static engine is captured into a CUDA graph, so its launch overhead is
gone, but every eager elementwise op still reads and writes its whole tensor: a 7B pass
over 144 rows of 12 tokens spent a third of its GPU time outside the matrix products,
much of it in the RMS norms (computed in float32, five ops each) and the MLP's SiLU and
product (docs/capacity.md). Compiled, each norm and each activation is one fused kernel;
the matrix products stay cuBLAS's. Attention and the cache stay eager: the slot cache's
indexing and the grouped attention are already few kernels, and compiling the whole layer
or model took minutes and ran slower there.
"""
from __future__ import annotations

import torch
import torch._dynamo  # its config is set below

# Room for every layer's modules, should a torch build keep a graph per module instance
# rather than per class, and for norms that see inputs of several ranks (a model with query
# and key norms): above that, dynamo leaves the rest eager, correct but unfused.
RECOMPILE_LIMIT = 64


def _fusable(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("RMSNorm") or name.endswith("MLP")


Replaced = list[tuple[torch.nn.Module, str, torch.nn.Module]]  # (parent, attribute, original module)


def fuse_pointwise(model: torch.nn.Module) -> Replaced:
    """Replace every RMS norm and MLP inside the decoder (each layer's, and the final norm)
    by its torch.compile'd self, compiled lazily on first use. Returns what it replaced.

    Shapes are dynamic, so one compiled graph serves every pass shape but those with a
    single row or a single token (sizes 1 are specialised): four per class and input rank,
    shared by all the layers' modules of that class. The replaced modules' names gain
    `_orig_mod.`: a fused model is for serving, not for saving (`unfuse` first)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    replaced: Replaced = []
    for parent in list(model.get_decoder().modules()):  # listed first: a compiled module wraps the original
        for name, child in list(parent.named_children()):
            if _fusable(child):
                setattr(parent, name, torch.compile(child, dynamic=True))
                replaced.append((parent, name, child))
    return replaced


def unfuse(replaced: Replaced) -> None:
    """Put the original modules back."""
    for parent, name, original in replaced:
        setattr(parent, name, original)
