"""The load generator: concurrent edge sessions in one asyncio process.

Each session generates back to back (prompts cycled) until its point's time is up or
it has done its number of generations, on its own gRPC channel (its own connection, as
a separate device would have). Kinds: `none` (server-only decoding), `sim` (async with
a simulated drafter, see simdraft.py), `onnx` (async with the real ONNX Runtime drafter).
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.endpoint import ServerEndpoint
from loadtest.simdraft import PacedSimulatedDrafter, SimulatedDrafter
from loadtest.timeline import Acceptance, acceptance, in_window, itl_ms, verdict_interval_ms, verdict_latency_ms
from specsplit.edge.client import EdgeConfig, GenerationResult, generate
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.failures import GENERATION_FAILURES, status_name
from specsplit.edge.stream import GenerateStream

KINDS = {"none": "none", "sim": "async", "onnx": "async"}  # session kind -> edge client mode
ERROR_PAUSE_S = 0.05  # after a failed generation: a refused Open must not become a busy loop


@dataclass(frozen=True)
class LoadSettings:
    """What each session does (the knobs of a run)."""

    max_new_tokens: int = 64
    window: int = 16  # async edges' lookahead: at most this, or exactly this if not adaptive
    adaptive_window: bool = True  # as the edge client by default: the lookahead follows acceptance
    alpha: float = 0.7  # sim edges: chance per position of proposing the target's token
    draft_delay_ms: float = 0.0  # sim edges: drafting time per token
    branch_coverage: float = 0.0  # sim edges: chance of a branch from the right token beside a wrong draft
    seed: int = 0  # of the sim edges' draws
    duration_s: float | None = 10.0  # the measured window: generations are started until its end and run on
    generations: int | None = None  # instead of a duration: this many per session
    # Sessions start spread evenly over this many seconds, as devices arriving one after
    # another do (0: all at once); the window opens when the ramp is over.
    ramp_s: float = 0.0
    warmup_s: float = 0.0  # and this much later still: the start-up's prefills and waits left out
    # Each generation on a call of its own, as edges did before they kept their stream
    # between generations (edge/stream.py): every generation then waits to have its call taken.
    call_per_generation: bool = False

    def __post_init__(self) -> None:
        """Written so that NaN and infinity, which a command line may give, fail too."""
        if (self.duration_s is None) == (self.generations is None):
            raise ValueError("give either a duration or a number of generations per session")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:
            raise ValueError(f"the duration must be above 0 s and finite, got {self.duration_s}")
        if self.generations is not None and self.generations < 1:
            raise ValueError(f"generations per session must be at least 1, got {self.generations}")
        if self.max_new_tokens < 1 or self.window < 1:
            raise ValueError(f"new tokens and the lookahead window must be at least 1, got {self.max_new_tokens} "
                             f"and {self.window}")
        if not (0 <= self.alpha <= 1 and 0 <= self.branch_coverage <= 1):
            raise ValueError(f"alpha and the branch coverage are chances, from 0 to 1: got {self.alpha} and "
                             f"{self.branch_coverage}")
        if not 0 <= self.draft_delay_ms < math.inf:
            raise ValueError(f"the draft delay must be 0 or more and finite, got {self.draft_delay_ms}")
        if not (0 <= self.ramp_s < math.inf and 0 <= self.warmup_s < math.inf):
            raise ValueError(f"ramp and warm-up must be 0 or more and finite, got {self.ramp_s} and {self.warmup_s}")
        if self.warmup_s and self.duration_s is None:
            raise ValueError("a warm-up needs a duration: with a number of generations nothing is left out")


@dataclass(frozen=True)
class LoadSpec:
    """Everything the sessions of a point need (plain values: it crosses to worker processes)."""

    server: ServerEndpoint
    prompts: tuple[tuple[int, ...], ...]
    references: tuple[tuple[int, ...], ...]  # the target's greedy continuation of each prompt
    fingerprint: str  # the target tokenizer's
    vocab_size: int  # the target's: every draft id must be below it
    settings: LoadSettings
    draft_dir: str | None = None  # onnx sessions


@dataclass
class GenerationRecord:
    tokens: int
    elapsed_s: float
    tokens_in_window: int  # committed before the point's time was up
    matches_reference: bool
    ttft_s: float | None
    itl_ms: list[float]
    verdict_latency_ms: list[float]
    verdict_interval_ms: list[float]
    acceptance: Acceptance
    drafts_made: int
    drafts_wasted: int
    branches_taken: int = 0  # verdicts after which the edge carried on along a branch it had drafted
    opened_s: float | None = None  # of the TTFT, the wait for the server's Opened
    started_at: float = 0.0  # time.monotonic() at its start


@dataclass
class SessionLog:
    index: int
    kind: str
    records: list[GenerationRecord] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    # From its first generation's start, or the measured window's opening if later, to the
    # deadline; None without a deadline.
    window_s: float | None = None
    process: int = 0  # the load-generator process that drove it

    @property
    def tokens_per_s_under_load(self) -> float:
        """What it committed before the deadline over `window_s`; without a deadline, tokens_per_s."""
        if self.window_s is None:
            return self.tokens_per_s
        return sum(r.tokens_in_window for r in self.records) / self.window_s if self.window_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the time spent generating them."""
        elapsed = sum(r.elapsed_s for r in self.records)
        return sum(r.tokens for r in self.records) / elapsed if elapsed > 0 else 0.0


