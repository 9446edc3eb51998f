"""The one-command demo: the default pair, server and edge on their own cores, one prompt.

Decodes the prompt with the edge drafting asynchronously, then again with the server
alone (edge in `none` mode), prints a comparison, and exits non-zero if the two
outputs differ or the draft agreed with the target on almost nothing (a sign of broken
weights, which would give two equal streams of noise). The server is shut down in every case.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cli_types import at_least, core
from orchestrate import run_edge, running_server, server_and_edge_cores
from prepared_pair import prepared_pair

from specsplit.common.export_meta import DraftExportMeta
from specsplit.common.help_format import DefaultsHelpFormatter
from specsplit.server.loading import resolve_dtype

# The default pair agrees on most of its drafts; a target or draft with wrong weights on ~0%.
# Judged only over enough drafts that a sound pair cannot fall under it by chance.
MIN_ACCEPTANCE = 0.10
MIN_DRAFTS_JUDGED = 20

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."


def weights_suspect(split: dict) -> bool:
    """The draft and the target agreed on almost none of enough drafts: one has wrong weights."""
    return split["drafts_proposed"] >= MIN_DRAFTS_JUDGED and split["acceptance_rate"] < MIN_ACCEPTANCE


def problems(split: dict, alone: dict) -> list[str]:
    """What is wrong with a demo run's two decodings (nothing: an empty list)."""
    found = []
    if split["token_ids"] != alone["token_ids"]:
        found.append("the split output differs from the server-alone output")
    if weights_suspect(split):
        found.append(f"the draft and the target agreed on {split['acceptance_rate']:.0%} of "
                     f"{split['drafts_proposed']} drafts (the default pair agrees on most): one of them has wrong weights")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("--server-core", type=core, help="default: the last core this process may use, where it may use two")
    p.add_argument("--edge-core", type=core, help="default: the first core this process may use, where it may use two")
    p.add_argument("--window", type=at_least(1), default=32, help="most drafts ahead (the edge sizes its lookahead up to it)")
    p.add_argument("--log", default="demo-server.log", help="server log file")
    args = p.parse_args(argv)

    print("== preparing the default models (first time: a few minutes; then seconds)", flush=True)
    pair = prepared_pair()
    server_cores, edge_cores = server_and_edge_cores()
    server_cores = [args.server_core] if args.server_core is not None else server_cores
    edge_cores = [args.edge_core] if args.edge_core is not None else edge_cores
    pinning = ", ".join(f"{role} on core {cores[0]}" if cores else f"{role} not pinned"
                        for role, cores in (("server", server_cores), ("edge", edge_cores))) + ", one thread each"
    print(f"== starting the server ({pinning})", flush=True)
    extra = ["--max-new-tokens", str(args.max_new_tokens)]
    with running_server(str(pair.target_dir), server_cores, log_path=Path(args.log)) as (address, _):
        print(f"== edge (async drafting) on {address}\n", flush=True)
        split = run_edge(address, str(pair.draft_dir), args.prompt, "async", edge_cores,
                         [*extra, "--window", str(args.window)], stream=True)
        print("\n== the same prompt decoded by the server alone (edge mode none)", flush=True)
        alone = run_edge(address, str(pair.draft_dir), args.prompt, "none", edge_cores, extra)
    identical = split["token_ids"] == alone["token_ids"]
    speedup = split["tokens_per_s"] / alone["tokens_per_s"] if alone["tokens_per_s"] else float("nan")
    print()
    print("| | tokens | tokens/s | time to first token |")
    print("| --- | --- | --- | --- |")
    for name, r in (("edge + server (async)", split), ("server alone", alone)):
        print(f"| {name} | {r['tokens']} | {r['tokens_per_s']:.2f} | {r['ttft_s'] * 1000:.0f} ms |")
    print()
    print(f"speedup: {speedup:.2f}x   acceptance rate: {split['acceptance_rate']:.0%}   "
          f"mean accepted per verification: {split['mean_accepted']:.2f}   drafts wasted: {split['drafts_wasted']}")
    print(f"pinning: {pinning}; target served in {resolve_dtype('auto', 'cpu')} on CPU (bf16 weights), "
          f"draft ONNX ({DraftExportMeta.load(pair.draft_dir).weights}) on CPU; loopback, no added delay")
    print(f"identical: {'yes' if identical else 'no'}")
    found = problems(split, alone)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    if weights_suspect(split):
        print(f"to prepare both models again from their checked GGUF files, delete {pair.target_dir.parent} "
              "and run this again", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
