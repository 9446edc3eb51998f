"""Extra `specsplit-server serve` arguments a benchmark passes on, checked before anything runs.

A benchmark starts the server only after it has prepared models (and run its anchors): a typo
found then costs minutes. And some options are the benchmark's own, described in its report
from its own settings: given again, the report would describe another server.
"""
from __future__ import annotations

import contextlib
import io

from specsplit.server.cli import build_parser


def serve_args_problem(server_args: list[str], own: tuple[str, ...]) -> str | None:
    """What serve's command line refuses in `server_args`, or the first of the `own` options
    they set (abbreviated too, as argparse takes them); None if nothing."""
    if any(a in ("-h", "--help") for a in server_args):
        return "--help prints serve's help instead of serving"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            given = build_parser().parse_args(["serve", "--target", "t", *server_args])
    except SystemExit:
        said = err.getvalue().strip().splitlines()
        return said[-1].split("error: ", 1)[-1] if said else "serve refuses them"
    defaults = build_parser().parse_args(["serve", "--target", "t"])
    for flag in own:
        dest = flag.removeprefix("--").replace("-", "_")
        if getattr(given, dest) != getattr(defaults, dest):
            return f"{flag} is the benchmark's to set"
    return None
