"""`--help` says what every option does and what it is when not given."""
from __future__ import annotations

import argparse

import pytest

from specsplit.edge import cli as edge_cli
from specsplit.server import cli as server_cli


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for tool, parser in (("specsplit-server", server_cli.build_parser()), ("specsplit-edge", edge_cli.build_parser())):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        found += [(f"{tool} {name}", command) for name, command in sub.choices.items()]
    return found


@pytest.mark.parametrize("name, command", _commands(), ids=[n for n, _ in _commands()])
def test_every_option_says_what_it_does_and_its_default(name: str, command: argparse.ArgumentParser) -> None:
    text = " ".join(command.format_help().split())  # the help's own line wrapping undone
    for action in command._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name} {action.option_strings[0]}: no help"
        default = action.default
        if default is None or default is False or default is argparse.SUPPRESS or default == []:
            continue  # nothing to show (help_format.DefaultsHelpFormatter shows none either)
        if "default" in action.help:
            continue  # the help says it in its own words
        assert f"(default: {default})" in text, f"{name} {action.option_strings[0]}: its default {default!r} is not shown"
