"""Command-line help that shows each option's default, and the version `--version` gives."""
from __future__ import annotations

import argparse
from importlib import metadata


def installed_version(distribution: str) -> str:
    """The installed version of `distribution`; run from a source tree (PYTHONPATH) there is none."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(not installed: run from source)"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends an option's default to its help, unless the help already speaks of its
    default or there is none to show (no default, or a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text or default is None or default is False
                or default is argparse.SUPPRESS or default == []):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"
