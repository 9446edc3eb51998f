"""Tokenizer fingerprint: edge and server must agree on every token id.

Computed from the vocabulary (token string -> id, added tokens included), which the
`tokenizers` library (edge) and transformers (server) both expose identically.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping


def vocab_fingerprint(vocab: Mapping[str, int]) -> str:
    canonical = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
