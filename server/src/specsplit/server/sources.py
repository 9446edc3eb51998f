"""Where a model comes from: a local path or a hub id, by one rule for every command."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

# A hub id ("org/name") starts with a letter or a digit, so a source starting with one of
# these, or naming a .gguf file, can only be meant as a path.
_PATH_PREFIXES = ("/", ".", "~")


def local_source(source: str, what: str) -> str:
    """`source` with a leading ~ expanded.

    Raises FileNotFoundError where it is written as a path, or as a bare name, and nothing is
    there: it is no hub id either (the hub's own bare names, such as gpt2, have ORG/NAME
    ids too), and finding that out only after loading or pulling another model first
    costs minutes (a 1.6 GB download for `models prepare`)."""
    path = Path(source).expanduser()
    if not path.exists() and (source.startswith(_PATH_PREFIXES) or source.endswith(".gguf")):
        raise FileNotFoundError(f"{what} {source} does not exist")
    if not path.exists() and "/" not in source:  # a mistyped directory name, which the hub would retry for a minute
        raise FileNotFoundError(f"{what} {source} does not exist here, and a hub id is written ORG/NAME")
    # More than ORG/NAME, or an ORG that is a directory here: a mistyped path, not a hub id.
    if not path.exists() and (source.count("/") > 1 or Path(source.split("/")[0]).is_dir()):
        raise FileNotFoundError(f"{what} {source} does not exist (a path, as its first part "
                                f"{'is a directory here' if source.count('/') == 1 else 'is followed by more'})")
    return str(path) if source.startswith("~") else source


def served_name(source: str) -> str:
    """The name edges are told the target by, where the operator gives none: a hub id as it
    is (public already), a local directory or file by its own name only, so that no edge
    learns where the server keeps its models."""
    path = Path(source).expanduser()
    if path.exists() or source.startswith(_PATH_PREFIXES):
        # abspath, not resolve: a link (a hub cache's snapshot file, say) keeps its own name.
        return Path(os.path.abspath(path)).name or source  # "/" has no name: say what was given
    return source


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file, read a block at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()
