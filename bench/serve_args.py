"""Extra `specsplit-server serve` arguments a benchmark passes on, checked before anything runs.

A benchmark starts the server only after it has prepared models (and run its anchors): a typo
found then costs minutes. And some options are the benchmark's own, described in its report
from its own settings: given again, the report would describe another server.
"""
from __future__ import annotations

import argparse
import contextlib
import io

from specsplit.server.cli import build_parser
from specsplit.server.serve_checks import engine_setting_problem

UNSET = object()
PLACEHOLDER_TARGET = "\0the benchmark's target"  # compared by identity: a --target given is another str


def serve_args_problem(server_args: list[str], own: tuple[str, ...], device: str = "cpu") -> str | None:
    """What serve's command line refuses in `server_args`, or the first of the `own` options
    they give (abbreviated too, as argparse takes them; at serve's default value too: they come
    after the benchmark's own and would win), or an engine's own setting given with the other
    engine on `device` (serve refuses it only once started, after the benchmark's models and
    anchors); None if nothing."""
    if any(a in ("-h", "--help") for a in server_args):
        return "--help prints serve's help instead of serving"
    # Each own option starts as UNSET, which argparse keeps unless the option is given; --target,
    # which serve requires, is given here first, so that one in `server_args` replaces it.
    given = argparse.Namespace(**{_dest(flag): UNSET for flag in own if flag != "--target"})
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _serve_parser().parse_args(["--target", PLACEHOLDER_TARGET, *server_args], namespace=given)
    except SystemExit as exit_:
        if exit_.code == 0:  # an abbreviated --help
            return "--help prints serve's help instead of serving"
        said = err.getvalue().strip().splitlines()
        return said[-1].split("error: ", 1)[-1] if said else "serve refuses them"
    for flag in own:
        if getattr(given, _dest(flag)) is not (PLACEHOLDER_TARGET if flag == "--target" else UNSET):
            return f"{flag} is the benchmark's to set"
    settings = serve_settings(server_args)
    settings.device = device
    return engine_setting_problem(settings)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def serve_settings(server_args: list[str]) -> argparse.Namespace:
    """The settings serve takes with `server_args` (checked by serve_args_problem first): those
    given, and serve's defaults."""
    return _serve_parser().parse_args(["--target", PLACEHOLDER_TARGET, *server_args])


def _serve_parser() -> argparse.ArgumentParser:
    # serve's own parser: the top level's copies a subcommand's defaults over the namespace.
    return build_parser().parse_args(["serve", "--target", PLACEHOLDER_TARGET]).command_parser
