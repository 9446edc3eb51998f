"""A report's rerun line: the command that made it, with local paths replaced by placeholders."""
from __future__ import annotations

import shlex
from collections.abc import Collection, Mapping, Sequence


def rerun_command(script: str, argv: Sequence[str], placeholders: Mapping[str, str],
                  keep: Collection[str] = ()) -> str:
    """`python SCRIPT ARGV...`, each value of an option in `placeholders` (as `--opt VALUE` or
    `--opt=VALUE`) replaced by its placeholder, except values in `keep` (words, not paths)."""
    out = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if eq and name in placeholders and value not in keep:
            arg = f"{name}={placeholders[name]}"
        elif i > 0 and argv[i - 1] in placeholders and arg not in keep:
            arg = placeholders[argv[i - 1]]
        out.append(arg)
    return shlex.join(["python", script, *out])
