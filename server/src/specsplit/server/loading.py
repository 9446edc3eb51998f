"""Load a causal LM and its tokenizer from a Hugging Face directory, a GGUF file or a hub id."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specsplit.common.fingerprint import vocab_fingerprint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto`: bf16 on GPUs, fp32 on CPUs.

    Not bf16 on a CPU, even one with native bf16 (AVX512-BF16, AMX), where its multi-token
    passes are cheaper: there a row's logits depend on how many tokens its pass fed, by up
    to a quarter of a logit, so greedy verification drifts from what the target alone
    produces one token at a time (6 of 12 benchmark prompts differed in some mode within 64 tokens). fp32
    rows differ by about 3e-5 and no output did. `--dtype bf16` remains, for speed over
    exactness."""
    if dtype != "auto":
        return dtype
    return "bf16" if device != "cpu" else "fp32"


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user pointed at, for messages and metadata

    @property
    def fingerprint(self) -> str:
        return vocab_fingerprint(self.tokenizer.get_vocab())

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        return tuple(sorted(ids))


def _split_gguf(path: str) -> tuple[str, dict]:
    """transformers takes a GGUF as (directory, gguf_file=name)."""
    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file {p} does not exist")
        return str(p.parent), {"gguf_file": p.name}
    if not p.exists() and path.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"{p} does not exist")  # not a hub id either
    if p.exists() and not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is neither a GGUF file nor a Hugging Face model directory (no config.json)")
    return path, {}


LOAD_FORMATS = ("auto", "dummy", "dummy-echo")


def make_echo(model: PreTrainedModel) -> None:
    """Zero every layer's output projections (attention and MLP) and give the output head
    the input embeddings: each layer still computes all it did, but adds nothing, so the
    model predicts its last input token with a wide margin. Its greedy output is then
    known in advance and the same in any batch, in any precision: what a load test needs
    from random weights, whose near-tied logits flip under bf16 batching."""
    for name, module in model.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            module.weight.data.zero_()
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is not embed.weight:
        head.weight.data.copy_(embed.weight.data)


def load_model(path: str, dtype: str = "fp32", device: str = "cpu", attn: str | None = None,
               load_format: str = "auto") -> LoadedModel:
    """`path`: a HF directory, a .gguf file (dequantized by transformers) or a hub id.

    `load_format` dummy: only the directory's config.json and tokenizer are read and the
    weights are random, built on the device itself (a 7B model in seconds, without its
    15 GB of files); dummy-echo: the same, made to echo its input (`make_echo`)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format must be one of {LOAD_FORMATS}, got {load_format!r}")
    dummy = load_format != "auto"
    dtype = resolve_dtype(dtype, device)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    source, extra = _split_gguf(path)
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    if attn:
        extra["attn_implementation"] = attn
    if dummy:
        config = AutoConfig.from_pretrained(source, **extra)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
        if load_format == "dummy-echo":
            make_echo(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype], **extra)
    model.to(device).eval()
    return LoadedModel(model, tokenizer, path)


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def source_sha256(path: str) -> str:
    """sha256 of a GGUF file or of a directory's weight files (empty for a hub id)."""
    p = Path(path)
    if p.is_file():
        return file_sha256(p)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")):
            h.update(file_sha256(f).encode())
        return h.hexdigest()
    return ""
