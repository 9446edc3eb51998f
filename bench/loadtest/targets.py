"""Target directories the load test serves: Qwen2.5-sized configs for random-weight
serving, and the tiny test target with its eos removed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from loadtest.shapes import ARCHS
from tiny_models import build_tokenizer
from transformers import Qwen2Config

CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "eos_token_id")


def write_config_target(out_dir: Path, arch: str) -> Path:
    """A target directory holding only a config.json of `arch` and the tiny tokenizer.

    No eos id: random weights would otherwise end generations at an arbitrary point,
    and the load test wants every generation to run to max_new_tokens."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(**ARCHS[arch], eos_token_id=None, bos_token_id=None, pad_token_id=None)
    config.architectures = ["Qwen2ForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


def without_eos(src: Path, out_dir: Path) -> Path:
    """A copy of a (small) target directory whose configs name no eos id, so that every
    generation runs to max_new_tokens: the tiny target otherwise stops after 6 to 34
    tokens, and short generations measure session set-up more than decoding."""
    shutil.copytree(src, out_dir, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = out_dir / name
        if path.is_file():
            config = json.loads(path.read_text())
            config.update(eos_token_id=None, pad_token_id=None)
            path.write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def describe_target(target_dir: Path) -> dict:
    """The config values a report names the target by."""
    config = json.loads((target_dir / "config.json").read_text())
    return {key: config.get(key) for key in CONFIG_KEYS}
