"""Host (Python) time the server spends per session per pass, without the model's cost.

Drives the verification worker and the static engine in one process, with a one-layer,
16-wide echo model on the CPU, over N sessions of a 200-token prompt: server-only sessions,
or asynchronous ones whose edge answers every verdict at once with a window of drafts
(right with probability alpha). Each pass is timed in parts: the scheduler's pick, the
engine's own work (the model's forward subtracted), delivering the verdicts, and admitting
the edges' next drafts (the event loop's share). Writes JSON and a Markdown table.

    python bench/host_cost.py --sessions 192 --out bench/results/host-cost
"""
from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from cli_types import at_least, fraction
from loadtest.machine import machine_info
from report_files import save_report
from specsplit.protocol.messages import DraftChunk, DraftMode, OpenRequest, ServerLimits
from specsplit.protocol.server_session import ServerSession
from specsplit.server.config import SchedulerConfig
from specsplit.server.loading import LoadedModel, make_echo
from specsplit.server.scheduler import SessionHandle, VerificationWorker
from specsplit.server.static_engine import StaticEngine

PARTS = ("pick", "engine", "deliver", "drafts_in")


def _worker(sessions: int, mode: DraftMode, seed: int) -> VerificationWorker:
    config = Qwen2Config(vocab_size=1000, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    model = Qwen2ForCausalLM(config).eval()
    make_echo(model)  # greedy output known in advance: the last prompt token, repeated
    engine = StaticEngine(LoadedModel(model, None, "echo"), slots=sessions, max_len=512, graphs=False)
    worker = VerificationWorker(engine, SchedulerConfig(max_verify_tokens=15, max_batch_sessions=512,
                                                        max_batch_tokens=4096, idle_policy="wait", idle_wait_s=0.04))
    rng = random.Random(seed)
    limits = ServerLimits(1000, 500, max_new_tokens=4096)
    for i in range(sessions):
        prompt = tuple(rng.randrange(1, 1000) for _ in range(200))
        session = ServerSession(OpenRequest(prompt_ids=prompt, max_new_tokens=250, draft_mode=mode), limits, f"s{i}")
        worker.add(SessionHandle(session, asyncio.Queue(maxsize=64), kv=engine.new_state()))
    return worker


def _answer(handle: SessionHandle, window: int, alpha: float, rng: random.Random) -> None:
    """The edge's reply to a verdict: drafts up to `window` past the committed point."""
    s = handle.session
    if s.request.draft_mode is DraftMode.NONE or s.done is not None:
        return
    tip, right = s.candidate_tip, s.tokens[s.committed_len - 1]
    n = s.committed_len + window - tip
    if n > 0:
        drafts = tuple(right if rng.random() < alpha else right % 999 + 1 for _ in range(n))
        s.receive_draft(DraftChunk(tip, drafts, s._line.hash_before(tip)))


async def measure(sessions: int, mode: DraftMode, passes: int, window: int, alpha: float, seed: int) -> dict:
    worker = _worker(sessions, mode, seed)
    engine, rng = worker.engine, random.Random(seed + 1)
    forward = [0.0]
    run = engine._run

    def timed_run(b: int, f: int, kv_len: int, host: dict) -> dict:
        t = time.perf_counter()
        out = run(b, f, kv_len, host)
        forward[0] += time.perf_counter() - t
        return out

    engine._run = timed_run  # type: ignore[method-assign]
    # Pass costs as a GPU would show them (a fixed part plus a part per padded token), so
    # that the width cut behaves as it does there.
    for drafts in range(16):
        worker.costs.observe(drafts, 0.02 + 0.001 * drafts)
    for padded in (sessions, 2 * sessions, 4 * sessions, 8 * sessions):
        worker.pass_costs.observe(padded, 0.007 + 3e-5 * padded)
    for handle in worker.sessions.values():
        _answer(handle, window, alpha, rng)  # an edge drafts as soon as its session is open
    spent = dict.fromkeys(PARTS, 0.0)
    rows = drafts_verified = 0
    for n in range(passes + 3):  # three passes of prefill and warm-up, not counted
        t0 = time.perf_counter()
        batch, _ = worker._pick()
        t1 = time.perf_counter()
        assert batch, "every session answers at once, so every pass has some"
        forward[0] = 0.0
        results = engine.verify_batch([share.item for share in batch])
        t2 = time.perf_counter()
        for share, result in zip(batch, results):
            worker._deliver(share, result, 0.02)
            while not share.handle.outbox.empty():
                share.handle.outbox.get_nowait()
        t3 = time.perf_counter()
        for share in batch:
            _answer(share.handle, window, alpha, rng)
        t4 = time.perf_counter()
        if n >= 3:
            for part, seconds in zip(PARTS, (t1 - t0, t2 - t1 - forward[0], t3 - t2, t4 - t3)):
                spent[part] += seconds
            rows += len(batch)
            drafts_verified += sum(len(share.task.drafts) for share in batch)
    return {"mode": mode.name.lower(), "sessions": sessions, "passes": passes, "rows_per_pass": rows / passes,
            "drafts_per_row": drafts_verified / rows,
            "us_per_row": {part: 1e6 * spent[part] / rows for part in PARTS},
            "us_per_row_total": 1e6 * sum(spent.values()) / rows}


def render(report: dict) -> str:
    m = report["machine"]
    lines = [f"# Server host time per session per pass ({report['sessions']} sessions)", "",
             f"- machine: {m['cpu']}, {m['cores']} cores ({m['arch']}), Python {m['python']}, torch {report['torch']}; "
             "one process, one torch thread, unpinned",
             "- model: one-layer, 16-wide qwen2 echo model on the CPU (its forward subtracted); static engine",
             f"- async edges answer each verdict at once, window {report['window']}, alpha {report['alpha']}; "
             f"{report['passes']} passes after three of warm-up; the least of {report['repeats']} repeats per part",
             "", "| mode | pick | engine | deliver | drafts in | total us per session per pass |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        us = r["us_per_row"]
        lines.append(f"| {r['mode']} | {us['pick']:.1f} | {us['engine']:.1f} | {us['deliver']:.1f} | "
                     f"{us['drafts_in']:.1f} | {r['us_per_row_total']:.1f} |")
    lines += ["", f"Rerun: `python bench/host_cost.py --sessions {report['sessions']} --out OUT`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=at_least(1), default=192, help="sessions in every pass (default 192)")
    p.add_argument("--passes", type=at_least(1), default=60, help="timed passes per repeat (default 60)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="repeats; each part's least is kept (default 3)")
    p.add_argument("--window", type=int, default=16, help="async edges' lookahead (default 16)")
    p.add_argument("--alpha", type=fraction, default=0.68, help="async edges' per-draft acceptance (default 0.68)")
    p.add_argument("--out", type=Path, default=Path("bench/results/host-cost"), help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for mode in (DraftMode.NONE, DraftMode.ASYNC):
        runs = []
        for i in range(args.repeats):
            print(f"{mode.name.lower()}: repeat {i + 1} of {args.repeats} ...", flush=True)
            runs.append(asyncio.run(measure(args.sessions, mode, args.passes, args.window, args.alpha, seed=i)))
        best = dict(runs[0], us_per_row={part: min(r["us_per_row"][part] for r in runs) for part in PARTS})
        best["us_per_row_total"] = sum(best["us_per_row"].values())
        results.append(best)
    report = {"machine": machine_info("cpu"),
              "torch": torch.__version__, "sessions": args.sessions, "passes": args.passes, "repeats": args.repeats,
              "window": args.window, "alpha": args.alpha, "results": results}
    save_report(args.out.parent, args.out.name, report, render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
