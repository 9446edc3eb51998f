"""Summaries and the Markdown report of a benchmark run."""
from __future__ import annotations

import statistics
from collections import defaultdict

from specsplit.common.acceptance import observed_acceptance

MODE_ORDER = ["none", "sync", "async-no-branches", "async", "draft", "hf-assisted"]  # sync-K by K within sync


# Columns without meaning for the draft alone and HF assisted generation.
ANCHOR_BLANKS = ("itl_p50_ms", "itl_p99_ms", "acceptance_rate", "acceptance_per_position", "mean_accepted",
                 "drafts_wasted", "verifications", "server_idle_fraction", "bytes_up_per_token",
                 "bytes_down_per_token", "wire_bytes_up_per_token", "wire_bytes_down_per_token")


def _mode_rank(mode: str) -> tuple[int, int]:
    kind, _, k = mode.partition("-")
    if kind == "sync" and k.isdigit():
        return MODE_ORDER.index("sync"), int(k)
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)), 0


def _mean(xs) -> float | None:  # type: ignore[no-untyped-def]
    """The mean of the figures given; None where there are none (a 0 would read as measured)."""
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _reference(runs: list[dict]) -> dict:
    """Token ids of the server-only run per prompt (the first RTT's, for network-free modes)."""
    ref: dict = {}
    for r in runs:
        if r["mode"] == "none":
            ref.setdefault((r["rtt_ms"], r["prompt"]), r["token_ids"])
            ref.setdefault((None, r["prompt"]), r["token_ids"])
    return ref


def _per_position(runs: list[dict]) -> float | None:
    """Accepted drafts over accepted drafts plus rejections, pooled over the runs (None for
    runs recorded before edges counted rejections, or without drafts)."""
    if any("rejections" not in r for r in runs):
        return None
    return observed_acceptance(sum(r["drafts_accepted"] for r in runs), sum(r["rejections"] for r in runs))


def summarize(runs: list[dict]) -> list[dict]:
    ref = _reference(runs)
    groups: dict = defaultdict(list)
    for r in runs:
        groups[(r["mode"], r["rtt_ms"])].append(r)
    none_tps = {rtt: {r["prompt"]: r["tokens_per_s"] for r in g} for (m, rtt), g in groups.items() if m == "none"}
    out = []
    for (mode, rtt), g in groups.items():
        tokens = sum(r["tokens"] for r in g)
        base = none_tps.get(rtt) or next(iter(none_tps.values()), {})
        ratios = [r["tokens_per_s"] / base[r["prompt"]] for r in g if base.get(r["prompt"])]
        # The draft alone decodes with another model: its text is not expected to match. The
        # server alone is held to its own run at the first RTT (against itself it always matched).
        keys = [(None if mode == "none" else rtt, r["prompt"]) for r in g]
        identical = [] if mode == "draft" else [r["token_ids"] == ref[key] for r, key in zip(g, keys) if key in ref]
        out.append({
            "mode": mode,
            "rtt_ms": rtt,
            "prompts": len(g),
            "tokens": tokens,
            "tokens_per_s": _mean(r["tokens_per_s"] for r in g),
            "speedup_vs_none": _mean(ratios) if ratios else None,
            "ttft_ms": _mean(r["ttft_s"] * 1000 for r in g if r.get("ttft_s") is not None)
            if mode not in ("draft", "hf-assisted") else None,
            "itl_p50_ms": _mean(r.get("itl_p50_ms") for r in g),
            "itl_p99_ms": _mean(r.get("itl_p99_ms") for r in g),
            # `none` drafts nothing: no acceptance to speak of, rather than a measured 0.
            "acceptance_rate": None if mode == "none" else _mean(r.get("acceptance_rate") for r in g),
            "acceptance_per_position": None if mode == "none" else _per_position(g),
            "mean_accepted": None if mode == "none" else _mean(r.get("mean_accepted") for r in g),
            "drafts_wasted": sum(r.get("drafts_wasted", 0) for r in g),
            "rejections": sum(r.get("rejections", 0) for r in g),
            "branches_taken": sum(r.get("branches_taken", 0) for r in g),
            "branch_tokens": sum(r.get("branch_drafted", 0) for r in g),
            "verifications": sum(r.get("verifications", 0) for r in g),
            "server_idle_fraction": _mean(r.get("server_idle_fraction") for r in g),
            "bytes_up_per_token": sum(r.get("bytes_up", 0) for r in g) / tokens if tokens else 0.0,
            "bytes_down_per_token": sum(r.get("bytes_down", 0) for r in g) / tokens if tokens else 0.0,
            "wire_bytes_up_per_token": _per_token(g, "wire_bytes_up", tokens),
            "wire_bytes_down_per_token": _per_token(g, "wire_bytes_down", tokens),
            "identical": all(identical) if identical else None,
        })
    out.sort(key=lambda s: (s["rtt_ms"] is None, s["rtt_ms"] or 0, _mode_rank(s["mode"])))
    return out


