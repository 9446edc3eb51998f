"""Target pass times and batching divergence of the server's engine, on random or real weights.

Two questions the capacity report rests on:
1. What does one verification pass cost as sessions and tokens per session grow?
   (The engine's `verify_batch`, padding and cache copies included, at a given KV length.)
2. Does batching change anyone's greedy output? Sessions decode greedily alone and
   then together (lockstep autoregressive steps, and speculative passes with drafts
   taken from the alone run with some corrupted); the report counts the sessions whose
   tokens differ from the alone run, and where the first difference falls. In fp32 on
   CPU none may differ; in bf16 on a GPU a batch's different kernels may flip near-ties.
   Random weights decode random ids; a real model (`--target`) decodes the benchmark's
   prompts under its chat template, since its margins on text decide how often that happens.

Runs on CPU too (`--arch tiny`), which is how its code is kept working without a GPU;
`--target DIR` times a real model instead (the CPU report compares `--cpu-linear` settings
on the default target that way). Writes NAME.json and .md into --out-dir (bench/results).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cli_types import int_list, out_dir, report_name
from loadtest.machine import machine_info
from loadtest.prompts import load_prompts
from loadtest.rerun import rerun_command
from loadtest.targets import ARCHS, write_config_target
from prepared_pair import prepared_pair
from report_files import save_report
from specsplit.server.engine import Engine, TargetEngine, VerifyItem
from specsplit.server.static_engine import StaticEngine
from specsplit.server.loading import LoadedModel, load_model

HERE = Path(__file__).resolve().parent
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 320}


def build_engine(arch: str, device: str, dtype: str, work: Path, kind: str, slots: int, max_len: int,
                 cpu_linear: str = "default", fuse: bool | None = None) -> Engine:
    loaded = load_target(arch, device, dtype, work, cpu_linear)
    return StaticEngine(loaded, slots, max_len, fuse=fuse) if kind == "static" else TargetEngine(loaded)


def load_target(arch: str, device: str, dtype: str, work: Path, cpu_linear: str = "default") -> LoadedModel:
    """`arch`'s configuration with random weights (written under `work`), or a model directory's own."""
    real = Path(arch).is_dir()  # a model directory: its own weights
    target = Path(arch) if real else write_config_target(work / arch, "qwen2-1.5b" if arch == "tiny" else arch)
    if arch == "tiny":
        config = json.loads((target / "config.json").read_text())
        config.update(TINY, tie_word_embeddings=False)
        config.pop("layer_types", None)  # derived from the layer count again on load
        (target / "config.json").write_text(json.dumps(config))
    return load_model(str(target), dtype=dtype, device=device, load_format="auto" if real else "dummy",
                      onnxruntime_linears=cpu_linear == "onnxruntime")


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def pass_times(engine: Engine, batches: list[int], tokens: list[int], kv_len: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    rows = []
    for b in batches:
        prefixes = [list(map(int, rng.integers(0, vocab, kv_len + 1))) for _ in range(b)]
        states = [engine.new_state() for _ in range(b)]
        engine.verify_batch([VerifyItem(s, p, [], greedy=True) for s, p in zip(states, prefixes)])  # prefill
        for n in tokens:
            drafts = [list(map(int, rng.integers(0, vocab, n - 1))) for _ in range(b)]
            items = [VerifyItem(s, p, d, greedy=True) for s, p, d in zip(states, prefixes, drafts)]
            for _ in range(2):
                engine.verify_batch(items)  # warm-up; each pass re-crops to kv_len and feeds n tokens
            sync(engine)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.verify_batch(items)
                sync(engine)
                times.append(time.perf_counter() - t0)
            rows.append({"sessions": b, "tokens_per_session": n, "kv_len": kv_len,
                         "ms_median": 1000 * float(np.median(times)), "ms_min": 1000 * min(times)})
            print(f"  batch {b:3d} x {n:2d} tokens: {rows[-1]['ms_median']:.1f} ms", file=sys.stderr, flush=True)
        release(states)
    return rows


def release(states: list) -> None:  # type: ignore[type-arg]
    for state in states:
        state.crop(0)  # frees a static engine's slot


def decode_alone(engine: Engine, prompt: list[int], steps: int) -> list[int]:
    kv, out = engine.new_state(), []
    for _ in range(steps):
        out.append(int(engine.verify_batch([VerifyItem(kv, prompt + out, [], greedy=True)])[0][0]))
    release([kv])
    return out


def decode_batched(engine: Engine, prompts: list[list[int]], steps: int, drafts_from: list[list[int]] | None,
                   k: int, corrupt: float, rng: np.random.Generator) -> list[list[int]]:
    """Greedy decoding of all sessions in shared passes: plain steps (drafts_from None), or
    speculative passes whose k drafts come from `drafts_from` with some corrupted."""
    states = [engine.new_state() for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < steps for o in outs):
        live = [i for i, o in enumerate(outs) if len(o) < steps]
        items = []
        for i in live:
            drafts: list[int] = []
            if drafts_from is not None:
                pos = len(outs[i])
                drafts = list(drafts_from[i][pos : pos + min(k, steps - pos - 1)])
                drafts = [t if rng.random() > corrupt else (t + 1) % engine.vocab_size for t in drafts]
            items.append(VerifyItem(states[i], prompts[i] + outs[i], drafts, greedy=True))
        for i, item, ids in zip(live, items, engine.verify_batch(items)):
            n = 0
            while n < len(item.drafts) and item.drafts[n] == int(ids[n]):
                n += 1
            outs[i].extend([*item.drafts[:n], int(ids[n])][: steps - len(outs[i])])
    release(states)
    return outs


def divergence(alone: list[list[int]], other: list[list[int]]) -> dict:
    """Sessions whose tokens differ; `first_divergence_at` holds 0-based token indices, and
    `diverged` (session, index) pairs, so that repeated prompts can be told apart."""
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(alone, other)]
    diverged = [(i, f) for i, f in enumerate(first) if f is not None]
    return {"sessions": len(alone), "sessions_diverged": len(diverged),
            "divergence_rate": len(diverged) / len(alone), "first_divergence_at": sorted(f for _, f in diverged),
            "diverged": diverged}


def logit_noise(engine: Engine, prompts: list[list[int]]) -> dict:
    """How far batching moves logits, against how close the top two logits are: a greedy
    choice flips where the first exceeds the second."""
    alone = []
    for p in prompts:
        state = engine.new_state()
        alone.append(engine.verify_batch([VerifyItem(state, p, [])])[0][0])
        release([state])
    states = [engine.new_state() for _ in prompts]
    batched = [rows[0] for rows in engine.verify_batch([VerifyItem(s, p, []) for s, p in zip(states, prompts)])]
    release(states)
    gaps = [float(np.diff(np.sort(row)[-2:])[0]) for row in alone]
    return {"max_abs_logit_change": float(max(np.abs(a - b).max() for a, b in zip(alone, batched))),
            "median_top2_gap": float(np.median(gaps)), "min_top2_gap": float(min(gaps))}


def chat_prompts(target: Path, sessions: int) -> list[list[int]]:
    """The benchmark's prompts under the target's chat template, repeated to `sessions`: a
    trained model's margins on text it was trained for, not on random ids, decide how often
    batching flips its greedy choice."""
    ids = load_prompts(target, "benchmark").ids  # as the benchmark's edges encode them
    return [list(ids[i % len(ids)]) for i in range(sessions)]


def batching_divergence(engine: Engine, sessions: int, steps: int, k: int,
                        prompts: list[list[int]] | None = None) -> dict:
    """`prompts` None: random ids of random lengths (random weights have no text to read)."""
    rng = np.random.default_rng(1)
    source = "random ids" if prompts is None else "the benchmark's prompts cycled, chat template applied"
    if prompts is None:
        prompts = [list(map(int, rng.integers(0, engine.vocab_size, int(rng.integers(8, 64)))))
                   for _ in range(sessions)]
    alone = [decode_alone(engine, p, steps) for p in prompts]
    again = [decode_alone(engine, p, steps) for p in prompts]  # control: is decoding alone repeatable?
    lockstep = decode_batched(engine, prompts, steps, None, k, 0.0, rng)
    speculative = decode_batched(engine, prompts, steps, alone, k, 0.3, rng)
    return {"steps": steps, "k": k, "corrupted_drafts": 0.3, "prompts": source,
            "alone_again_vs_alone": divergence(alone, again), "lockstep_vs_alone": divergence(alone, lockstep), "speculative_vs_alone": divergence(alone, speculative),
            "logits": logit_noise(engine, prompts)}


def render(report: dict) -> str:
    m = report["machine"]
    weights = f"weights of {report['target']}" if report.get("target") else "random weights"
    kind = report.get("engine", "dynamic")  # reports from before the static engine existed
    engine = f"{kind} engine"
    if kind == "static":
        # Reports from before the engine's count was kept say what --fuse asked for, or (older
        # still, before fusing existed) nothing: eager.
        fused = [res.get("fused_modules", report.get("fuse") or 0) for res in report["archs"].values()]
        engine += ", norms and MLPs " + ("compiled" if all(fused) else "eager" if not any(fused) else "partly compiled")
    lines = [f"# Engine passes and batching divergence ({engine}, {report['dtype']}, {weights})", "",
             f"Machine: {m.get('gpu') or m.get('cpu')}; torch {report.get('torch', '?')}; {report.get('threads', '?')} thread(s); "
             f"linear layers: {report.get('cpu_linear', '?')}. Rerun: `{report['rerun']}`", ""]
    for arch, res in report["archs"].items():
        lines += [f"## {arch}", "", "| sessions | tokens each | KV length | pass ms (median) |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['sessions']} | {r['tokens_per_session']} | {r['kv_len']} | {r['ms_median']:.1f} |"
                  for r in res["passes"]]
        d = res.get("divergence")
        if d:
            # Keys missing from the earliest reports: the prompts (random ids then), the control and the logits.
            source = d.get("prompts", "random ids")
            lines += ["", f"Greedy decoding of {d['lockstep_vs_alone']['sessions']} sessions ({source}) for "
                      f"{d['steps']} tokens, alone vs in shared passes:", ""]
            if "alone_again_vs_alone" in d:
                lines.append(f"- alone, twice (control): {d['alone_again_vs_alone']['sessions_diverged']} sessions differ")
            lines += [f"- lockstep steps: {d['lockstep_vs_alone']['sessions_diverged']} sessions differ "
                      f"(first differences at {d['lockstep_vs_alone']['first_divergence_at']})",
                      f"- speculative passes (k={d['k']}, {d['corrupted_drafts']:.0%} of drafts wrong): "
                      f"{d['speculative_vs_alone']['sessions_diverged']} sessions differ "
                      f"(first differences at {d['speculative_vs_alone']['first_divergence_at']})"]
            if "logits" in d:
                g = d["logits"]
                lines.append(f"- batching moves a logit by up to {g['max_abs_logit_change']:.3g}; the top two logits "
                             f"of these weights are a median {g['median_top2_gap']:.3g} apart (closest {g['min_top2_gap']:.3g})")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # No abbreviated options: the rerun line hides --out-dir's path only as spelled out.
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--arch", action="append", choices=[*ARCHS, "tiny"], help="repeatable (default: qwen2-1.5b and qwen2-7b)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--batches", type=int_list, default="1,8,32,64", help="sessions per pass, comma-separated")
    p.add_argument("--tokens", type=int_list, default="1,4,8,16", help="tokens per session per pass (drafts + 1)")
    p.add_argument("--kv-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--divergence-sessions", type=int, default=32, help="0 to skip the divergence check")
    p.add_argument("--divergence-steps", type=int, default=48)
    p.add_argument("--engine", choices=["dynamic", "static"], default="dynamic",
                   help="the server's --engine (static: slot cache, CUDA graphs on GPU)")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None,
                   help="the server's --fuse (static engine: norms and MLPs compiled; default: on a GPU)")
    p.add_argument("--target", help="time a real model's weights instead of --arch configs, and decode the "
                   "benchmark's chat prompts in the divergence check: a model directory, or 'default' for the "
                   "default pair's target (prepared into the model cache if needed)")
    p.add_argument("--cpu-linear", choices=["default", "onnxruntime"], default="default",
                   help="the server's --cpu-linear (onnxruntime: ONNX Runtime's GEMM for the large fp32 layers on CPU, "
                   "where its probe finds it row-invariant)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--name", type=report_name, default=None, help="default: gpu-passes-ENGINE")
    p.add_argument("--out-dir", type=out_dir, default=HERE / "results", help="where NAME.json and NAME.md go "
                   "(default: bench/results)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.fuse and args.engine != "static":
        p.error("--fuse compiles the static engine's modules; it needs --engine static")
    args.name = args.name or f"gpu-passes-{args.engine}"
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.target == "default":
        args.target = prepared_pair().target_dir
    elif args.target is not None:
        args.target = Path(args.target)
        if not (args.target / "config.json").is_file():
            p.error(f"--target {args.target}: not a model directory (no config.json)")
    if args.threads:
        torch.set_num_threads(args.threads)
    archs = [str(args.target)] if args.target else args.arch or ["qwen2-1.5b", "qwen2-7b"]
    report: dict = {"machine": machine_info(args.device), "dtype": dtype, "device": args.device, "engine": args.engine,
                    "fuse": args.fuse, "torch": torch.__version__,
                    "target": args.target.name if args.target else None, "cpu_linear": args.cpu_linear,
                    "threads": torch.get_num_threads(),
                    "rerun": rerun_command("bench/gpu_passes.py", argv,
                                           {"--target": "TARGET_DIR", "--out-dir": "OUT_DIR"}, keep={"default"}),
                    "archs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            print(f"{arch}: loading ({dtype} on {args.device})", file=sys.stderr, flush=True)
            batches = list(args.batches)
            engine = build_engine(arch, args.device, dtype, Path(tmp), args.engine,
                                  max(*batches, args.divergence_sessions), args.kv_len + 128, args.cpu_linear,
                                  args.fuse)
            res: dict = {"fused_modules": getattr(engine, "fused", 0),  # what compiled, not what was asked
                         "passes": pass_times(engine, batches,
                                              list(args.tokens), args.kv_len, args.repeats)}
            if args.divergence_sessions:
                print(f"{arch}: divergence check", file=sys.stderr, flush=True)
                prompts = chat_prompts(args.target, args.divergence_sessions) if args.target else None
                res["divergence"] = batching_divergence(engine, args.divergence_sessions, args.divergence_steps, 8,
                                                        prompts)
            report["archs"][Path(arch).name] = res
            del engine
            if args.device == "cuda":
                torch.cuda.empty_cache()
    save_report(args.out_dir, args.name, report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