@dataclass
class LoadRun:
    sessions: list[SessionLog]
    started: float  # time.monotonic() when the sessions began
    deadline: float | None  # the measured window's end: its opening (after the ramp and warm-up) + the duration
    finished: float
    cpu_s: float  # this process's CPU time over the run (all its threads)


def committed_between(started: float, commit_times: list[float], opens: float, closes: float | None) -> int:
    """How many of a generation's tokens (committed `commit_times` seconds after `started`)
    came within [opens, closes]; closes None: no end."""
    end = float("inf") if closes is None else closes
    return sum(opens <= started + t <= end for t in commit_times)


def _record(result: GenerationResult, reference: tuple[int, ...], started: float, opens: float,
            deadline: float | None) -> GenerationRecord:
    # The measured window in the generation's own times: its latencies and acceptance are
    # sampled there, as its tokens are counted, not in a warm-up's burst or the drain after.
    window = (opens - started, math.inf if deadline is None else deadline - started)

    def inside(t: float | None) -> float | None:
        return t if t is not None and in_window(t, window) else None

    return GenerationRecord(
        tokens=len(result.tokens),
        elapsed_s=result.stats.elapsed_s,
        tokens_in_window=committed_between(started, result.commit_times, opens, deadline),
        matches_reference=tuple(result.tokens) == reference,
        ttft_s=inside(result.stats.ttft_s),
        itl_ms=itl_ms(result.commit_times, window),
        verdict_latency_ms=verdict_latency_ms(result.timeline, window),
        verdict_interval_ms=verdict_interval_ms(result.timeline, window),
        acceptance=acceptance(result.timeline, window),
        drafts_made=result.stats.drafts_made,
        drafts_wasted=result.stats.drafts_wasted,
        branches_taken=result.stats.branches_taken,
        opened_s=inside(result.stats.opened_s),
        started_at=started,
    )


