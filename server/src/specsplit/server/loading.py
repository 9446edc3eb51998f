"""Load a causal LM and its tokenizer from a Hugging Face directory, a GGUF file or a hub id."""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specsplit.common.fingerprint import vocab_fingerprint
from specsplit.server.row_invariant import make_rows_invariant
from specsplit.server.sources import file_sha256, local_source

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are only fast on CPUs with native bf16 (AVX512-BF16 or AMX); elsewhere
    they fall back to a kernel whose cost grows linearly with the number of tokens, which
    defeats verifying many drafts in one pass. (Read once: the flags do not change.)"""
    try:
        return native_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def native_bf16(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's text lists a native bf16 flag (AVX512-BF16, or AMX's)."""
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.partition(":")[2].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto`: bf16 on GPUs and on CPUs with native bf16, else fp32.

    On such a CPU a bf16 pass over 8 tokens costs little more than one over 1 token, where
    an fp32 one costs nearly twice as much; a model on CPU, in either, is loaded so that its
    rows do not depend on the pass's size (`row_invariant`), which keeps greedy verification
    exact."""
    if dtype != "auto":
        return dtype
    return "bf16" if device != "cpu" or cpu_has_fast_bf16() else "fp32"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """What the edge's tokenizer must match; transformers' vocabulary holds the added tokens."""
    return vocab_fingerprint(tokenizer.get_vocab())


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # what the user pointed at, for messages and metadata

    @property
    def fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)

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
    path = local_source(path, "model")
    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{p} is not a GGUF file")
        return str(p.parent), {"gguf_file": p.name}
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


class MissingWeights(ValueError):
    """A checkpoint that lacks some of its model's weights, which would be left random."""


class UnreadableModel(ValueError):
    """Files transformers cannot read as a model (a .gguf that is none, a broken config)."""


def load_config(path: str) -> PretrainedConfig:
    """The model's config alone (no weights): what start-up checks read before minutes of loading.
    Raises as load_model does for a path that is not there or cannot be read."""
    source, extra = _split_gguf(path)
    try:
        return AutoConfig.from_pretrained(source, **extra)
    except OSError:
        raise
    except Exception as exc:
        raise UnreadableModel(f"{path}: transformers cannot read its config ({type(exc).__name__}: {exc})") from exc


def load_model(path: str, dtype: str = "fp32", device: str = "cpu", attn: str | None = None,
               load_format: str = "auto", rows_invariant: bool = True,
               onnxruntime_linears: bool = False) -> LoadedModel:
    """`path`: a HF directory, a .gguf file (dequantized by transformers) or a hub id.

    `load_format` dummy: only the directory's config.json and tokenizer are read and the
    weights are random, built on the device itself (a 7B model in seconds, without its
    15 GB of files); dummy-echo: the same, made to echo its input (`make_echo`).

    bf16 and fp32 on CPU are made row-invariant (`row_invariant`), whatever `attn` asks for:
    without that, a row's logits would depend on what else its pass holds, and greedy
    verification there would not be exact. `onnxruntime_linears`: large fp32 layers may take
    ONNX Runtime's GEMM there (`cpu_linear`), where its probe finds it row-invariant.
    `rows_invariant=False` leaves the model as loaded, for one that is to be saved (the
    row-invariant wrappers rename every linear layer's weights) or compiled.

    Raises MissingWeights where the checkpoint lacks weights the model has: transformers
    would start them at random and warn, and the model would serve noise; UnreadableModel
    where transformers cannot make a model of the files (or of `attn`)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format must be one of {LOAD_FORMATS}, got {load_format!r}")
    dummy = load_format != "auto"
    dtype = resolve_dtype(dtype, device)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    source, extra = _split_gguf(path)
    try:  # transformers says ValueError for files it cannot make a model of
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
            model, info = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype], output_loading_info=True,
                                                               **extra)
    except OSError:
        raise  # no such path, or a hub id that cannot be fetched: the callers say so as it is
    # ValueError mostly; but a truncated weight file (safetensors' own error, torch's for a
    # .bin) or a config field of the wrong type (huggingface_hub's validation) raise others.
    except Exception as exc:
        raise UnreadableModel(f"{path}: transformers cannot read it as a model "
                              f"({type(exc).__name__}: {exc})") from exc
    if not dummy and info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise MissingWeights(f"{path}: the checkpoint lacks {len(missing)} of the model's weights "
                             f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); they would "
                             "be random. A directory made by an older `models prepare` is made again by "
                             "running it; otherwise point at the complete checkpoint")
    model.to(device).eval()
    if rows_invariant and device == "cpu" and dtype in ("bf16", "fp32"):
        make_rows_invariant(model, onnxruntime_linears)
    return LoadedModel(model, tokenizer, path)


# What of a Hugging Face directory makes the model: its weights, and the config and tokenizer
# files beside them (an edited tokenizer must not leave an export made with the old one in use).
SOURCE_FILES = ("*.safetensors", "*.bin", "*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")


def source_sha256(path: str) -> str:
    """sha256 of a GGUF file or of a directory's model files (empty for a hub id)."""
    p = Path(path).expanduser()  # as loading reads it: "--model=~/x.gguf" reaches us unexpanded
    if p.is_file():
        return file_sha256(p)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted({f for pattern in SOURCE_FILES for f in p.glob(pattern) if f.is_file()}):
            h.update(f"{f.name}\0{file_sha256(f)}\n".encode())
        return h.hexdigest()
    return ""