def _mean_ratio(runs: list[dict], mode: str, other: str, rtt: float) -> float | None:
    """The mean over prompts of `mode`'s tokens/s over `other`'s, at `rtt`."""
    base = {r["prompt"]: r["tokens_per_s"] for r in runs if r["mode"] == other and r["rtt_ms"] == rtt}
    return _mean(r["tokens_per_s"] / base[r["prompt"]] for r in runs
                 if r["mode"] == mode and r["rtt_ms"] == rtt and base.get(r["prompt"]))


def _per_token(runs: list[dict], key: str, tokens: int) -> float | None:
    """`key` summed over the runs, per token; None where a run lacks it (runs from before it
    was counted, and the anchors, which use no link)."""
    if not tokens or any(key not in r for r in runs):
        return None
    return sum(r[key] for r in runs) / tokens


def _fmt(x, spec: str = ".2f") -> str:  # type: ignore[no-untyped-def]
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return format(x, spec)


def _times(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}x"


def timeline_chart(run: dict, delay_s: float, width_s: float = 12.0, step_s: float = 0.1) -> tuple[str, dict]:
    """Three lanes over the first seconds of one run: the edge drafting, the target
    verifying this session, and committed tokens arriving at the edge."""
    events = run.get("timeline") or []
    cells = int(width_s / step_s)
    draft, verify, commit = [" "] * cells, [" "] * cells, [" "] * cells

    def paint(lane: list[str], a: float, b: float, ch: str) -> None:
        for i in range(max(0, int(a / step_s)), min(cells, int(b / step_s) + 1)):
            lane[i] = ch

    totals = {"drafting_s": 0.0, "branching_s": 0.0, "verifying_s": 0.0}
    for ev in events:
        if ev[0] in ("draft", "branch"):
            paint(draft, ev[1], ev[2], "D" if ev[0] == "draft" else "b")
            totals["drafting_s" if ev[0] == "draft" else "branching_s"] += ev[2] - ev[1]
        elif ev[0] == "verdict":
            t, n_tokens, verify_ms = ev[1], ev[3], ev[5]
            end = t - delay_s
            paint(verify, end - verify_ms / 1000, end, "V")
            totals["verifying_s"] += verify_ms / 1000
            paint(commit, t, t, str(n_tokens) if n_tokens < 10 else "+")
    axis = "".join("|" if i % 10 == 0 else "." for i in range(cells))
    return "\n".join([
        f"time      {axis}  (one cell = {step_s * 1000:.0f} ms, '|' every second)",
        f"edge      {''.join(draft)}  D = drafting, b = drafting a branch",
        f"target    {''.join(verify)}  V = verifying this session",
        f"commits   {''.join(commit)}  digit = tokens committed by a verdict arriving at the edge (+: 10 or more)",
    ]), totals


