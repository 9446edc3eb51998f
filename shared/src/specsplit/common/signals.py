"""SIGTERM as an exception, for programs that must clean up on the way out."""
from __future__ import annotations


def exit_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler: SystemExit, so that `finally` blocks and context managers run (a
    plain `kill`, a job's timeout and systemd send SIGTERM, which Python does not turn into
    an exception by itself). A signal that lands on another thread of the process is handled
    once the main thread is back in Python."""
    raise SystemExit(128 + signum)  # the status a shell reports for a program ended by it
