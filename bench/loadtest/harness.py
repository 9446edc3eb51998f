"""A whole load test: models, the pinned server (or one already running), warm-up,
reference continuations, the sweep, and the report describing all of it."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadtest.endpoint import ServerEndpoint
from loadtest.machine import machine_info
from loadtest.drafts import describe_draft
from loadtest.point import ServerHandle
from loadtest.prompts import PromptSet, load_prompts
from loadtest.report import build_report
from loadtest.scrape import UNREADABLE, scrape
from loadtest.sessions import LoadSettings, LoadSpec
from loadtest.sweep import INTERRUPTED, SweepConfig, reference_continuations, sweep, warm_up
from loadtest.workers import ClientWorkers
from orchestrate import free_port, running_server
from specsplit.edge.failures import GENERATION_FAILURES
from specsplit.edge.retry import describe
from specsplit.protocol.messages import Opened

LOG_TAIL = 3000  # characters of the server log shown when a run fails


@dataclass(frozen=True)
class RunOptions:
    target: Path | None = None  # None: target_config, or else the tiny test target
    target_config: str | None = None  # a Qwen2.5 shape served with random weights
    draft: Path | None = None  # None: the tiny test draft
    device: str = "cpu"
    dtype: str = "auto"
    server_args: tuple[str, ...] = ()  # passed to `serve` last, so they override ours
    server_cores: tuple[int, ...] = ()  # () : not pinned
    server_threads: int = 1
    client_cores: tuple[int, ...] = ()
    client_procs: int = 1
    server_log: Path | None = None  # None: a temporary file, shown in part if the run fails
    rerun: str = ""  # the command line that reproduces the run, for the report
    prompt_set: str = "stubs"  # loadtest.prompts.PROMPT_SETS
    # A server already running (a site's own deployment): none is started, the target and
    # server options above do not apply, and `draft` (required) gives the prompts' tokenizer.
    server: ServerEndpoint | None = None
    metrics_url: str | None = None  # that server's Prometheus metrics; None: no server figures


class SetupError(RuntimeError):
    """The load test cannot start: a server it did not start refused the warm-up, say."""


@contextmanager
def pinned(cores: Sequence[int]) -> Iterator[None]:
    """This process on `cores` for the block (nothing if empty), as it was afterwards."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True)
class Running:
    server: ServerHandle
    prompts: PromptSet
    opened: Opened  # the warm-up's: what the server serves (its target's name and vocabulary)
    draft_dir: Path | None  # the onnx edges' draft
    setup: dict  # what the report says of the machine, pinning, models and server
    server_log: Path | None = None  # of a server started here


def _client_pinning(opts: RunOptions) -> dict:
    return {"client_cores": list(opts.client_cores), "client_procs": opts.client_procs}


@contextmanager
def started(opts: RunOptions, cfg: SweepConfig, log: Callable[[str], None] = print) -> Iterator[Running]:
    """The models prepared, the server up, pinned and warmed up, and this process pinned to
    the client cores; with `opts.server`, the server given instead (`attached`)."""
    if opts.server is not None:
        with attached(opts, cfg, log) as running:
            yield running
        return
    # Here: a load generator for a server it did not start needs neither torch nor transformers.
    from loadtest.models import choose_models
    from specsplit.server.loading import resolve_dtype

    with tempfile.TemporaryDirectory(prefix="loadtest-") as tmp:
        log("preparing models ...")
        models = choose_models(Path(tmp), opts.target, opts.target_config, opts.draft, "onnx" in cfg.modes)
        prompts = _prompts(models.target_dir, opts.prompt_set)
        metrics_port = free_port()
        # The session and idle-stream limits are not under test: room for the largest point, with margin.
        room = str(2 * cfg.most())
        server_log = opts.server_log or Path(tmp) / "server.log"
        server_args = ("--max-sessions", room, "--max-idle-streams", room, "--device", opts.device,
                       *models.server_args, *opts.server_args)
        log(f"starting the server (cores {list(opts.server_cores) or 'any'}): it loads the target, warms up and, "
            f"on a GPU, captures its graphs, minutes for a large one; its log: {server_log} ...")
        serve_args = ["--metrics-port", str(metrics_port), *server_args]
        setup = {
            "machine": machine_info(opts.device),
            "pinning": {"server_cores": list(opts.server_cores), "server_threads": opts.server_threads,
                        **_client_pinning(opts)},
            "models": models.describe(resolve_dtype(opts.dtype, opts.device), opts.device),
            "network": "loopback, no added delay",
            "server_args": ["--dtype", opts.dtype, "--threads", str(opts.server_threads), *server_args],
        }
        try:
            with running_server(str(models.target_dir), opts.server_cores, serve_args, server_log,
                                dtype=opts.dtype, threads=opts.server_threads) as (address, proc):
                with pinned(opts.client_cores):  # only now: the server's pinning is worked out from our cores
                    handle = ServerHandle(ServerEndpoint(address), proc.pid,
                                          f"http://127.0.0.1:{metrics_port}/metrics")
                    log("serving; a warm-up generation ...")
                    with _serving(handle.endpoint, "the warm-up generation"):
                        opened = warm_up(handle.endpoint, prompts)
                    yield Running(handle, prompts, opened, models.draft_dir, setup, server_log)
        except BaseException:
            _log_tail(server_log, log)
            raise