def render_markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        f"# Benchmark `{result['name']}` ({result['date']})",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['machine']}, native bf16: {m['native_bf16']}",
        f"- pinning: {result['pinning']}",
        f"- models: target {result['models']['target']} served in {result['models']['target_dtype']}; "
        f"draft {result['models']['draft']} (ONNX, {result['models']['draft_quantization']})",
        f"- network: {result['network']['how']}; RTT {', '.join(f'{r:g}' for r in result['network']['rtt_ms'])} ms; "
        f"bandwidth cap {format(result['network']['rate_mbit'], 'g') + ' Mbit/s each way' if result['network']['rate_mbit'] else 'none'}",
        f"- greedy, up to {s['max_new_tokens']} new tokens, prompts: {', '.join(s['prompts'])}; async window {s['window']}; "
        f"server args: `{s['server_args'] or 'defaults'}`",
        f"- wall time of the run: {result['wall_s'] / 60:.1f} min"
        + (f" over {len(result['invocations'])} invocations" if len(result.get("invocations", [])) > 1 else ""),
        *([] if result.get("complete", True) else [
            f"- **incomplete**: {len(result['runs'])} runs measured so far; the missing ones are measured by the same "
            "command with `--resume`"]),
        "",
        "Means over the prompt set of each prompt's figure: tok/s, TTFT, ITL p50 and p99, acceptance, "
        "accepted/verif and server idle; speedup is the mean of per-prompt ratios to `none` at the same RTT "
        "(for the draft alone and HF assisted generation, which use no network, at the first RTT measured). "
        "Totals over the prompt set: wasted and verifs. Pooled over it (a sum over a sum): per position, and "
        "bytes per token. ITL is the gap between consecutive committed tokens (0 within one verdict). Per "
        "position: accepted drafts over accepted drafts and rejections; wasted: drafts of the edge's line "
        "thrown away by rollbacks or left at the end (tokens of branches not taken are not in it: the goal "
        "section counts them); verifs: verdicts; server idle: the share of the generation's time the target did not work for it; B up/down: "
        "bytes of the gRPC messages per generated token (protobuf and gRPC's 5-byte prefix); wire B: what "
        "crossed the link per generated token, HTTP/2 framing, pings and window updates too (TCP/IP headers "
        "on top); identical: the output equals `none`'s. – where a figure does not apply (`none` "
        "drafts nothing; the draft alone and HF assisted generation have no server and no verdicts).",
        "",
        "| RTT ms | mode | prompts | tok/s | speedup | TTFT ms | ITL p50/p99 ms | acceptance | per position | accepted/verif | wasted | verifs "
        "| server idle | B up/tok | B down/tok | wire B up/tok | wire B down/tok | identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["summary"]:
        if r["rtt_ms"] is None:  # no server, no network, no verdicts: their zeros would read as measured
            r = {**r, **{k: None for k in ANCHOR_BLANKS}}
        lines.append(
            f"| {_fmt(r['rtt_ms'], 'g') if r['rtt_ms'] is not None else 'n/a'} | {r['mode']} | {r['prompts']} | {_fmt(r['tokens_per_s'])} "
            f"| {_times(r['speedup_vs_none'])} | {_fmt(r['ttft_ms'], '.0f')} "
            f"| {_fmt(r['itl_p50_ms'], '.0f')}/{_fmt(r['itl_p99_ms'], '.0f')} | {_fmt(r['acceptance_rate'], '.0%')} "
            f"| {_fmt(r.get('acceptance_per_position'), '.0%')} "
            f"| {_fmt(r['mean_accepted'])} | {_fmt(r['drafts_wasted'], 'd')} | {_fmt(r['verifications'], 'd')} "
            f"| {_fmt(r['server_idle_fraction'], '.0%')} | {_fmt(r['bytes_up_per_token'], '.1f')} "
            f"| {_fmt(r['bytes_down_per_token'], '.1f')} | {_fmt(r.get('wire_bytes_up_per_token'), '.1f')} "
            f"| {_fmt(r.get('wire_bytes_down_per_token'), '.1f')} | {_fmt(r['identical'])} |"
        )
    goal = [r for r in result["summary"] if r["rtt_ms"] == 50]
    if goal:
        by = {r["mode"]: r for r in goal}
        syncs = [r for r in goal if r["mode"].startswith("sync")]
        if "async" in by and syncs:
            best = max(syncs, key=lambda r: r["tokens_per_s"])
            lines += [
                "",
                "## Goal at RTT 50 ms",
                "",
                f"- async vs none: {_times(by['async']['speedup_vs_none'])} (goal 3.0x; the mean of per-prompt "
                f"ratios; the ratio of mean tokens/s: "
                f"{_times(by['async']['tokens_per_s'] / by['none']['tokens_per_s'] if 'none' in by else None)})",
                f"- async vs best sync ({best['mode']}): {by['async']['tokens_per_s'] / best['tokens_per_s']:.2f}x "
                f"(goal 1.3x; the ratio of mean tokens/s; the mean of per-prompt ratios: "
                f"{_times(_mean_ratio(result['runs'], 'async', best['mode'], 50))})",
                # A row without a comparison (no `none` output for its prompts) is no evidence.
                f"- every output identical to none: {_fmt(all(r['identical'] is True for r in goal))}",
            ]
            if "async-no-branches" in by:
                plain = by["async-no-branches"]
                lines.append(f"- async with the edge drafting no branches, side by side: "
                             f"{_times(plain['speedup_vs_none'])} none, "
                             f"{plain['tokens_per_s'] / best['tokens_per_s']:.2f}x {best['mode']}")
            if any("branches_taken" in r for r in result["runs"]):  # runs from before branches lack it
                # Not a part of the rejections: a pass that accepts every draft it verified still
                # parts from the edge's later drafts where its bonus token differs from them.
                lines.append(f"- async's rejections: {by['async']['rejections']}; verdicts that parted from the edge's "
                             f"drafts where it had a branch from their token, which it carried on along: "
                             f"{by['async']['branches_taken']} (at a rejection, or past the drafts a pass verified); "
                             f"tokens drafted in branches: {by['async'].get('branch_tokens', 0)}")
    runs = [r for r in result["runs"] if r["mode"] == "async" and r.get("timeline")]
    if runs:
        pick = next((r for r in runs if r["rtt_ms"] == 50), runs[0])
        chart, totals = timeline_chart(pick, (pick["rtt_ms"] or 0) / 2000)
        lines += [
            "",
            f"## Where the time goes: async, RTT {pick['rtt_ms']:g} ms, prompt `{pick['prompt']}`",
            "",
            f"Over the whole run ({pick['elapsed_s']:.1f} s): the edge drafted for {totals['drafting_s']:.1f} s "
            f"and drafted branches for {totals['branching_s']:.1f} s, the "
            f"target verified this session for {totals['verifying_s']:.1f} s; time to first token "
            f"{_fmt(pick['ttft_s'] and pick['ttft_s'] * 1000, '.0f')} ms (connecting over the link, the prompt's "
            "prefill with the first verification, and the way back).",
            "",
            "```",
            chart,
            "```",
        ]
    return "\n".join(lines) + "\n"
