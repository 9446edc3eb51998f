"""Outside anchor: Hugging Face assisted generation, both models in one process.

Meant to run pinned to one core (run_bench.py pins it; alone, use taskset); uses one torch thread, and for both models the dtype the server
picks on this CPU (`--dtype auto`), the target loaded as the server loads it, so that its
output can be compared with the server's, the draft as transformers loads it. Prints one JSON object per prompt: tokens, seconds,
tokens/s, token ids.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from cli_types import at_least
from specsplit.server.loading import load_model, resolve_dtype


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="HF directory or GGUF of the draft model")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("prompts", nargs="+")
    args = p.parse_args()
    torch.set_num_threads(1)
    dtype = resolve_dtype("auto", "cpu")
    target = load_model(args.target, dtype=dtype, onnxruntime_linears=True)  # as serve loads it
    draft = load_model(args.draft, dtype=dtype, rows_invariant=False)  # transformers' own: the server never runs it
    tok = target.tokenizer
    for prompt in args.prompts:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(ids, assistant_model=draft.model, max_new_tokens=args.max_new_tokens,
                                        do_sample=False)
        elapsed = time.perf_counter() - start
        new = out[0, ids.shape[1]:].tolist()
        print(json.dumps({"tokens": len(new), "elapsed_s": elapsed, "tokens_per_s": len(new) / elapsed,
                          "token_ids": new}), flush=True)


if __name__ == "__main__":
    main()
