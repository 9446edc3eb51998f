"""What each mode can reach, and what would change it: the replay model over a benchmark run.

Takes a benchmark run's server-only outputs (the target's greedy continuation of each
prompt), runs the draft model teacher-forced over them to find where it agrees with the
target, and replays `none`, `sync` at each k and `async` (replay_model.py) under the pass
times measured by bench/gpu_passes.py and the run's own network delay and draft speed.
Beside what the run measured (decoding only: its first token, the prefill, left out) the
report gives the model's figure and what-ifs: every pass at the cost of one token's pass,
no network delay, half the draft's misses fixed, and a draft that always agrees. Writes
bench/results/<name>.json and a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import replay_model as rm
from cli_types import at_least, out_dir, report_name
from prompt_set import benchmark_prompts
from report_files import save_report
from specsplit.edge.drafter import Drafter
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
DEFAULT_BENCH = HERE / "results" / "rtt50.json"


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    agreement: Callable[[Sequence[bool]], Sequence[bool]] = lambda a: a
    costs: Callable[[rm.PassCosts], rm.PassCosts] = lambda c: c
    link: Callable[[rm.Link], rm.Link] = lambda link: link


def _fix_half(agree: Sequence[bool]) -> list[bool]:
    """A better-matched draft, crudely: every second disagreement becomes an agreement."""
    out, misses = [], 0
    for a in agree:
        misses += not a
        out.append(a or misses % 2 == 0)
    return out


SCENARIOS = [
    Scenario("model", "the model, as measured"),
    Scenario("flat_passes", "every pass at a one-token pass's cost", costs=lambda c: c.flat()),
    Scenario("no_delay", "no network delay", link=lambda link: rm.Link(link.draft_ms, 0.0)),
    # What a quicker draft alone would buy: the lever a quicker target leaves (docs/benchmarks.md).
    Scenario("quicker_draft", "draft steps in two thirds of the time",
             link=lambda link: rm.Link(link.draft_ms * 2 / 3, link.one_way_ms)),
    Scenario("half_the_misses_fixed", "every second disagreement made an agreement", agreement=_fix_half),
    Scenario("draft_always_right", "a draft that always agrees", agreement=lambda a: [True] * len(a)),
]


def agreement(drafter: Drafter, prompt_ids: Sequence[int], continuation: Sequence[int]) -> list[bool]:
    """Per position of `continuation`: is the draft's greedy token, fed the prompt and the
    continuation before that position, the continuation's token?"""
    seq = list(prompt_ids)
    out = []
    for token in continuation:
        out.append(int(np.argmax(drafter.next_logits(seq))) == token)
        seq.append(token)
    return out


def pass_costs(report: dict) -> rm.PassCosts:
    """One session's pass times by tokens from a bench/gpu_passes.py report."""
    (arch,) = report["archs"].values()
    return rm.PassCosts(tuple((p["tokens_per_session"], p["ms_median"]) for p in arch["passes"] if p["sessions"] == 1))


def measured_speedups(runs: list[dict], rtt_ms: float) -> dict[str, float]:
    """Per mode, the mean over prompts of decoding speed (tokens after the first, over the
    time after it) relative to `none`'s on the same prompt."""
    def decode_rate(r: dict) -> float:
        return (r["tokens"] - 1) / (r["elapsed_s"] - r["ttft_s"])

    base = {r["prompt"]: decode_rate(r) for r in runs if r["mode"] == "none" and r["rtt_ms"] == rtt_ms}
    ratios: dict[str, list[float]] = {}
    for r in runs:
        if r["rtt_ms"] == rtt_ms and r["prompt"] in base and r.get("ttft_s") is not None:
            ratios.setdefault(r["mode"], []).append(decode_rate(r) / base[r["prompt"]])
    return {mode: statistics.fmean(rs) for mode, rs in ratios.items()}


def replay(agree: Sequence[bool], costs: rm.PassCosts, link: rm.Link, sync_k: Sequence[int]) -> dict[str, rm.Decoded]:
    out = {"none": rm.none(agree, costs)}
    out.update({f"sync-{k}": rm.sync(agree, costs, link, k) for k in sync_k})
    out["async"] = rm.asynchronous(agree, costs, link)
    return out


