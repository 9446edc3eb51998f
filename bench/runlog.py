"""A benchmark's results, saved after every run so that a long sweep can be stopped and resumed.

The full sweep takes hours on a small machine. Its JSON and Markdown are rewritten after each
measured run, as NAME.partial.json (and .md) until the last one, so a stopped sweep loses at most
the run in progress and `--resume` measures only what is missing; the result of an earlier
sweep under NAME (a committed one, say) stays as it was until the new one is complete. Every (prompt, RTT) group of modes still
runs side by side in one server's lifetime, so per-prompt ratios stay like for like; each
invocation's machine and wall time are recorded.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from report_files import write_whole

RunKey = tuple[str, float | None, str]  # (mode, rtt_ms or None for network-free modes, prompt id)


class SettingsMismatch(ValueError):
    """--resume asked for a result measured under other settings."""


def run_key(run: dict) -> RunKey:
    return run["mode"], run["rtt_ms"], run["prompt"]


MACHINE_KEYS = ("cpu", "cores", "machine", "native_bf16")


class RunLog:
    """The runs measured so far and the settings they were measured under."""

    def __init__(self, path: Path, header: dict, render: Callable[[dict], str], summarize: Callable[[list], list],
                 resume: bool) -> None:
        self.final, self.render, self.summarize = path, render, summarize
        self.path = partial_path(path)  # where the result is now: the final path once complete
        self.started = time.time()
        self.result = {**header, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.started)),
                       "complete": False, "invocations": [], "runs": []}
        if resume and self.path.is_file():  # a stopped sweep's, before a complete one's
            path = self.path
        if resume and path.is_file():
            try:
                previous = json.loads(path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError):
                previous = None
            if not isinstance(previous, dict) or not isinstance(previous.get("runs"), list):
                raise SettingsMismatch(f"{path} is not a benchmark result to resume: rerun without --resume")
            # Pinning too: runs pinned and not would stand under the last invocation's line.
            for field in ("settings", "network", "models", "pinning"):
                if previous.get(field) != header.get(field):
                    raise SettingsMismatch(
                        f"{path} was measured with other {field} ({previous.get(field)!r}, now {header.get(field)!r}):"
                        " rerun without --resume, or with the same options")
            # The machine too (its hardware, not its Python): runs measured on two machines
            # would stand under one machine's line.
            was, now = ({k: m.get(k) for k in MACHINE_KEYS} for m in (previous.get("machine") or {}, header["machine"]))
            if was != now:
                raise SettingsMismatch(f"{path} was measured on another machine ({was!r}, this one {now!r}): "
                                       "give this run a --name of its own")
            self.result.update(date=previous["date"], invocations=previous.get("invocations", []),
                               runs=previous["runs"])
        self.result["invocations"].append({"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.started)),
                                           "machine": header.get("machine"), "wall_s": 0.0})
        self.done = {run_key(r) for r in self.result["runs"]}

    def missing(self, keys: list[RunKey]) -> list[RunKey]:
        return [k for k in keys if k not in self.done]

    def add(self, run: dict) -> None:
        """Record a run; one measured again replaces the earlier measurement."""
        self.result["runs"] = [r for r in self.result["runs"] if run_key(r) != run_key(run)] + [run]
        self.done.add(run_key(run))
        self.save()

    def save(self, complete: bool = False) -> None:
        self.result["invocations"][-1]["wall_s"] = time.time() - self.started
        self.result["wall_s"] = sum(i["wall_s"] for i in self.result["invocations"])
        self.result["complete"] = complete
        self.result["summary"] = self.summarize(self.result["runs"])
        partial, self.path = self.path, self.final if complete else self.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(self.path, json.dumps(self.result, indent=1) + "\n")
        write_whole(self.path.with_suffix(".md"), self.render(self.result))
        if complete and partial != self.path:
            partial.unlink(missing_ok=True)
            partial.with_suffix(".md").unlink(missing_ok=True)


def partial_path(path: Path) -> Path:
    """Where a result named by `path` (NAME.json) is kept until it is complete."""
    return path.with_name(f"{path.stem}.partial.json")
