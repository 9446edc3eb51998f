"""The pass-time and divergence benchmark runs on CPU, on random and on real (here tiny) weights."""
from __future__ import annotations

import json

from gpu_passes import chat_prompts, main
from loadtest.rerun import rerun_command
from tiny_models import TinyModels


def test_rerun_line_hides_local_paths_but_keeps_default() -> None:
    placeholders = {"--target": "TARGET_DIR", "--out-dir": "OUT_DIR"}
    line = rerun_command("bench/x.py", ["--target", "/m/t", "--out-dir=/r", "--name", "n"], placeholders)
    assert line == "python bench/x.py --target TARGET_DIR --out-dir=OUT_DIR --name n"
    assert rerun_command("bench/x.py", ["--target", "default"], placeholders, keep={"default"}) == \
        "python bench/x.py --target default"
    assert rerun_command("bench/x.py", ["--target", "default"], placeholders) == "python bench/x.py --target TARGET_DIR"


def test_a_real_target_decodes_the_benchmark_prompts_and_the_report_names_no_local_path(
        tiny: TinyModels, tmp_path) -> None:
    prompts = chat_prompts(tiny.target_dir, 14)
    assert len(prompts) == 14 and prompts[12] == prompts[0]  # the 12 prompts, cycled
    assert len(set(map(tuple, prompts))) == 12
    out = tmp_path / "out"
    argv = ["--target", str(tiny.target_dir), "--device", "cpu", "--batches", "1,2", "--tokens", "1,3", "--kv-len", "16",
            "--repeats", "1", "--divergence-sessions", "3", "--divergence-steps", "4", "--threads", "1",
            "--name", "gp", "--out-dir", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "gp.json").read_text())
    div = report["archs"][tiny.target_dir.name]["divergence"]
    assert div["lockstep_vs_alone"]["sessions_diverged"] == 0  # fp32 on CPU: batching changes nothing
    assert div["speculative_vs_alone"]["sessions_diverged"] == 0
    assert div["prompts"].startswith("the benchmark's prompts")  # what the check decoded, recorded by it
    assert str(tmp_path) not in report["rerun"] and "--target TARGET_DIR" in report["rerun"]
    assert "the benchmark's prompts" in (out / "gp.md").read_text()