def model_speedups(agreements: dict[str, list[bool]], costs: rm.PassCosts, link: rm.Link,
                   sync_k: Sequence[int]) -> dict[str, dict[str, dict[str, float]]]:
    """Scenario -> mode -> {speedup (mean over prompts of the ratio to `none`), idle fraction}."""
    out: dict = {}
    for scenario in SCENARIOS:
        per_mode: dict[str, list[tuple[float, float]]] = {}
        for agree in agreements.values():
            decoded = replay(scenario.agreement(agree), scenario.costs(costs), scenario.link(link), sync_k)
            base = decoded["none"].tokens_per_s
            for mode, d in decoded.items():
                per_mode.setdefault(mode, []).append((d.tokens_per_s / base, d.server_idle_ms / d.ms))
        out[scenario.key] = {mode: {"speedup": statistics.fmean(s for s, _ in v), "server_idle": statistics.fmean(i for _, i in v)}
                    for mode, v in per_mode.items()}
    return out


def render(result: dict) -> str:
    s = result["settings"]
    modes = list(result["scenarios"]["model"])
    lines = [
        f"# Replay model over `{s['bench']}`",
        "",
        (f"- machine of the measurements: {result['machine']['cpu']}, {result['machine']['cores']} cores; "
         f"pass times from `{s['pass_costs']}` ({', '.join(f'{t} tok {ms:.0f} ms' for t, ms in s['pass_ms'])})"),
        (f"- draft {s['draft_ms']:.1f} ms a token (the run's draft-alone speed); one-way delay {s['one_way_ms']:.0f} ms; "
         f"{len(result['agreement'])} prompts, teacher-forced draft agreement {s['agreement']:.0%}"),
        ("- decoding only: the first token (the prompt's prefill, the same in every mode) is left out of both the "
         "measured and the modelled figures"),
        f"- rerun: `{s['rerun']}`",
        "",
        "Speedup over `none`, mean of per-prompt ratios; in brackets the server's idle fraction in the model.",
        "",
        "| mode | measured | " + " | ".join(sc.title for sc in SCENARIOS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in SCENARIOS) + " |",
    ]
    for mode in modes:
        measured = result["measured"].get(mode)
        cells = [f"{measured:.2f}x" if measured is not None else "–"]
        for sc in SCENARIOS:
            m = result["scenarios"].get(sc.key, {}).get(mode)  # results from before a scenario was added lack it
            cells.append(f"{m['speedup']:.2f}x ({m['server_idle']:.0%})" if m else "–")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
    """A path as the report shows it: relative to the repository when inside it, else as given
    (absolute, quoted: the rerun line must run from the repository's root)."""
    full = path.resolve()
    return str(full.relative_to(HERE.parent)) if full.is_relative_to(HERE.parent) else shlex.quote(str(full))


