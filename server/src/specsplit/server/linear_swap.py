"""Replace a model's nn.Linear layers in place, for the CPU paths that wrap them."""
from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_linears(model: nn.Module, wrap: Callable[[nn.Linear], nn.Module | None]) -> int:
    """Put `wrap(layer)` in the place of every nn.Linear of `model` for which it returns a
    module (None leaves the layer as it is); returns how many were replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and (wrapper := wrap(child)) is not None:
                setattr(module, name, wrapper)
                replaced += 1
    return replaced
