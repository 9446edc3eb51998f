"""What one point measured, as a JSON-ready dict: client-side speeds and latencies per
session and message, acceptance, errors, and the server's own counters."""
from __future__ import annotations

import math
import os
from collections import Counter

import numpy as np

from loadtest.scrape import Snapshot, counter_delta, histogram_delta
from loadtest.sessions import GenerationRecord, LoadRun, LoadSpec, SessionLog
from loadtest.timeline import Acceptance, percentiles

MB = 2**20
SATURATED = 0.9  # load generator CPU, as a share of the cores it may use, above which it is the bottleneck


def _speeds(values: list[float]) -> dict:
    return {"min": min(values), "p50": float(np.median(values)), "max": max(values), "values": values}


def session_speeds(sessions: list[SessionLog]) -> list[float]:
    """Each session's tokens/s under the point's full load: what it committed in the measured
    window, over the time from its first generation's start (or the window's opening, if
    later: after a ramp and warm-up) until the deadline. Generations started
    before the deadline run to their end, but past it ever fewer sessions remain and the last
    ones speed up; counted in, they made the sessions that happened to end late look faster
    than they ran under the load (a 192-session GPU point showed a group of sessions a fifth
    faster than the rest). Without a deadline (a set number of generations), tokens over the
    time spent generating them."""
    return [s.tokens_per_s_under_load for s in sessions]


def generating_share(records: list[GenerationRecord]) -> float | None:
    """Of the time from a session's first generation's start to its last one's end, the share
    spent in generations (the rest: between a Done and the next start); None if no time."""
    if not records:
        return None
    span = records[-1].started_at + records[-1].elapsed_s - records[0].started_at
    return sum(r.elapsed_s for r in records) / span if span > 0 else None


def by_process(sessions: list[SessionLog], procs: int) -> list[dict]:
    """The sessions of each load-generator process, side by side; processes left without a session are left out. Server-only
    GPU points showed every session of a process at one speed and the processes apart by up
    to a sixth (the server's pacing, docs/capacity.md). Only what ran under the point's load
    is compared: the generations that run on past the deadline, with ever fewer sessions,
    are quicker, and a process whose sessions started one more of them would look quicker
    in anything pooled over whole generations."""
    out = []
    for proc in range(procs):
        mine = [s for s in sessions if s.process == proc]
        if not mine:
            continue
        records = [r for s in mine for r in s.records]
        shares = [share for s in mine if (share := generating_share(s.records)) is not None]
        speeds = session_speeds(mine)
        out.append({
            "process": proc,
            "sessions": len(mine),
            "tok_s_min": min(speeds),
            "tok_s_mean": float(np.mean(speeds)),
            "generating_share": float(np.mean(shares)) if shares else None,
            "ttft_ms": percentiles([r.ttft_s * 1000 for r in records if r.ttft_s is not None]),
        })
    return out


def _pooled(sessions: list[SessionLog], attr: str) -> dict | None:
    return percentiles([x for s in sessions for r in s.records for x in getattr(r, attr)])


def _acceptance(sessions: list[SessionLog], kind: str, spec: LoadSpec) -> dict:
    records = [r for s in sessions if s.kind == kind for r in s.records]
    acc = sum((r.acceptance for r in records), Acceptance())
    out = {
        "alpha_measured": acc.per_token,
        "accepted_over_proposed": acc.accepted / acc.proposed if acc.proposed else None,
        "drafts_verified": acc.proposed,
        "drafts_accepted": acc.accepted,
        "rejections": acc.rejections,
        "drafts_made": sum(r.drafts_made for r in records),
        "drafts_wasted": sum(r.drafts_wasted for r in records),
        "branches_taken": sum(r.branches_taken for r in records),
    }
    return {"alpha_set": spec.settings.alpha, **out} if kind == "sim" else out


def _quantile_bucket(hist: dict, q: float) -> tuple[float | None, float | None]:
    """Where a histogram's q-quantile falls, in ms: (the upper bound of its bucket, None), or
    (None, the last finite bound) where it lies past every bound; (None, None) if empty. JSON
    has no infinity: a bound of +Inf written as a number would make the report unreadable to
    strict parsers."""
    if not hist.get("count"):
        return None, None
    seen, last = 0.0, None
    for le, n in hist["buckets"].items():
        seen += n
        bound = float(le)
        if seen >= q * hist["count"]:
            return (bound * 1000, None) if math.isfinite(bound) else (None, last)
        last = bound * 1000 if math.isfinite(bound) else last
    return None, last


