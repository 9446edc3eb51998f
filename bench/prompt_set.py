"""The benchmark's fixed prompt set (prompts.json: 8 coding and 4 general chat prompts)."""
from __future__ import annotations

import json
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "prompts.json"


def benchmark_prompts() -> list[dict]:
    """Each prompt's `id`, `kind` and `text`, in the file's order."""
    return json.loads(PROMPTS_FILE.read_text())["prompts"]
