"""ONNX Runtime, imported with an error that says what to do where its build cannot run.

The edge admits ONNX Runtime from 1.17, for boards whose vendor builds stop there; those
before 1.19 were built for numpy 1 and fail to import under numpy 2 with numpy's own
message, which names neither package's fix.
"""
from __future__ import annotations

from importlib import metadata

import numpy as np

FIRST_FOR_NUMPY_2 = (1, 19)


def built_for_numpy_1() -> str | None:
    """The installed ONNX Runtime's version where numpy is 2 and that build predates it."""
    if int(np.__version__.split(".")[0]) < 2:
        return None
    for dist in ("onnxruntime", "onnxruntime-gpu"):  # the CPU build, or a Jetson's
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        major_minor = tuple(int(part) for part in version.split(".")[:2])
        return version if major_minor < FIRST_FOR_NUMPY_2 else None
    return None


try:
    import onnxruntime as ort
except ImportError as exc:
    if (old := built_for_numpy_1()) is None:
        raise
    raise ImportError(f"ONNX Runtime {old} cannot run with numpy {np.__version__} ({exc}): install 'numpy<2', "
                      "or ONNX Runtime 1.19 or newer") from exc

__all__ = ["ort"]
