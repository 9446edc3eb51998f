"""The load test's prompts, tokenized as the edges tokenize them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prompt_set import benchmark_prompts

from specsplit.edge.tokenizer import EdgeTokenizer

STUBS = (
    "def add(a, b):",
    "The quick brown fox",
    "for i in range(10):",
    "import numpy as np",
    "Hello, how are",
    "x = np.zeros",
)
# The sets, and how a report names each. "stubs": short for any tokenizer (the capacity
# runs' prompts). "benchmark": the benchmark's 12 under the target's chat template, as its
# edges send them: what a trained target reads, and so what decides how often its near-tied
# choices flip under batching on a GPU.
PROMPT_SETS = {"stubs": "short plain-text openings", "benchmark": "the benchmark's, chat template applied"}


@dataclass(frozen=True)
class PromptSet:
    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    fingerprint: str  # the target tokenizer's, as the server checks it at Open


def load_prompts(tokenizer_dir: Path, prompt_set: str = "stubs") -> PromptSet:
    """The set's prompts encoded as the edges encode them, by the tokenizer in
    `tokenizer_dir` (a target directory, or a draft export, which carries its target's)."""
    if prompt_set not in PROMPT_SETS:
        raise ValueError(f"prompt set must be one of {tuple(PROMPT_SETS)}, got {prompt_set!r}")
    edge = EdgeTokenizer(tokenizer_dir)
    if prompt_set == "stubs":
        raw = tuple(tuple(edge.encode(t, add_special_tokens=True)) for t in STUBS)  # as --raw sends them
        return PromptSet(STUBS, raw, edge.fingerprint)
    if not edge.chat_template:
        raise ValueError(f"the benchmark's prompts need a chat template; {tokenizer_dir} has none (use stubs)")
    texts = tuple(p["text"] for p in benchmark_prompts())
    return PromptSet(texts, tuple(tuple(edge.encode(edge.chat_prompt(t))) for t in texts), edge.fingerprint)
