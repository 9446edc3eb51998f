"""The real exporter, a real server process, the real edge client, over loopback gRPC."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from functools import lru_cache

import grpc
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specsplit.edge.client import ConnectOptions, EdgeConfig, OnCommitFailed, generate
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.tokenizer import EdgeTokenizer
from specsplit.protocol.messages import SamplingParams, VerificationMode
from specsplit.protocol.sampling import process_logits
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc
from transformers import AutoModelForCausalLM
from conftest import PROBE_PROMPT

PROMPTS = [PROBE_PROMPT, "The quick brown fox", "for i in range(10):\n    print(i"]
LENGTHS = [1, 9, 40]


@lru_cache(maxsize=None)
def target_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def reference(path: str, prompt_ids: list[int], max_new: int) -> list[int]:
    model = target_model(path)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def run(server: str, prompt_ids, cfg: EdgeConfig, draft_dir=None, **kw):
    drafter = OnnxDrafter(draft_dir) if draft_dir is not None else None
    fingerprint = kw.pop("fingerprint", EdgeTokenizer(draft_dir).fingerprint if draft_dir else "")
    return asyncio.run(generate(server, prompt_ids, cfg, drafter=drafter, fingerprint=fingerprint, **kw))


@pytest.mark.parametrize(
    ("mode", "draft"),
    [("async", "draft_dir"), ("async", "same_dir"), ("sync", "draft_dir"), ("sync", "same_dir"), ("none", None)],
)
def test_greedy_output_equals_target_generate(tiny, server, mode, draft) -> None:
    tok = EdgeTokenizer(tiny.draft_dir)
    draft_dir = getattr(tiny, draft) if draft else None
    endings = set()
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        for n in LENGTHS:
            cfg = EdgeConfig(mode=mode, max_new_tokens=n, window=8, k=4)
            result = run(server, ids, cfg, draft_dir, fingerprint=tok.fingerprint)
            want = reference(str(tiny.target_dir), ids, n)
            assert result.tokens == want, (prompt, n)
            endings.add(result.stats.done_reason)
            if draft == "same_dir":
                assert result.stats.acceptance_rate == 1.0 or result.stats.drafts_proposed == 0
    assert endings == {"eos", "length"}, endings


def test_sync_k_past_the_servers_limits_drafts_what_it_takes(tiny, server, caplog) -> None:
    """k over the chunk limit (64) failed every generation with RESOURCE_EXHAUSTED, and over
    the server's lookahead with OUT_OF_RANGE; now a round drafts what the server takes."""
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("def add(a, b):")
    result = run(server, ids, EdgeConfig(mode="sync", k=200, max_new_tokens=80), tiny.same_dir)
    assert result.tokens == reference(str(tiny.target_dir), ids, 80)
    assert result.stats.drafts_proposed <= 32 * result.stats.verifications  # the test server's lookahead
    assert "k 200 is past what the server takes at once; drafting 32 per round" in caplog.text


def test_chat_template_and_stop_ids(tiny, server) -> None:
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode(tok.chat_prompt("hello"))
    assert ids[0] == tok.token_id("<|im_start|>")
    want = reference(str(tiny.target_dir), ids, 20)
    stop = want[3]
    result = run(server, ids, EdgeConfig(max_new_tokens=20, stop_ids=(stop,)), tiny.draft_dir)
    assert result.tokens == want[: want.index(stop) + 1] and result.stats.done_reason == "stop"


def test_a_seed_gives_the_same_sampled_text_in_every_mode(tiny, server) -> None:
    """With match verification (the default when sampling) the text for a seed is the one the
    target alone draws: the drafts, their timing and the mode only change how fast it comes."""
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("import numpy")
    for seed in (1, 2, 3):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        texts = {mode: run(server, ids, EdgeConfig(mode=mode, max_new_tokens=40, sampling=sampling),
                           None if mode == "none" else tiny.draft_dir, fingerprint=tok.fingerprint).tokens
                 for mode in ("none", "sync", "async")}
        assert texts["sync"] == texts["none"] and texts["async"] == texts["none"], (seed, texts)


