"""A whole load test: models, the pinned server, warm-up, reference continuations,
the sweep, and the report describing all of it."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadtest.machine import machine_info
from loadtest.models import Models, choose_models
from loadtest.point import ServerHandle
from loadtest.prompts import PromptSet, load_prompts
from loadtest.report import build_report
from loadtest.sessions import LoadSettings, LoadSpec
from loadtest.sweep import SweepConfig, reference_continuations, sweep, warm_up
from loadtest.targets import vocab_size
from loadtest.workers import ClientWorkers
from orchestrate import free_port, running_server
from specsplit.server.loading import resolve_dtype

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
    models: Models
    prompts: PromptSet
    server_args: tuple[str, ...]  # given to `serve` besides the port, metrics port, dtype and threads


@contextmanager
def started(opts: RunOptions, cfg: SweepConfig, log: Callable[[str], None] = print) -> Iterator[Running]:
    """The models prepared, the server up and pinned, and this process pinned to the client cores."""
    with tempfile.TemporaryDirectory(prefix="loadtest-") as tmp:
        log("preparing models ...")
        models = choose_models(Path(tmp), opts.target, opts.target_config, opts.draft, "onnx" in cfg.modes)
        prompts = load_prompts(models.target_dir, opts.prompt_set)
        metrics_port = free_port()
        # The session and idle-stream limits are not under test: room for the largest point, with margin.
        room = str(2 * cfg.most())
        server_args = ("--max-sessions", room, "--max-idle-streams", room, "--device", opts.device,
                       *models.server_args, *opts.server_args)
        log(f"starting the server (cores {list(opts.server_cores) or 'any'}) ...")
        serve_args = ["--metrics-port", str(metrics_port), *server_args]
        server_log = opts.server_log or Path(tmp) / "server.log"
        try:
            with running_server(str(models.target_dir), opts.server_cores, serve_args, server_log,
                                dtype=opts.dtype, threads=opts.server_threads) as (address, proc):
                with pinned(opts.client_cores):  # only now: the server's pinning is worked out from our cores
                    yield Running(ServerHandle(address, proc.pid, f"http://127.0.0.1:{metrics_port}/metrics"),
                                  models, prompts, server_args)
        except BaseException:
            if server_log.is_file():
                log(f"server log, last lines:\n{server_log.read_text()[-LOG_TAIL:]}")
            raise


def sweep_and_report(running: Running, opts: RunOptions, cfg: SweepConfig, settings: LoadSettings,
                     log: Callable[[str], None] = print) -> dict:
    """Warm up, take the reference continuations, sweep; the report (see report.build_report)."""
    workers = ClientWorkers(opts.client_procs, opts.client_cores) if opts.client_procs > 1 else None
    address, models, prompts = running.server.address, running.models, running.prompts
    try:
        warm_up(address, prompts)
        references = reference_continuations(address, prompts, settings.max_new_tokens)
        spec = LoadSpec(address, prompts.ids, references, prompts.fingerprint, vocab_size(models.target_dir),
                        settings, str(models.draft_dir) if models.draft_dir else None)
        results = sweep(running.server, spec, cfg, workers, log)
    finally:
        if workers is not None:
            workers.close()
    setup = {
        "machine": machine_info(opts.device),
        "pinning": {"server_cores": list(opts.server_cores), "server_threads": opts.server_threads,
                    "client_cores": list(opts.client_cores), "client_procs": opts.client_procs},
        "models": models.describe(resolve_dtype(opts.dtype, opts.device), opts.device),
        "server_args": ["--dtype", opts.dtype, "--threads", str(opts.server_threads), *running.server_args],
        "prompt_set": opts.prompt_set,
        "prompts": list(prompts.texts),
        "rerun": opts.rerun,
    }
    return build_report(setup, cfg, settings, results)


def execute(opts: RunOptions, cfg: SweepConfig, settings: LoadSettings, log: Callable[[str], None] = print) -> dict:
    """A whole run: start, sweep, stop; the report."""
    with started(opts, cfg, log) as running:
        return sweep_and_report(running, opts, cfg, settings, log)