def _result(path: Path, keys: tuple[str, ...], what: str) -> dict:
    """The JSON result at `path`, or ValueError where it is not `what` (it lacks `keys`)."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(data, dict) or any(k not in data for k in keys):
        raise ValueError(f"{path} is not {what} (it lacks {', '.join(k for k in keys if not isinstance(data, dict) or k not in data)})")
    return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", type=Path, default=DEFAULT_BENCH,
                   help="a bench/run_bench.py result with `none` runs (default: %(default)s)")
    p.add_argument("--rtt-ms", type=float, default=None, help="which of its RTTs (default: its first)")
    p.add_argument("--pass-costs", type=Path, default=HERE / "results" / "cpu-passes-bf16-invariant.json",
                   help="a bench/gpu_passes.py result for the same target and machine (default: %(default)s)")
    p.add_argument("--draft", type=Path, default=None,
                   help="the ONNX draft directory the run used (default: the default pair's, prepared if need be)")
    p.add_argument("--sync-k", type=at_least(1), nargs="+", default=None, help="drafts per round of sync "
                   "(default: the run's, else 2 4 6 8)")
    p.add_argument("--name", type=report_name,
                   help="writes NAME.json and NAME.md in --out (default: replay for the default --bench, else "
                   "replay-STEM after the --bench file's name, so a replay of another run keeps the committed one)")
    p.add_argument("--out", type=out_dir, default=HERE / "results", help="where (default: bench/results)")
    args = p.parse_args()
    default_name = "replay" if args.bench.resolve() == DEFAULT_BENCH else f"replay-{args.bench.stem}"
    args.name = args.name or default_name
    if not args.bench.is_file() or not args.pass_costs.is_file():
        p.error(f"need both {args.bench} and {args.pass_costs}: run bench/run_bench.py and bench/gpu_passes.py first")

    try:
        bench = _result(args.bench, ("network", "runs", "machine"), "a bench/run_bench.py result")
        passes = _result(args.pass_costs, ("archs",), "a bench/gpu_passes.py result")
        if not isinstance(passes["archs"], dict) or len(passes["archs"]) != 1:
            raise ValueError(f"{args.pass_costs} holds {len(passes['archs'])} targets' pass times: give one of one")
        costs = pass_costs(passes)
    except ValueError as exc:
        p.error(str(exc))
    # The model's edge and server are the defaults': a run of other settings would stand in the
    # report beside a model of something else.
    settings = bench.get("settings", {})
    if settings.get("window", "auto") != "auto":
        p.error(f"{args.bench} ran async with a fixed window of {settings['window']}; the model replays the edge's "
                f"default (sized from the acceptance seen, at most {rm.EDGE_MAX_WINDOW})")
    if settings.get("server_args"):
        p.error(f"{args.bench} ran the server with `{settings['server_args']}`; the model replays serve's defaults")
    args.sync_k = args.sync_k or settings.get("sync_k") or [2, 4, 6, 8]
    rtt = args.rtt_ms if args.rtt_ms is not None else bench["network"]["rtt_ms"][0]
    nones = {r["prompt"]: r for r in bench["runs"] if r["mode"] == "none" and r["rtt_ms"] == rtt}
    drafts = [r["tokens_per_s"] for r in bench["runs"] if r["mode"] == "draft"]
    if not nones or not drafts:
        p.error(f"{args.bench} has no `none` runs at RTT {rtt} ms or no draft-alone runs")
    texts = {q["id"]: q["text"] for q in benchmark_prompts()}
    if unknown := sorted(set(nones) - set(texts)):
        p.error(f"{args.bench} has prompts not in the benchmark's prompt set: {', '.join(unknown)}")
    link = rm.Link(draft_ms=1000.0 / statistics.fmean(drafts), one_way_ms=rtt / 2)

    # Imported here: loading them is slow, and bad arguments should fail fast.
    from specsplit.edge.drafter import OnnxDrafter
    from specsplit.edge.tokenizer import EdgeTokenizer
    from prepared_pair import prepared_pair

    draft_dir = args.draft or prepared_pair().draft_dir
    if (ran := bench.get("models", {}).get("draft")) and draft_dir.resolve().name != ran:
        p.error(f"{args.bench} ran the draft {ran}, not {draft_dir.resolve().name}: give its directory with --draft")
    tokenizer, drafter = EdgeTokenizer(draft_dir), OnnxDrafter(draft_dir, threads=1)
    agreements = {}
    for prompt, run in tqdm(nones.items(), desc="draft agreement", unit="prompt"):
        drafter.reset()
        agreements[prompt] = agreement(drafter, tokenizer.encode(tokenizer.chat_prompt(texts[prompt])), run["token_ids"])

    result = {
        "machine": bench["machine"],
        "settings": {
            "bench": _shown(args.bench), "pass_costs": _shown(args.pass_costs), "pass_ms": list(costs.points), "rtt_ms": rtt,
            "one_way_ms": link.one_way_ms, "draft_ms": link.draft_ms, "sync_k": args.sync_k,
            "agreement": statistics.fmean(x for a in agreements.values() for x in a),
            "rerun": f"python bench/replay.py --bench {_shown(args.bench)} --pass-costs {_shown(args.pass_costs)} "
                     f"--sync-k {' '.join(map(str, args.sync_k))}" + (f" --rtt-ms {rtt:g}" if args.rtt_ms is not None else "")
                     + (f" --name {args.name}" if args.name != default_name else "")
                     + (f" --out {_shown(args.out)}" if args.out.resolve() != (HERE / "results").resolve() else "")
                     + (f" --draft {_shown(args.draft)}" if args.draft else ""),
        },
        "agreement": {k: "".join("1" if x else "0" for x in a) for k, a in agreements.items()},
        "measured": measured_speedups(bench["runs"], rtt),
        "scenarios": model_speedups(agreements, costs, link, args.sync_k),
    }
    save_report(args.out, args.name, result, render(result))


if __name__ == "__main__":
    main()