def _prompts(tokenizer_dir: Path, prompt_set: str) -> PromptSet:
    try:
        return load_prompts(tokenizer_dir, prompt_set)
    except (OSError, ValueError) as exc:  # no tokenizer there, or no chat template for the benchmark's
        raise SetupError(str(exc)) from None


@contextmanager
def _serving(endpoint: ServerEndpoint, what: str) -> Iterator[None]:
    """SetupError, in one line, where the server fails `what` (a lost server, a refusal)."""
    try:
        yield
    except GENERATION_FAILURES as exc:
        raise SetupError(f"the server at {endpoint.address} failed {what}: {describe(exc)}") from None


def _check_metrics(url: str) -> None:
    try:
        snap = scrape(url)
    except UNREADABLE as exc:
        raise SetupError(f"the server's metrics at {url} cannot be read ({exc!r})") from None
    if not any(name.startswith("specsplit_") for name, _ in snap):
        raise SetupError(f"{url} has no specsplit metrics: give the address of the server's --metrics-port")


@contextmanager
def attached(opts: RunOptions, cfg: SweepConfig, log: Callable[[str], None] = print) -> Iterator[Running]:
    """A server this load test did not start (`opts.server`), checked and warmed up, with
    the prompts encoded by the draft's tokenizer. Raises SetupError where it cannot be used."""
    endpoint, draft = opts.server, opts.draft
    assert endpoint is not None and draft is not None, "a given server needs a draft export for its tokenizer"
    prompts = _prompts(draft, opts.prompt_set)
    if opts.metrics_url:
        _check_metrics(opts.metrics_url)
    log(f"warming up the server at {endpoint.address} ...")
    with pinned(opts.client_cores):
        with _serving(endpoint, "the warm-up generation"):
            opened = warm_up(endpoint, prompts)
        # The draft drafts only for onnx edges; otherwise it only lends the prompts its tokenizer.
        name = draft.resolve().name
        setup = {
            "machine": machine_info("remote"),
            "pinning": {"server": "not started by the load test", **_client_pinning(opts)},
            "models": {"target": {"name": opened.target_model, "vocab_size": opened.vocab_size},
                       **({"draft": describe_draft(draft, name)} if "onnx" in cfg.modes else {"tokenizer": name})},
            "network": "the site's own, between the load generator and the server (not emulated or measured)",
            "server": {"connection": endpoint.describe(), "metrics": "read" if opts.metrics_url else "not read"},
        }
        yield Running(ServerHandle(endpoint, None, opts.metrics_url), prompts, opened, draft, setup)


def sweep_and_report(running: Running, opts: RunOptions, cfg: SweepConfig, settings: LoadSettings,
                     log: Callable[[str], None] = print) -> dict:
    """Take the reference continuations, sweep; the report (see report.build_report)."""
    workers = ClientWorkers(opts.client_procs, opts.client_cores) if opts.client_procs > 1 else None
    prompts, endpoint = running.prompts, running.server.endpoint
    try:
        log(f"decoding the target's reference continuations of {len(prompts.ids)} prompts ...")
        with _serving(endpoint, "the reference decoding"):
            references = reference_continuations(endpoint, prompts, settings.max_new_tokens, log)
        spec = LoadSpec(endpoint, prompts.ids, references, prompts.fingerprint, running.opened.vocab_size, settings,
                        str(running.draft_dir) if running.draft_dir else None)
        results, stop = sweep(running.server, spec, cfg, workers, log)
    finally:
        if workers is not None:
            workers.close()
    setup = {**running.setup, "prompt_set": opts.prompt_set, "prompts": list(prompts.texts), "rerun": opts.rerun}
    return build_report(setup, cfg, settings, results, stop)


def execute(opts: RunOptions, cfg: SweepConfig, settings: LoadSettings, deliver: Callable[[dict], None],
            log: Callable[[str], None] = print) -> dict:
    """A whole run: start (or attach), sweep, stop; the report, also handed to `deliver` before
    the server stops: that takes a while (its drain), and a second Ctrl-C or a SIGTERM then
    would otherwise lose every point."""
    with started(opts, cfg, log) as running:
        report = sweep_and_report(running, opts, cfg, settings, log)
        deliver(report)
        if report["stopped"] not in (None, INTERRUPTED) and running.server_log is not None:
            # A point that failed may be the server's doing; without --server-log its log goes with the run.
            _log_tail(running.server_log, log)
        return report


def _log_tail(server_log: Path, log: Callable[[str], None]) -> None:
    if server_log.is_file():
        log(f"server log, last lines:\n{server_log.read_text()[-LOG_TAIL:]}")
