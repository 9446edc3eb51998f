"""The speed ceiling: the ONNX draft model decoding greedily on its own (no server).

Prints one JSON object per prompt: tokens, seconds, tokens/s, token ids.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from cli_types import at_least
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.tokenizer import EdgeTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--draft", required=True)
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("prompts", nargs="+")
    args = p.parse_args()
    directory = Path(args.draft)
    tok = EdgeTokenizer(directory)
    drafter = OnnxDrafter(directory, threads=1)
    eos = set(drafter.meta.eos_ids)
    for prompt in args.prompts:
        drafter.reset()
        seq = tok.encode(tok.chat_prompt(prompt))
        start, out = time.perf_counter(), []
        while len(out) < args.max_new_tokens:
            t = int(np.argmax(drafter.next_logits(seq)))
            seq.append(t)
            out.append(t)
            if t in eos:
                break
        elapsed = time.perf_counter() - start
        print(json.dumps({"tokens": len(out), "elapsed_s": elapsed, "tokens_per_s": len(out) / elapsed,
                          "token_ids": out}), flush=True)


if __name__ == "__main__":
    main()