class _Session:
    def __init__(self, spec: LoadSpec, index: int, kind: str, process: int = 0) -> None:
        if kind not in KINDS:
            raise ValueError(f"session kind must be one of {sorted(KINDS)}, got {kind!r}")
        if kind == "onnx" and spec.draft_dir is None:
            raise ValueError("onnx sessions need a draft directory")
        self.spec = spec
        self.log = SessionLog(index, kind, process=process)
        load = spec.settings
        # A paced simulated drafter gives one-hot logits, whose runner-up never reaches a branch's
        # chance: weighing one over the whole vocabulary at every draft (2 ms) would only load
        # the load generator's event loop.
        paced = kind == "sim" and load.draft_delay_ms > 0
        self.cfg = EdgeConfig(mode=KINDS[kind], window=load.window, adaptive_window=load.adaptive_window,
                              max_new_tokens=load.max_new_tokens, timeline=True, **({"branches": 0} if paced else {}))
        self.rng = random.Random(load.seed * 1_000_003 + index)
        self.branch_rng = random.Random(load.seed * 1_000_003 + index + 500_009)
        # Built before the clock starts: an ONNX session takes a while to create.
        self.onnx = OnnxDrafter(Path(spec.draft_dir)) if spec.draft_dir and kind == "onnx" else None

    def _drafter(self, prompt: int) -> OnnxDrafter | SimulatedDrafter | PacedSimulatedDrafter | None:
        if self.log.kind == "sim":
            s, load = self.spec, self.spec.settings
            sim = SimulatedDrafter(len(s.prompts[prompt]), s.references[prompt], s.vocab_size, load.alpha, self.rng,
                                   load.branch_coverage, self.branch_rng)
            return PacedSimulatedDrafter(sim, load.draft_delay_ms / 1000) if load.draft_delay_ms > 0 else sim
        return self.onnx

    def _more(self, done: int, deadline: float | None) -> bool:
        if deadline is not None:
            return time.monotonic() < deadline
        return done < (self.spec.settings.generations or 0)

    def _prompt(self, n: int) -> int:
        """The prompt of the session's n-th generation. Sessions are dealt round-robin to the
        load-generator processes: with as many processes as prompts, index mod prompts alone
        would give each process one first prompt, and the two could not be told apart."""
        count = len(self.spec.prompts)
        return (self.log.index + self.log.index // count + n) % count

    async def run(self, start_at: float, opens: float, deadline: float | None) -> None:
        """Generate from `start_at` on; what counts is committed between `opens` and `deadline`."""
        s = self.spec
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        async with s.server.channel() as channel:
            stream = None if s.settings.call_per_generation else GenerateStream.on(channel)
            n = 0
            while self._more(n, deadline):
                prompt = self._prompt(n)
                n += 1
                started = time.monotonic()
                if deadline is not None and self.log.window_s is None:
                    self.log.window_s = deadline - max(started, opens)
                try:
                    result = await generate(stream or channel, s.prompts[prompt], self.cfg,
                                            drafter=self._drafter(prompt), fingerprint=s.fingerprint,
                                            connect=s.server.connect_options())
                # Counted, not raised: one failing session must not end the point. Anything else
                # is the load generator's own fault, and ends the run.
                except GENERATION_FAILURES as exc:
                    self.log.errors[status_name(exc)] += 1
                    await asyncio.sleep(ERROR_PAUSE_S)
                    continue
                self.log.records.append(_record(result, s.references[prompt], started, opens, deadline))
            if stream is not None:
                stream.close()


def build_sessions(spec: LoadSpec, sessions: list[tuple[int, str]], process: int = 0) -> list[_Session]:
    """The sessions (index, kind) that load-generator process `process` drives, built before
    the clock starts."""
    return [_Session(spec, index, kind, process) for index, kind in sessions]


def measured_window(load: LoadSettings, started: float) -> tuple[float, float | None]:
    """(opens, deadline) of a point whose sessions start from `started` on: the window opens
    after the ramp and warm-up and lasts the duration; with a number of generations instead,
    every generation counts, whole, from the first start on (no deadline)."""
    if load.duration_s is None:
        return started, None
    opens = started + load.ramp_s + load.warmup_s
    return opens, opens + load.duration_s


async def run_built(spec: LoadSpec, edges: list[_Session], total: int, started: float) -> LoadRun:
    """Run built sessions concurrently from `started` (a time.monotonic() reading, now or
    soon) until the spec's duration or count is done. Session i of `total` starts i / total
    of the way through the ramp."""
    load = spec.settings
    cpu0 = time.process_time()
    opens, deadline = measured_window(load, started)
    await asyncio.gather(*(e.run(started + load.ramp_s * e.log.index / total, opens, deadline) for e in edges))
    return LoadRun([e.log for e in edges], started, deadline, time.monotonic(), time.process_time() - cpu0)


async def run_sessions(spec: LoadSpec, sessions: list[tuple[int, str]], total: int | None = None,
                       on_start: Callable[[float], None] | None = None) -> LoadRun:
    """Build the sessions (index, kind) and run them from now on (`run_built`); `on_start` is
    told when they start."""
    edges = build_sessions(spec, sessions)
    started = time.monotonic()
    if on_start is not None:
        on_start(started)
    return await run_built(spec, edges, total or len(sessions), started)
