"""The load test's prompts, tokenized with the target's own tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from specsplit.common.fingerprint import vocab_fingerprint

PROMPTS = (
    "def add(a, b):",
    "The quick brown fox",
    "for i in range(10):",
    "import numpy as np",
    "Hello, how are",
    "x = np.zeros",
)


@dataclass(frozen=True)
class PromptSet:
    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    fingerprint: str  # the target tokenizer's, as the server checks it at Open


def load_prompts(target_dir: Path, texts: tuple[str, ...] = PROMPTS) -> PromptSet:
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    ids = tuple(tuple(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    return PromptSet(texts, ids, vocab_fingerprint(tok.get_vocab()))
