"""What the load test ran on, for the report."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path


def gpu_name() -> str:
    """Asked in a child process: the load generator should not hold a CUDA context."""
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return f"unknown ({lines[-1] if lines else 'torch failed'})"
    return proc.stdout.strip()


def machine_info(device: str) -> dict:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    info = {"cpu": model or platform.processor(), "cores": os.cpu_count(), "arch": platform.machine(),
            "python": platform.python_version(), "device": device}
    if device == "cuda":
        info["gpu"] = gpu_name()
    return info
