"""The sweep: per mode, points of growing session counts until one misses the SLO."""
from __future__ import annotations

import asyncio
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from loadtest.endpoint import ServerEndpoint
from loadtest.point import ServerHandle, run_point
from loadtest.prompts import PromptSet
from loadtest.sessions import LoadSpec
from loadtest.workers import ClientWorkers
from specsplit.edge.client import EdgeConfig, GenerationResult, generate
from specsplit.protocol.messages import Opened

MODES = ("none", "sim", "onnx")  # server-only; simulated drafter at a set alpha; real ONNX drafter
WARMUP_TOKENS = 4
INTERRUPTED = "interrupted (Ctrl-C): only the points that had finished are reported"


@dataclass(frozen=True)
class SweepConfig:
    modes: tuple[str, ...] = MODES
    sessions: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    slo: float = 20.0  # tokens/s every session must get; a mode stops at its first point below it
    # Session counts of one mode instead of `sessions` (a mode far from the others' SLO point
    # need not sweep through theirs).
    per_mode: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Runs of each point: the SLO is judged on the slowest of hundreds of sessions, so one
    # run is one sample; a point meets it only if every run does.
    repeats: int = 1

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError(f"give at least one mode, from {MODES}")
        if len(set(self.modes)) < len(self.modes):
            raise ValueError(f"a mode given twice: {self.modes} (each mode's sweep would overwrite the last)")
        if any(len(set(counts)) < len(counts) for counts in (self.sessions, *self.per_mode.values())):
            raise ValueError("a session count given twice in one sweep")
        unknown = set(self.modes) - set(MODES)
        if unknown:
            raise ValueError(f"unknown modes {sorted(unknown)}; choose from {MODES}")
        if set(self.per_mode) - set(self.modes):
            raise ValueError(f"session counts given for modes not swept: {sorted(set(self.per_mode) - set(self.modes))}")
        if any(not counts or min(counts) < 1 for counts in (self.sessions, *self.per_mode.values())):
            raise ValueError("session counts must be at least 1")
        if self.slo < 0:  # 0: any point without errors meets it
            raise ValueError(f"the SLO must not be negative, got {self.slo} tokens/s")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")

    def counts(self, mode: str) -> tuple[int, ...]:
        """The session counts `mode` is swept over, ascending."""
        return tuple(sorted(self.per_mode.get(mode, self.sessions)))

    def most(self) -> int:
        """The most sessions any point of the sweep opens."""
        return max(max(self.counts(m)) for m in self.modes)


async def _server_alone(server: ServerEndpoint, prompts: PromptSet, max_new_tokens: int,
                        log: Callable[[str], None] | None = None) -> tuple[GenerationResult, ...]:
    cfg = EdgeConfig(mode="none", max_new_tokens=max_new_tokens)
    results = []
    async with server.channel() as channel:
        for i, ids in enumerate(prompts.ids, 1):
            results.append(await generate(channel, ids, cfg, fingerprint=prompts.fingerprint,
                                          connect=server.connect_options()))
            if log is not None:  # on a slow target, minutes: say how far it is
                log(f"  reference {i}/{len(prompts.ids)}: {len(results[-1].tokens)} tokens")
    return tuple(results)


def warm_up(server: ServerEndpoint, prompts: PromptSet) -> Opened:
    """One short generation, discarded: the first pass of a fresh server is slow. The
    server's Opened: what it serves (its target's name and vocabulary)."""
    first = PromptSet(prompts.texts[:1], prompts.ids[:1], prompts.fingerprint)
    opened = asyncio.run(_server_alone(server, first, WARMUP_TOKENS))[0].opened
    assert opened is not None  # a generation that ended well was opened
    return opened


def reference_continuations(server: ServerEndpoint, prompts: PromptSet, max_new_tokens: int,
                            log: Callable[[str], None] | None = None) -> tuple[tuple[int, ...], ...]:
    """The target's greedy continuation of each prompt: decoded by the server alone, which
    the protocol makes token for token what any edge must get back."""
    return tuple(tuple(r.tokens) for r in asyncio.run(_server_alone(server, prompts, max_new_tokens, log)))


def meets_slo(point: dict, slo: float) -> bool:
    """Every session got at least `slo` tokens/s and nothing failed. An output that differs
    from the reference is no failure here: a target batched in bf16 on a GPU may decode so
    (measured and reported, as mismatched_outputs, and the run's exit status says so)."""
    return point["errors"]["total"] == 0 and point["sessions_without_output"] == 0 \
        and point["session_tok_s"]["min"] >= slo


def repeated_point(runs: list[dict], slo: float) -> dict:
    """One point from its runs: the figures of a run that missed the SLO (its slowest session
    slowest among them), else of the run whose slowest session was slowest; every run's errors
    and mismatches, each run's headline figures, and whether all met the SLO."""
    met = [meets_slo(r, slo) for r in runs]
    worst = min(range(len(runs)), key=lambda i: (met[i], runs[i]["session_tok_s"]["min"]))  # a missing run first
    point = dict(runs[worst])
    point["errors"] = {"total": sum(r["errors"]["total"] for r in runs),
                       "by_code": dict(sum((Counter(r["errors"]["by_code"]) for r in runs), Counter()))}
    point["mismatched_outputs"] = sum(r["mismatched_outputs"] for r in runs)
    point["runs"] = [{"session_tok_s_min": r["session_tok_s"]["min"], "session_tok_s_p50": r["session_tok_s"]["p50"],
                      "server_tok_s": r["server_tok_s"], "meets_slo": m} for r, m in zip(runs, met)]
    point["meets_slo"] = all(met)
    return point