def _first_two_counts(server, tiny, ids, mode, params, sessions) -> np.ndarray:
    """Run many short sampled sessions concurrently; count (first, second) token pairs."""

    async def main():
        sem = asyncio.Semaphore(16)
        drafters = [OnnxDrafter(tiny.draft_dir) for _ in range(16)]
        fp = EdgeTokenizer(tiny.draft_dir).fingerprint
        async with grpc.aio.insecure_channel(server) as ch:
            async def one(i):
                async with sem:
                    drafter = drafters.pop()
                    try:
                        sampling = SamplingParams(params.temperature, params.top_p, params.top_k, seed=i)
                        cfg = EdgeConfig(max_new_tokens=2, sampling=sampling, verification=mode, window=4)
                        r = await generate(ch, ids, cfg, drafter=drafter, fingerprint=fp)
                        return r.tokens
                    finally:
                        drafter.reset()
                        drafters.append(drafter)
            return await asyncio.gather(*(one(i) for i in range(sessions)))

    return asyncio.run(main())


@pytest.mark.parametrize("mode", [VerificationMode.MATCH, VerificationMode.SPARSE_Q])
def test_sampled_output_follows_target_distribution(tiny, server, mode) -> None:
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("import numpy")
    params = SamplingParams(temperature=1.5, top_k=6)
    sessions = 360
    pairs = _first_two_counts(server, tiny, ids, mode, params, sessions)
    model = target_model(str(tiny.target_dir))
    with torch.no_grad():
        p0 = process_logits(model(torch.tensor([ids])).logits[0, -1].numpy(), params)
    first = np.array([t[0] for t in pairs])
    support = np.flatnonzero(p0)
    assert set(first) <= set(support)
    obs = np.array([(first == s).sum() for s in support])
    assert chisquare(obs, p0[support] * sessions).pvalue > 1e-3
    # The second position, conditioned on the first: pool the 36 (y0, y1) cells.
    expected, observed = [], []
    for y0 in support:
        with torch.no_grad():
            p1 = process_logits(model(torch.tensor([ids + [int(y0)]])).logits[0, -1].numpy(), params)
        for y1 in np.flatnonzero(p1):
            expected.append(p0[y0] * p1[y1] * sessions)
            observed.append(sum(1 for a, b in pairs if a == y0 and b == y1))
    assert sum(observed) == sessions, "a second token outside the target's support was committed"
    expected, observed = np.array(expected), np.array(observed)
    big = expected >= 5
    obs_b = np.append(observed[big], observed[~big].sum())
    exp_b = np.append(expected[big], expected[~big].sum())
    assert chisquare(obs_b, exp_b).pvalue > 1e-3


def test_fingerprint_mismatch_is_failed_precondition(tiny, server) -> None:
    tok = EdgeTokenizer(tiny.draft_dir)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        run(server, tok.encode("hi"), EdgeConfig(max_new_tokens=4), tiny.draft_dir, fingerprint="0123456789abcdef",
            draft_model="tiny-draft")
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Both sides are named, with the fingerprint each holds.
    assert "draft model tiny-draft (fingerprint 0123456789abcdef) differs" in exc.value.details()
    # The target is named, but not by where the server keeps it: every edge reads this.
    assert f"model {tiny.target_dir.name} (fingerprint" in exc.value.details()
    assert str(tiny.target_dir) not in exc.value.details()


def test_draft_before_open_over_grpc(server) -> None:
    with grpc.insecure_channel(server) as ch:
        stub = pb_grpc.SpecSplitStub(ch)
        msgs = [pb.EdgeMessage(draft=pb.Draft(start=1, tokens=[1], parent_hash=0))]
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(iter(msgs), timeout=10))
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION


BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers'):
            raise ImportError(f'{name} is not available on the edge')
