"""The metadata file an ONNX draft export carries (written by the server package,
read by the edge)."""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from specsplit.common.values import real, whole

META_FILE = "specsplit.json"
MODEL_FILE = "model.onnx"
# The graph's inputs and outputs beside the caches: what the exporter names and the drafter feeds.
INPUTS = ("input_ids", "attention_mask", "position_ids")
LOGITS = "logits"
# Inputs per block of an int4 export's matrices: what ONNX Runtime's MatMulNBits takes, and the default.
INT4_BLOCK_SIZES = (16, 32, 64, 128, 256)
INT4_BLOCK_SIZE = 32


def past_names(layers: int) -> list[str]:
    """The cache inputs, a key and a value per layer, in the graph's order."""
    return [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def present_names(layers: int) -> list[str]:
    """The cache outputs, in the same order."""
    return [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


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
        """Raises FileNotFoundError where the directory has no metadata file, ValueError
        (naming the file) where it cannot be read as one: a damaged or hand-edited export,
        or one written by a newer version with fields this one does not know."""
        path = directory / META_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{directory} is not a specsplit draft export (no {META_FILE})")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}): export the draft again") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds no metadata object: export the draft again")
        known = {f.name for f in fields(cls)}
        needed = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        if unknown := sorted(data.keys() - known):
            raise ValueError(f"{path} has fields this version does not know ({', '.join(unknown)}): "
                             "it was exported by a newer specsplit; install that version here too")
        if missing := sorted(needed - data.keys()):
            raise ValueError(f"{path} lacks {', '.join(missing)}: export the draft again")
        if problem := _wrong_type(data):
            raise ValueError(f"{path}: {problem}: export the draft again")
        data["eos_ids"] = tuple(data["eos_ids"])
        return cls(**data)


def _wrong_type(data: dict) -> str | None:
    """What in a metadata object has the wrong type, found here: a hand-edited file would
    otherwise fail later, deep in loading or in the first drafting step."""
    for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size"):
        if not whole(data[name]) or data[name] < 1:
            return f"{name} must be a whole number of at least 1, got {data[name]!r}"
    if not isinstance(data["eos_ids"], list) or not all(whole(t) and t >= 0 for t in data["eos_ids"]):
        return f"eos_ids must be a list of token ids, got {data['eos_ids']!r}"
    for name in ("tokenizer_fingerprint", "source_model", "source_sha256", "quantization", "dtype"):
        if name in data and not isinstance(data[name], str):
            return f"{name} must be a string, got {data[name]!r}"
    if "max_abs_logit_diff" in data and not real(data["max_abs_logit_diff"]):
        return f"max_abs_logit_diff must be a number, got {data['max_abs_logit_diff']!r}"
    if "extra" in data and not isinstance(data["extra"], dict):
        return f"extra must be an object, got {data['extra']!r}"
    return None