def sessions_at_slo(points: list[dict]) -> int:
    """The largest session count whose point met the SLO (0: none did)."""
    return max((p["sessions"] for p in points if p["meets_slo"]), default=0)


def _no_measure(point: dict) -> bool:
    return point["generations"] == 0 or "server_lost" in point


def slo_limit(points: list[dict]) -> str:
    """Where a mode's limit lies against the points swept (a mode stops at its first miss):
    "found" (a point missed the SLO, and the one before met it), "below" (its first point
    missed: the limit is under the fewest sessions tried, not 0), "beyond" (its last point
    met it: the limit is that many sessions or more), "unknown" (its first point served
    nothing, or the server was lost during it), "client-bound" (as found, but the point that
    missed saturated the load generator's cores: it, not the server, may have been the limit,
    so the count is the least the server holds). A last point that served nothing, or that
    the server did not live through, says nothing of the limit."""
    judged = points[:-1] if points and _no_measure(points[-1]) else points
    if not judged:
        return "unknown"
    if judged[-1]["meets_slo"]:
        return "beyond"
    if not any(p["meets_slo"] for p in judged):
        return "below"
    return "client-bound" if judged[-1].get("client", {}).get("saturated") else "found"


@dataclass(frozen=True)
class Stop:
    """Why a sweep ended early, and the mode whose sweep it cut short (whose last point is
    then the most it tried, not its limit)."""
    reason: str
    mode: str


def _line(mode: str, point: dict) -> str:
    s, server = point["session_tok_s"], point["server"]
    batch = server["batch_sessions_mean"]
    alpha = point["acceptance"].get(mode, {}).get("alpha_measured")
    return (f"{mode:>4} N={point['sessions']:<4} session tok/s min {s['min']:.1f} p50 {s['p50']:.1f} | "
            f"server {point['server_tok_s']:.0f} tok/s | batch {batch if batch is None else round(batch, 2)} | "
            + (f"alpha {alpha:.2f} | " if alpha is not None else "")
            + f"client cpu {point['client']['cpu_cores_busy']:.2f} | errors {point['errors']['total']} | "
            + (f"outputs differing {point['mismatched_outputs']} | " if point["mismatched_outputs"] else "")
            + ("meets SLO" if point["meets_slo"] else "misses SLO"))


def sweep(server: ServerHandle, spec: LoadSpec, cfg: SweepConfig, workers: ClientWorkers | None = None,
          log: Callable[[str], None] = print) -> tuple[dict[str, list[dict]], Stop | None]:
    """Points per mode (`spec` holds everything but the session kinds and count), and why and
    in which mode the sweep stopped early (None: it did not): INTERRUPTED, a point where no generation
    finished, as with a server gone (every later point would only wait out its time), or a
    point that failed (the load generator's fault, or a worker process's)."""
    results: dict[str, list[dict]] = {}
    total = sum(len(cfg.counts(m)) for m in cfg.modes)
    done = 0
    mode, n = cfg.modes[0], 0  # what a stop is said of should it come before the loop has begun
    try:
        for mode in cfg.modes:
            for n in cfg.counts(mode):
                done += 1
                log(f"[{done}/{total}] {mode} with {n} session(s) ...")
                runs = []
                for _ in range(cfg.repeats):
                    runs.append(run_point(server, spec, [mode] * n, workers))
                    if cfg.repeats > 1:
                        log(f"  run {len(runs)}/{cfg.repeats}: "
                            + _line(mode, {**runs[-1], "meets_slo": meets_slo(runs[-1], cfg.slo)}))
                point = repeated_point(runs, cfg.slo)
                points = results.setdefault(mode, [])
                points.append(point)
                log(_line(mode, point))
                errors = ", ".join(f"{k} {v}" for k, v in point["errors"]["by_code"].items()) or "none"
                # A point the server did not live through says nothing of its capacity, and
                # every later one would only count errors.
                lost = None if point["meets_slo"] else server.lost()
                if lost is not None:
                    point["server_lost"] = lost
                    return results, Stop(f"the server {lost} during {mode} with {n} session(s) (errors: {errors}), "
                                         "so the sweep stopped there; that point is no measure of capacity", mode)
                if point["generations"] == 0:
                    return results, Stop(f"{mode} with {n} session(s) finished no generation (errors: {errors}): "
                                         "the server served nothing, so the sweep stopped there", mode)
                if not point["meets_slo"]:  # more sessions only get slower: save the time
                    done += len(cfg.counts(mode)) - len(points)  # the rest of this mode is skipped
                    break
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C; SIGTERM, as the server's runner raises it
        log(INTERRUPTED)
        return results, Stop(INTERRUPTED, mode)
    except Exception as exc:  # noqa: BLE001 (the points that finished are still reported)
        log(traceback.format_exc().rstrip())
        return results, Stop(f"{mode} with {n} session(s) failed ({type(exc).__name__}: {exc}): only the points "
                             "before it are reported", mode)
    return results, None
