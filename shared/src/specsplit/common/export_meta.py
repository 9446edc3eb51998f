"""The metadata file an ONNX draft export carries (written by the server package,
read by the edge)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

META_FILE = "specsplit.json"
MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class DraftExportMeta:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    tokenizer_fingerprint: str
    source_model: str
    source_sha256: str = ""
    quantization: str = "none"  # "none", "int8" or "int4"
    max_abs_logit_diff: float = 0.0  # ONNX Runtime vs torch, fp32 graph
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    @property
    def weights(self) -> str:
        """How the weights are stored, for reports: `fp32`, `int8 per-channel`, `int4 blocks of 32, ...`."""
        if self.quantization == "none":
            return "fp32"
        scheme = self.extra.get(f"{self.quantization}_scheme")
        return f"{self.quantization} {scheme}" if scheme else self.quantization

    def save(self, directory: Path) -> None:
        (directory / META_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> DraftExportMeta:
        path = directory / META_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{directory} is not a specsplit draft export (no {META_FILE})")
        data = json.loads(path.read_text())
        data["eos_ids"] = tuple(data["eos_ids"])
        return cls(**data)