sys.meta_path.insert(0, Block())
from specsplit.edge.cli import main
rc = main(sys.argv[1:])
assert 'torch' not in sys.modules and 'transformers' not in sys.modules
sys.exit(rc)
"""


def test_edge_runs_without_torch_or_transformers(tiny, server) -> None:
    args = ["generate", "--server", server, "--draft", str(tiny.draft_dir), "--max-new-tokens", "12", "--json", "--raw",
            "The quick brown fox"]
    proc = subprocess.run([sys.executable, "-c", BLOCKER, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    tok = EdgeTokenizer(tiny.draft_dir)
    raw = tok.encode("The quick brown fox", add_special_tokens=True)  # as --raw sends it
    assert out["token_ids"] == reference(str(tiny.target_dir), raw, 12)


def edge_cli(server: str, draft, *args: str, **run: object) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    """`specsplit-edge generate --server SERVER --draft DRAFT ARGS...` as a process of its own."""
    run.setdefault("stdout", subprocess.PIPE)
    run.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([sys.executable, "-m", "specsplit.edge.cli", "generate", "--server", server, "--draft",
                           str(draft), *args], text=True, timeout=120, **run)  # type: ignore[call-overload]


def test_edge_cli_streams_text_and_stats(tiny, server) -> None:
    proc = edge_cli(server, tiny.draft_dir, "--max-new-tokens", "10", "--mode", "sync", "hello")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("[sync] 10 tokens")  # beside the text, not in it


def test_edge_cli_generates_each_line_of_its_input_on_one_stream(tiny, server) -> None:
    prompts = ["The quick brown fox", "def add(a, b):"]
    proc = edge_cli(server, tiny.draft_dir, "--max-new-tokens", "8", "--json", "--raw", "--prompts-file", "-",
                    input=f"{prompts[0]}\n\n{prompts[1]}\n")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    tok = EdgeTokenizer(tiny.draft_dir)
    raw = [tok.encode(p, add_special_tokens=True) for p in prompts]
    assert [line["token_ids"] for line in lines] == [reference(str(tiny.target_dir), ids, 8) for ids in raw]
    first = lines[0]["session_id"]
    assert lines[1]["session_id"] == f"{first}.2"  # the second opened on the first one's stream
    assert [(line["line"], line["prompt"]) for line in lines] == [(1, prompts[0]), (3, prompts[1])]


def test_a_prompt_the_server_refuses_does_not_end_the_others(tiny, server) -> None:
    """One prompt too long for the target's context: an error on its line, a JSON line in its
    place, the prompts after it still generated, and exit status 1."""
    too_long = " ".join(["word"] * 400)
    proc = edge_cli(server, tiny.draft_dir, "--max-new-tokens", "8", "--json", "--raw", "--prompts-file", "-",
                    input=f"hello\n{too_long}\ndef add(a, b):\n")
    assert proc.returncode == 1, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["line"] for line in lines] == [1, 2, 3]
    assert lines[1]["error"].startswith("OUT_OF_RANGE: prompt of") and "token_ids" not in lines[1]
    tok = EdgeTokenizer(tiny.draft_dir)
    raw = tok.encode("def add(a, b):", add_special_tokens=True)
    assert lines[2]["token_ids"] == reference(str(tiny.target_dir), raw, 8)
    assert "error: line 2: OUT_OF_RANGE" in proc.stderr and "error: 1 of the prompts failed" in proc.stderr


def test_a_prompt_past_the_servers_message_limit_does_not_end_the_others(tiny, tmp_path) -> None:
    """A prompt whose Open is past the server's --max-message-bytes, which the server refuses,
    and one past twice that, which gRPC refuses before it: RESOURCE_EXHAUSTED without
    pushback, each its own prompt's failure. Before, the run ended at the first, the prompts
    after it never sent."""
    from conftest import launch_server

    tok = EdgeTokenizer(tiny.draft_dir)

    def packed(text: str) -> int:  # the bytes of the Open's prompt ids
        return sum(1 if i < 128 else 2 for i in tok.encode(text, add_special_tokens=True))

    over, far_over = "word " * 1200, "word " * 3000
    assert 4096 < packed(over) < 8192 < packed(far_over)
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--max-message-bytes", "4096") as (address, _):
        proc = edge_cli(address, tiny.draft_dir, "--max-new-tokens", "4", "--json", "--raw", "--prompts-file", "-",
                        input=f"hello\n{over}\n{far_over}\ndef add(a, b):\n")
    assert proc.returncode == 1, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["line"] for line in lines] == [1, 2, 3, 4]
    assert [line.get("error", "").split(":")[0] for line in lines] == ["", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED", ""]
    assert lines[3]["token_ids"] == reference(str(tiny.target_dir), tok.encode("def add(a, b):", add_special_tokens=True), 4)
    assert "error: 2 of the prompts failed" in proc.stderr


def test_health_and_reflection(server) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    proc = subprocess.run([sys.executable, "-m", "specsplit.server.cli", "health", "--address", server],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "SERVING" in proc.stdout
    with grpc.insecure_channel(server) as ch:
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
    assert "specsplit.v1.SpecSplit" in services and "grpc.health.v1.Health" in services


def test_an_on_commit_that_raises_ends_the_generation_unretried(tiny, server) -> None:
    """A closed stdout raises BrokenPipeError, an OSError as a lost connection is: it was
    retried five times, generating the text again each time, then raised."""
    tok = EdgeTokenizer(tiny.draft_dir)
    calls = []

    def closed_stdout(generated: list[int]) -> None:
        calls.append(len(generated))
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(OnCommitFailed) as failed:
        run(server, tok.encode("hello"), EdgeConfig(max_new_tokens=8), tiny.draft_dir, on_commit=closed_stdout,
            connect=ConnectOptions(retries=5, backoff_s=0.01))
    assert isinstance(failed.value.__cause__, BrokenPipeError) and len(calls) == 1


def test_edge_cli_stops_quietly_when_its_reader_goes(tiny, server) -> None:
    """`specsplit-edge generate ... | head -c 1`: the pipe's reader gone, nothing to retry."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = edge_cli(server, tiny.draft_dir, "--max-new-tokens", "8", "--raw", "hello", stdout=write)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize(("stdout", "env", "says"), [
    ("/dev/full", {}, "No space left on device"),  # a full disk
    (None, {"PYTHONIOENCODING": "ascii"}, "codec can't encode"),  # an encoding without the text's characters
])
def test_edge_cli_says_in_one_line_when_its_answer_cannot_be_written(tiny, server, tmp_path, stdout, env, says) -> None:
    """Not a traceback: one line, exit 1, and no second failure as the interpreter exits."""
    if stdout is not None and not os.path.exists(stdout):
        pytest.skip(f"{stdout} is not on this system")
    with open(stdout or tmp_path / "out.txt", "w") as out:
        proc = edge_cli(server, tiny.draft_dir, "--max-new-tokens", "8", "--raw", "héllo ünïcode", stdout=out,
                        env={**os.environ, **env})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: writing the answer to standard output failed:") and says in lines[0]


