"""A benchmark's result as its two files: the JSON and the Markdown table beside it."""
from __future__ import annotations

import json
from pathlib import Path


def save_report(out_dir: Path, name: str, report: dict, markdown: str) -> None:
    """Write NAME.json and NAME.md in `out_dir` (made where missing), and print the Markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # Suffixes added, not swapped: a NAME such as host-cost-1.5b keeps its whole name.
    write_whole(out_dir / f"{name}.json", json.dumps(report, indent=1) + "\n")
    write_whole(out_dir / f"{name}.md", markdown)
    print(markdown)


def write_whole(path: Path, text: str) -> None:
    """Write `path` through a file beside it: a stop mid-write leaves the previous one whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
