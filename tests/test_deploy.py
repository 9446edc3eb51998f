"""Deployment files: the compose file is valid, and the edge image installs no torch."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("torch", "transformers", "triton", "nvidia-")


def compose_cli() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]])
def test_compose_file_is_valid(profile) -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("no compose implementation installed (.ci/run installs one)")
    proc = subprocess.run([*cli, "-f", str(ROOT / "docker-compose.yml"), *profile, "config"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "specsplit-server" in proc.stdout and "service_healthy" in proc.stdout


def edge_image_sources() -> list[Path]:
    """The local packages the edge Dockerfile installs, mapped back to this checkout."""
    text = (ROOT / "docker" / "edge.Dockerfile").read_text()
    (line,) = [l for l in text.splitlines() if l.startswith("RUN pip install")]
    return [ROOT / p.removeprefix("/src/") for p in re.findall(r"/src/\w+", line)]


def test_edge_image_installs_no_torch(tmp_path) -> None:
    sources = edge_image_sources()
    assert {p.name for p in sources} == {"shared", "edge"}
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
         str(report), *map(str, sources)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "onnxruntime" in names and "specsplit-edge" in names
    assert not [n for n in names if n.startswith(FORBIDDEN)], names


def test_the_build_context_holds_what_the_images_copy_and_no_local_build_output() -> None:
    rules = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "*"  # an allow list: nothing new enters the context unnamed
    copied = {line.split()[1] for name in ("server", "edge") for line in
              (ROOT / "docker" / f"{name}.Dockerfile").read_text().splitlines() if line.startswith("COPY ")}
    assert copied == {"shared", "server", "edge"}
    assert {f"!{source}" for source in copied} <= set(rules)
    assert {"**/build", "**/*.egg-info"} <= set(rules)


def test_compose_builds_the_gpu_image_apart_and_lets_the_server_drain() -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("no compose implementation installed (.ci/run installs one)")
    env = {**os.environ, "TORCH_INDEX_URL": "https://cpu.example/whl"}
    env.pop("TORCH_GPU_INDEX_URL", None)
    proc = subprocess.run([*cli, "-f", str(ROOT / "docker-compose.yml"), "--profile", "gpu", "config"],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    cpu, gpu = services["server"], services["server-gpu"]
    # A CPU-only torch index for the CPU image must not make the GPU image a CPU one.
    assert cpu["build"]["args"]["TORCH_INDEX_URL"] == "https://cpu.example/whl"
    assert not gpu["build"]["args"]["TORCH_INDEX_URL"] and gpu["image"] != cpu["image"]
    for name in ("server", "server-gpu"):
        service = services[name]
        assert service["init"] is True  # PID 1 would ignore SIGTERM until serve installs its handler
        grace = service.get("stop_grace_period", "10s")  # compose's default: shorter than a drain
        assert grace.endswith("s") and float(grace[:-1]) > 10 + 1.2, grace