FULL_MID_ANSWER = """
import errno, sys
from specsplit.edge import cli

class FillsUp:
    def __init__(self, out):
        self.out, self.writes = out, 0
    def write(self, text):
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.out.write(text)
    def flush(self):
        self.out.flush()

real = cli.TextStream.__init__
cli.TextStream.__init__ = lambda self, tokenizer, out=None: real(self, tokenizer, FillsUp(sys.stdout))
sys.exit(cli.main(sys.argv[1:]))
"""


def test_edge_cli_says_in_one_line_when_its_disk_fills_mid_answer(tiny, server) -> None:
    """The line the answer had begun was ended on the full disk as well: that second failure
    replaced the first, and the run ended as a usage error (exit 2)."""
    proc = subprocess.run([sys.executable, "-c", FULL_MID_ANSWER, "generate", "--server", server, "--draft",
                           str(tiny.draft_dir), "--max-new-tokens", "12", "--mode", "none", "--raw", "The quick brown fox"],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0] == "error: writing the answer to standard output failed: [Errno 28] No space left on device"


def test_a_prompt_the_chat_template_refuses_does_not_end_the_others(tiny, server, tmp_path) -> None:
    import shutil

    from tiny_models import CHAT_TEMPLATE

    draft = tmp_path / "draft"
    shutil.copytree(tiny.draft_dir, draft)
    (draft / "chat_template.jinja").write_text(
        "{% if 'forbidden' in messages[0]['content'] %}{{ raise_exception('no forbidden words') }}{% endif %}"
        + CHAT_TEMPLATE)
    proc = edge_cli(server, draft, "--max-new-tokens", "4", "--json", "--prompts-file", "-",
                    input="hello\na forbidden one\nbye\n")
    assert proc.returncode == 1, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line["line"] for line in lines] == [1, 2, 3] and "token_ids" in lines[2]
    assert lines[1]["error"] == "the chat template failed on this prompt: no forbidden words"
