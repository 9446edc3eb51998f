"""What a load-test report says of a draft export (light: a load generator for a server it
did not start needs no torch)."""
from __future__ import annotations

from pathlib import Path

from specsplit.common.export_meta import DraftExportMeta


def describe_draft(draft_dir: Path, name: str) -> dict:
    """The onnx edges' draft, as the report names it."""
    meta = DraftExportMeta.load(draft_dir)
    return {"name": name, "num_layers": meta.num_layers, "vocab_size": meta.vocab_size, "quantization": meta.weights}
