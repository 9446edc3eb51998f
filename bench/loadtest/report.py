"""The sweep's report: one JSON object and a Markdown page beside it."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from loadtest.prompts import PROMPT_SETS
from loadtest.sessions import LoadSettings
from loadtest.sweep import Stop, SweepConfig, sessions_at_slo, slo_limit
from report_files import write_whole

MODE_TITLES = {
    "none": "server only (mode none)",
    "sim": "simulated edges, async",
    "onnx": "real ONNX Runtime edges, async",
}


def build_report(setup: dict, cfg: SweepConfig, settings: LoadSettings, results: dict[str, list[dict]],
                 stop: Stop | None = None) -> dict:
    """`setup`: machine, pinning, models, network, server_args (or server, for a server the
    load test did not start), prompt_set, prompts, rerun. `stop`: why and where the sweep
    ended early (None: it ran to its end)."""
    errors: Counter = Counter()
    for points in results.values():
        for p in points:
            errors.update(p["errors"]["by_code"])
    summary = {
        "baseline_sessions_at_slo": sessions_at_slo(results["none"]) if "none" in results else None,
        "split_sessions_at_slo": sessions_at_slo(results["sim"]) if "sim" in results else None,
        "onnx_sessions_at_slo": sessions_at_slo(results["onnx"]) if "onnx" in results else None,
        # What each count above means (sweep.slo_limit): "beyond" and "client-bound" are that many
        # or more; "below" and "unknown" read 0 but are no measure of 0.
        "baseline_limit": slo_limit(results["none"]) if "none" in results else None,
        "split_limit": slo_limit(results["sim"]) if "sim" in results else None,
        "onnx_limit": slo_limit(results["onnx"]) if "onnx" in results else None,
        "errors": {"total": sum(errors.values()), "by_code": dict(errors)},
        "mismatched_outputs": sum(p["mismatched_outputs"] for points in results.values() for p in points),
    }
    return {
        **setup,
        "alpha": settings.alpha,
        "slo": cfg.slo,
        "settings": {"modes": list(cfg.modes), "sessions": {m: list(cfg.counts(m)) for m in cfg.modes},
                     "repeats": cfg.repeats,
                     **asdict(settings)},
        "results": results,
        "summary": summary,
        "stopped": stop and stop.reason,
        "stopped_in": stop and stop.mode,  # the mode whose sweep was cut short
    }


def _f(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pct(p: dict | None, keys: tuple[str, ...], digits: int = 1) -> str:
    return "–" if p is None else " / ".join(_f(p[k], digits) for k in keys)


def _row(mode: str, p: dict) -> str:
    s, server = p["session_tok_s"], p["server"]
    alpha = p["acceptance"].get(mode, {}).get("alpha_measured")
    errors = ", ".join(f"{k} {v}" for k, v in p["errors"]["by_code"].items()) or "0"
    client = f"{p['client']['cpu_cores_busy']:.2f}" + (" (saturated)" if p["client"]["saturated"] else "")
    return (f"| {p['sessions']} | {_f(s['min'])} | {_f(s['p50'])} | {_f(p['server_tok_s'], 0)} "
            f"| {_ttft(p)} | {_pct(p['itl_ms'], ('p50', 'p99'))} | {_pct(p['verdict_latency_ms'], ('p50', 'p99', 'p99.9'))} "
            f"| {_f(server['batch_sessions_mean'], 2)} | {_f(server['mean_pass_ms'], 2)} | {_lag(server)} | {_f(server['kv_peak_mb'])} "
            f"| {_f(alpha, 2)} | {client} | {errors} | {_slo(p)}{_runs(p)} |")


def _slo(p: dict) -> str:
    if "server_lost" in p:
        return f"no measure (the server {p['server_lost']})"
    return "yes" if p["meets_slo"] else "no"


def _process_spread(points: list[dict]) -> list[str]:
    """Per point with several load-generator processes: how far apart their sessions ran."""
    lines = []
    for p in points:
        procs = p.get("by_process") or []
        if len(procs) < 2:
            continue
        speeds = [q["tok_s_mean"] for q in procs]
        shares = [q["generating_share"] for q in procs if q["generating_share"] is not None]
        lines.append(f"- {p['sessions']} sessions, by load-generator process: session tok/s means {min(speeds):.1f} to "
                     f"{max(speeds):.1f}" + (f", share of their time in generations {min(shares):.2f} to {max(shares):.2f}"
                                             if shares else ""))
    return [*lines, ""] if lines else []


def _metrics_failures(points: list[dict]) -> list[str]:
    """Points whose server figures are missing or partial: reading the metrics failed."""
    lines = [f"- {p['sessions']} sessions: the server's metrics could not always be read ({p['server']['metrics']}); "
             "its figures are left out where they needed them"
             + (f", and cover {p['server']['covers']}" if "covers" in p["server"] else "") for p in points
             if p["server"].get("metrics", "read") not in ("read", "not read")]
    return [*lines, ""] if lines else []


def _window_read(report: dict) -> bool:
    """Whether the server figures cover the measured window (reports from before, and runs of
    counted generations, read the metrics at the point's start and end)."""
    return any(p["server"].get("covers") == "the measured window" for pts in report["results"].values() for p in pts)


def _lag(server: dict) -> str:
    """The event loop's lag, mean / the bound its p99 lies under, or "> " the last bound where
    it lies past them all (– in reports from before it)."""
    mean = server.get("loop_lag_mean_ms")
    if mean is None:
        return "–"
    below, above = server["loop_lag_p99_below_ms"], server.get("loop_lag_p99_above_ms")
    p99 = f"≤ {below:g}" if below is not None else f"> {above:g}" if above is not None else "–"
    return f"{mean:.1f} / {p99}"


def _ttft(p: dict) -> str:
    """TTFT p50 / p90, and in brackets the part of it until the server's Opened (newer reports)."""
    opened = p.get("opened_ms")
    return _pct(p.get("ttft_ms"), ("p50", "p90")) + (f" ({_pct(opened, ('p50', 'p90'))})" if opened else "")


def _runs(p: dict) -> str:
    """' (k/n runs)' for a point run more than once; its figures are the slowest run's."""
    runs = p.get("runs", ())
    return f" ({sum(r['meets_slo'] for r in runs)}/{len(runs)} runs)" if len(runs) > 1 else ""


def _describe_models(models: dict) -> list[str]:
    t = models["target"]
    c = t.get("config")
    lines = [f"- target: {t['name']}: layers {c['num_hidden_layers']}, hidden {c['hidden_size']}, "
             f"vocab {c['vocab_size']}; {t['dtype']} on {t['device']}" if c else
             f"- target: {t['name']} (as the server names it in Opened), vocab {t['vocab_size']}"]
    if models.get("tokenizer"):
        lines.append(f"- prompts encoded by the tokenizer of the draft export {models['tokenizer']}")
    if models.get("draft"):
        d = models["draft"]
        weights = "unquantized" if d["quantization"] == "none" else d["quantization"]
        lines.append(f"- draft (onnx edges): {d['name']}: layers {d['num_layers']}, vocab {d['vocab_size']}, "
                     f"{weights}; ONNX Runtime on CPU, one thread per edge")
    return lines


def _attached(report: dict) -> bool:
    """Whether the run loaded a server it did not start (`run.py --server`)."""
    return "server" in report


def _server_pinning(report: dict) -> str:
    if _attached(report):
        return "server not started by the load test"
    pin = report["pinning"]
    return f"server on cores {pin['server_cores'] or 'any'} ({pin['server_threads']} torch thread(s))"


def _describe_server(report: dict) -> str:
    if not _attached(report):
        return f"- server arguments: `{' '.join(report['server_args'])}`"
    server = report["server"]
    figures = ("" if server["metrics"] == "read" else
               " (its metrics not read: no batch, pass, loop lag or KV figures)")
    return f"- server: already running, at {server['connection']}{figures}; no RSS figures"


def render_markdown(report: dict, name: str) -> str:
    m, pin, s, summ = report["machine"], report["pinning"], report["settings"], report["summary"]
    gpu = f"; GPU {m['gpu']}" if "gpu" in m else ""
    procs = ("one process holds every edge" if pin["client_procs"] == 1
             else f"{pin['client_procs']} processes" + (" pinned round-robin to those cores" if pin["client_cores"]
                                                         else "") + ", sessions dealt round-robin")
    per_point = (f"for {s['duration_s']:g} s (generations started until then run to their end)"
                 if s["duration_s"] is not None else f"{s['generations']} generations each")
    ramp, warmup = s.get("ramp_s", 0.0), s.get("warmup_s", 0.0)  # reports from before: all at once
    if not (ramp or warmup):
        arrival = "all sessions start at once"
    elif s["duration_s"] is None:
        arrival = f"sessions start spread evenly over {ramp:g} s, and every generation counts"
    else:
        arrival = (f"sessions start spread evenly over {ramp:g} s and are measured from {warmup:g} s after the "
                   "ramp ends")
    # Reports from before the choice: a new call for every generation.
    calls = ("a new call for every generation" if s.get("call_per_generation", True)
             else "its generations one after another on one stream")
    lines = [
        f"# gRPC load test: {name}",
        "",
        f"- {'load generator' if _attached(report) else 'machine'}: {m['cpu']}, {m['cores']} cores ({m['arch']}){gpu}",
        f"- pinning: {_server_pinning(report)}; load generator on cores {pin['client_cores'] or 'any'} ({procs})",
        *_describe_models(report["models"]),
        _describe_server(report),
        f"- network: {report['network']}",
        f"- each point: N sessions, each on its own connection ({calls}), generating back to back {per_point}; "
        f"{arrival}; "
        f"{s['max_new_tokens']} new tokens per generation, greedy, {len(report['prompts'])} prompts cycled "
        f"({PROMPT_SETS[report.get('prompt_set', 'stubs')]}), "  # reports from before the choice used the stubs
        f"lookahead window {_window(s)}",
        *([f"- simulated edges: right token with probability alpha = {s['alpha']} per position, "
           f"draft delay {s['draft_delay_ms']:g} ms per token, a branch from the right token beside "
           f"{s.get('branch_coverage', 0.0):.0%} of the first wrong drafts"] if "sim" in s["modes"] else []),
        f"- SLO: every session at least {report['slo']:g} tokens/s "
        + ("(the tokens it committed in the measured window, "
           "until the point's time was up, over the time from its first generation, or the window's opening if later, "
           "until then; the generations still running then "
           "finish with ever fewer sessions and are not counted past it)" if s["duration_s"] is not None
           else "(the tokens it committed over the time it spent generating them)")
        + " and no errors; a mode's sweep stops at its first point that misses it"
        + (f"; each point ran {s['repeats']} times and meets it only if every run does, its "
           "figures those of a run that missed it, else of the run with the slowest session" if s.get("repeats", 1) > 1 else ""),
        "- session tok/s: min and median over sessions; server tok/s: "
        + ("tokens committed in the measured window / its length" if s["duration_s"] is not None
           else "tokens committed / the point's time, from the first start to the last Done"),
        "- TTFT: from a generation's start at the edge (its call) to its first committed token; the wait counts "
        "in the session's tok/s; in brackets, p50 / p90 of its part until the server's Opened came back (the call "
        "accepted and its Open read; the rest is the first verification)",
        "- ITL: gaps between consecutive committed tokens (the tokens of one verdict share its time: gap 0); "
        "verdict latency: from sending a draft chunk to the verdict that commits its first position; "
        "alpha: per-position acceptance measured at the edges (accepted / (accepted + rejections); – where the "
        "server verified no drafts); these and TTFT are sampled within the measured window, each where it ends "
        "(a first token, the later of a gap's tokens, a verdict)",
        "- loop lag: how late the server's event loop ran a timer due every 50 ms, mean / the histogram bucket its "
        "p99 lies under (> its last bound where it lies past them all); every call, message and verdict waits about "
        "that long in the loop",
        "- batch: mean sessions per target pass; pass: mean target pass time; loop lag: see above; these cover "
        + ("the measured window (the server's metrics read as it opens and closes)" if _window_read(report)
           else "the whole point")
        + "; KV: peak of the server's KV-cache gauge (sampled every 0.5 s); client CPU: load generator CPU in cores "
        "(saturated: it, not the server, may be the limit); these two cover the whole point"
        + (", ramp and warm-up included" if ramp or warmup else ""),
        "",
        "## Summary",
        "",
        "| mode | most sessions at the SLO |",
        "| --- | --- |",
    ]
    for mode, key in (("none", "baseline_sessions_at_slo"), ("sim", "split_sessions_at_slo"),
                      ("onnx", "onnx_sessions_at_slo")):
        if summ[key] is not None:
            lines.append(f"| {MODE_TITLES[mode]} | {limit_text(report, mode)} |")
    by_code = ", ".join(f"{k}: {v}" for k, v in summ["errors"]["by_code"].items()) or "none"
    lines += ["", f"Errors: {summ['errors']['total']} ({by_code}). Outputs differing from the target's greedy "
              f"continuation: {summ['mismatched_outputs']}.", ""]
    if report.get("stopped"):
        lines += [f"**Stopped early:** {report['stopped']}.", ""]
    for mode, points in report["results"].items():
        lines += [
            f"## {MODE_TITLES[mode]}",
            "",
            "| N | session tok/s min | p50 | server tok/s | TTFT p50 / p90 ms (to Opened) | ITL p50 / p99 ms "
            "| verdict latency p50 / p99 / p99.9 ms | batch | pass ms | loop lag ms | peak KV MB | alpha | client CPU | errors "
            "| SLO |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *(_row(mode, p) for p in points),
            "",
            *_process_spread(points),
            *_metrics_failures(points),
        ]
    lines.append(f"Rerun: `{report['rerun']}`")
    return "\n".join(lines) + "\n"


def limit_text(report: dict, mode: str) -> str:
    """A mode's sessions at the SLO, as far as its points tell (sweep.slo_limit)."""
    points = report["results"][mode]
    limit = slo_limit(points)
    if limit == "unknown":
        first = points[0]
        if "server_lost" in first:
            return f"unknown (the server {first['server_lost']} during the first point, of {_sessions(first)})"
        return f"unknown (nothing was served at {_sessions(first)}, the first point)"
    if limit == "below":
        return f"fewer than {points[0]['sessions']} (the fewest tried missed it)"
    count = sessions_at_slo(points)
    if limit == "client-bound":
        return (f"{count} or more (the next point missed the SLO with the load generator saturated: it, not the "
                "server, may have been the limit; more --client-procs on more --client-cores would tell)")
    if limit == "beyond":
        # Where the sweep stopped early, in this mode's sweep or not (reports from before
        # "stopped_in": the last mode with a point, which a stop at a mode's first point misnames).
        stopped = report.get("stopped") and mode == report.get("stopped_in", list(report["results"])[-1])
        return f"{count} or more (the most tried" + (" before the sweep stopped)" if stopped else ")")
    return str(count)


def _sessions(point: dict) -> str:
    return "1 session" if point["sessions"] == 1 else f"{point['sessions']} sessions"


def write_report(report: dict, out_dir: Path, name: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    write_whole(json_path, json.dumps(report, indent=1) + "\n")
    write_whole(md_path, render_markdown(report, name))
    return json_path, md_path


def _window(settings: dict) -> str:
    # Reports from before the setting existed ran fixed windows.
    return f"adaptive, at most {settings['window']}" if settings.get("adaptive_window") else f"{settings['window']}, fixed"
