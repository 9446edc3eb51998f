"""Session fixtures: tiny models built here, exported through the real exporter, and a
real server process on a loopback port."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tiny_models import build_model, build_tokenizer, save

PROBE_PROMPT = "def add(a, b):"


@dataclass
class TinyModels:
    target_dir: Path
    draft_dir: Path  # ONNX export of a different model
    same_dir: Path  # ONNX export of the target itself: every draft is accepted
    eos_id: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    from specsplit.server.export import export_draft

    root = tmp_path_factory.mktemp("models")
    tok = build_tokenizer()
    probe = build_model(0)
    ids = torch.tensor([tok(PROBE_PROMPT)["input_ids"]])
    with torch.no_grad():
        cont = probe.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
    # An eos the target really produces: the first token that has not appeared before, past a few steps.
    eos = next(t for i, t in enumerate(cont) if i >= 5 and t not in cont[:i])
    target = save(build_model(0, eos_id=eos), tok, root / "target")
    draft_hf = save(build_model(1, layers=1, eos_id=eos), tok, root / "draft-hf")
    draft = root / "draft"
    export_draft(str(draft_hf), draft)
    same = root / "same"
    export_draft(str(target), same)
    return TinyModels(target, draft, same, eos)


def wait_healthy(address: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError(f"server at {address} did not become healthy")


@pytest.fixture(scope="session")
def server(tiny: TinyModels, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable, "-m", "specsplit.server.cli", "serve",
        "--target", str(tiny.target_dir), "--port", str(port), "--threads", "1", "--max-lookahead", "32",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    address = f"127.0.0.1:{port}"
    try:
        wait_healthy(address, proc)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(log.read_text()[-3000:])
