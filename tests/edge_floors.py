"""The edge at the oldest versions its pyproject admits (constraints-oldest-edge.txt: ONNX
Runtime, tokenizers, numpy, jinja2): the same token ids, drafts and logits as in the main venv
from the same fp32 export; from the int4 one (MatMulNBits), the same first logits up to the
int4 kernels' rounding, which differs from version to version.

`make test-oldest-edge` runs its two halves: `record DIR` in the main venv, which has torch to
build and export the tiny draft, writes the exports and what the edge makes of them; `check
DIR` in the edge's own oldest venv (no torch, as on a board) does it again and compares.
The server's higher floors win in `make test-oldest`'s one venv, so the edge's are run here.
"""
from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.tokenizer import EdgeTokenizer

PROMPTS = ["def add(a, b):", "The quick brown fox", "Write a haiku about the sea."]
DRAFTED = 16  # greedy drafts per prompt
EXPORTS = ("fp32", "int4")
# Relative to the largest logit. ONNX Runtime's int4 kernels take the activations to int8
# (accuracy_level 4) and round otherwise from version to version: against 1.32, the first
# step's logits moved by 5.4% of the largest here under 1.17 (under 1.4% under 1.19), and by
# 1.1 to 1.5% on the default draft under both, where greedy drafts then part at near ties
# (acceptance may differ; the output cannot). int4 is held to its first step, within 10%: a
# kernel computing another function (zero points ignored, say) moves them by about the
# quantization's own error, 50% of the largest here. fp32 is held to every step and draft.
LOGIT_TOLERANCE = {"fp32": 1e-3, "int4": 0.1}


def what_the_edge_makes(root: Path) -> dict:
    """Per export: each prompt's ids (raw and through the chat template), its greedy drafts and
    the logits they were drawn from."""
    out: dict = {"versions": {d: metadata.version(d) for d in ("onnxruntime", "tokenizers", "numpy")}}
    for name in EXPORTS:
        tokenizer, drafter = EdgeTokenizer(root / name), OnnxDrafter(root / name)
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt, add_special_tokens=True)
            chat = tokenizer.encode(tokenizer.chat_prompt(prompt))
            line, logits = list(ids), []
            for _ in range(DRAFTED):
                step = drafter.next_logits(line)
                logits.append(step.tolist())
                line.append(int(np.argmax(step)))
            out[f"{name}/{prompt}"] = {"ids": ids, "chat": chat, "drafts": line[len(ids):], "logits": logits}
    return out


def record(root: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from specsplit.server.export import export_draft
    from tiny_models import build_model, build_tokenizer, save

    hf = save(build_model(1, layers=1), build_tokenizer(), root / "hf")
    for name in EXPORTS:
        export_draft(str(hf), root / name, quantize="none" if name == "fp32" else name)
    (root / "reference.json").write_text(json.dumps(what_the_edge_makes(root)))


def check(root: Path) -> int:
    want = json.loads((root / "reference.json").read_text())
    got = what_the_edge_makes(root)
    print(f"oldest: {got['versions']}; reference: {want['versions']}")
    problems = []
    for key in (k for k in want if k != "versions"):
        w, g, export = want[key], got[key], key.partition("/")[0]
        exact = export == "fp32"
        for field in ("ids", "chat", "drafts") if exact else ("ids", "chat"):
            if w[field] != g[field]:
                problems.append(f"{key}: {field} {g[field]} where the reference has {w[field]}")
        steps = len(w["logits"]) if exact else 1
        scale = max(abs(x) for step in w["logits"][:steps] for x in step)
        worst = max(abs(a - b) for ws, gs in zip(w["logits"][:steps], g["logits"][:steps]) for a, b in zip(ws, gs))
        if worst > LOGIT_TOLERANCE[export] * scale:
            problems.append(f"{key}: logits differ by {worst:.3g} (largest {scale:.3g})")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems:
        print(f"as the reference for {len(want) - 1} export and prompt pairs (fp32: ids, drafts and logits; "
              "int4: ids and first logits, within the int4 kernels' rounding)")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "check"):
        sys.exit("usage: edge_floors.py record|check DIR")
    directory = Path(sys.argv[2])
    if sys.argv[1] == "record":
        directory.mkdir(parents=True, exist_ok=True)
        record(directory)
    else:
        sys.exit(check(directory))