def server_figures(before: Snapshot, after: Snapshot, wall_s: float, kv_peak: float | None, rss_peak: float | None) -> dict:
    """The server's figures from its metrics `before` and `after`, `wall_s` apart; KV and RSS peaks in bytes."""
    # {} where the server lacks a histogram (batch tokens: newer servers only).
    passes = histogram_delta(before, after, "specsplit_verification_seconds") or {}
    batch = histogram_delta(before, after, "specsplit_verification_batch_sessions") or {}
    batch_tokens = histogram_delta(before, after, "specsplit_verification_batch_tokens") or {}
    drafts = histogram_delta(before, after, "specsplit_verification_drafts") or {}
    lag = histogram_delta(before, after, "specsplit_event_loop_lag_seconds") or {}
    mean_pass = passes.get("mean")
    lag_below, lag_above = _quantile_bucket(lag, 0.99)
    return {
        "tokens_committed": counter_delta(before, after, "specsplit_tokens_committed"),
        "passes": passes.get("count"),
        "passes_per_s": passes["count"] / wall_s if passes and wall_s > 0 else None,
        "mean_pass_ms": mean_pass * 1000 if mean_pass is not None else None,
        "batch_sessions_mean": batch.get("mean"),
        "batch_sessions_buckets": batch.get("buckets"),
        "batch_tokens_mean": batch_tokens.get("mean"),
        "drafts_per_verification_mean": drafts.get("mean"),
        "loop_lag_mean_ms": lag["mean"] * 1000 if lag.get("mean") is not None else None,
        "loop_lag_p99_below_ms": lag_below,
        "loop_lag_p99_above_ms": lag_above,  # set only where the p99 lies past the last bound
        "kv_peak_mb": None if kv_peak is None else kv_peak / MB,
        "rss_peak_mb": None if rss_peak is None else rss_peak / MB,
    }


def summarize(run: LoadRun, spec: LoadSpec, before: Snapshot, after: Snapshot, kv_peak: float | None,
              rss_peak: float | None, client_procs: int = 1, server_span_s: float | None = None) -> dict:
    """The point's figures; the server's from the metrics `before` and `after`, taken
    `server_span_s` apart (None: at the point's start and end)."""
    sessions = run.sessions
    wall = run.finished - run.started
    # Server speed over the measured window only: the last generations run past the
    # deadline with ever fewer sessions, which would understate the loaded throughput.
    # A run merged from several load-generator processes may span more than one window (runs
    # given their own starts did: by seconds on a sweep's first point, understating the speed
    # by 28% on one GPU run); the set length is the window.
    window = spec.settings.duration_s if spec.settings.duration_s is not None else wall
    errors: Counter = sum((s.errors for s in sessions), Counter())
    kinds = Counter(s.kind for s in sessions)
    records = [r for s in sessions for r in s.records]
    cores = min(client_procs, len(os.sched_getaffinity(0)))
    busy = run.cpu_s / wall if wall > 0 else 0.0
    return {
        "kinds": dict(kinds),
        "sessions": len(sessions),
        "wall_s": wall,
        "generations": len(records),
        "tokens": sum(r.tokens for r in records),
        "sessions_without_output": sum(not s.records for s in sessions),
        "session_tok_s": _speeds(session_speeds(sessions)),  # what the SLO judges
        "session_tok_s_whole": _speeds([s.tokens_per_s for s in sessions]),
        "server_tok_s": sum(r.tokens_in_window for r in records) / window if window > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft_s * 1000 for r in records if r.ttft_s is not None]),
        "opened_ms": percentiles([r.opened_s * 1000 for r in records if r.opened_s is not None]),
        "itl_ms": _pooled(sessions, "itl_ms"),
        "verdict_latency_ms": _pooled(sessions, "verdict_latency_ms"),
        "verdict_interval_ms": _pooled(sessions, "verdict_interval_ms"),
        "acceptance": {kind: _acceptance(sessions, kind, spec) for kind in kinds if kind != "none"},
        "mismatched_outputs": sum(not r.matches_reference for r in records),
        "errors": {"total": sum(errors.values()), "by_code": dict(errors)},
        "server": {**server_figures(before, after, server_span_s or wall, kv_peak, rss_peak),
                   "covers": "the measured window" if server_span_s else "the whole point"},
        "client": {"procs": client_procs, "cores": cores, "cpu_cores_busy": busy,
                   "saturated": busy >= SATURATED * cores},
        "by_process": by_process(sessions, client_procs),
    }
