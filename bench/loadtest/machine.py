"""What the load test ran on, for the report."""
from __future__ import annotations

import subprocess
import sys

from orchestrate import machine


def gpu_name() -> str:
    """Asked in a child process: the load generator should not hold a CUDA context."""
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return f"unknown ({lines[-1] if lines else 'torch failed'})"
    return proc.stdout.strip()


def machine_info(device: str) -> dict:
    m = machine()
    info = {"cpu": m["cpu"], "cores": m["cores"], "arch": m["machine"], "python": m["python"], "device": device}
    if device == "cuda":
        info["gpu"] = gpu_name()
    return info
