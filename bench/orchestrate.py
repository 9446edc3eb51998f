"""Start a specsplit server and edges as separate processes pinned to their own cores.

Used by the demo and the benchmarks: the server gets one core, the edge the other,
one thread each, so on a small machine they do not steal time from each other.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc

from cli_types import START_CORES, check_cores
from specsplit.common.signals import exit_on_sigterm

BIN = Path(sys.executable).parent


def machine() -> dict:
    """The CPU a benchmark ran on, for its report."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "native_bf16": "avx512_bf16" in text or "amx_bf16" in text}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(cores: Sequence[int] | None):  # type: ignore[no-untyped-def]
    """A preexec_fn pinning the child to `cores` (None: no pinning). Raises ValueError for a
    core this process may not use: the child would run unpinned while a report says otherwise."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return None
    check_cores(cores)
    chosen = set(cores)
    return lambda: os.sched_setaffinity(0, chosen)


def server_and_edge_cores() -> tuple[list[int] | None, list[int] | None]:
    """A server's core and its edge's: the last and the first this process may use; both None
    (unpinned) where it has fewer than two."""
    have = sorted(START_CORES)
    return ([have[-1]], [have[0]]) if len(have) >= 2 else (None, None)


def wait_healthy(address: str, proc: subprocess.Popen, timeout: float) -> None:
    # Here, not at the top: a load generator for a server it did not start imports this
    # module, and needs no health stubs (the edge package does not bring them).
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"the server at {address} was not ready within {timeout:.0f} s")


@contextmanager
def running_server(target: str, cores: Sequence[int] | None, extra: Sequence[str] = (), log_path: Path | None = None,
                   dtype: str = "auto", threads: int = 1, ready_timeout: float = 600.0, wait: bool = True):
    """Yield (host:port, process) of a server; it is stopped (SIGTERM, then SIGKILL) in every case.

    With wait=False the caller waits for readiness itself (a TLS server, say)."""
    port = free_port()
    cmd = [sys.executable, "-m", "specsplit.server.cli", "serve", "--target", str(target), "--port", str(port),
           "--dtype", dtype, "--threads", str(threads), *extra]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin(cores),
                            env={**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})
    # A plain `kill`, a job's timeout or systemd end the driver alone with SIGTERM, which
    # Python does not turn into an exception: the server was left running, holding its core.
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        if wait:
            wait_healthy(f"127.0.0.1:{port}", proc, ready_timeout)
        yield f"127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def exited(pid: int) -> bool:
    """Whether the process `pid` (a server this process started) has ended: gone, or a zombie
    not yet reaped, whose memory would read 0."""
    import psutil  # (here: a load generator for a server elsewhere has no psutil, and no pid)

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def run_edge(server: str, draft: str, prompt: str, mode: str, cores: Sequence[int] | None,
             extra: Sequence[str] = (), stream: bool = False, threads: int = 1) -> dict:
    """Run one edge generation; returns its stats JSON (with text and token ids)."""
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        # --retries 0: a run that lost its stream fails, rather than being measured with its
        # backoff and its server's idle time in it.
        cmd = [str(BIN / "specsplit-edge"), "generate", "--server", server, "--draft", draft, "--mode", mode,
               "--threads", str(threads), "--retries", "0", "--stats-json", str(stats), *extra, prompt]
        proc = subprocess.run(cmd, stdout=None if stream else subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=pin(cores), env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if proc.returncode != 0:
            raise RuntimeError(f"edge ({mode}) failed with status {proc.returncode}: {proc.stderr.strip()}")
        return json.loads(stats.read_text())
