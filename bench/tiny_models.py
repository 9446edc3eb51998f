"""Tiny random-weight qwen2-architecture models and a small byte-level BPE tokenizer.

The tests and the soak build these themselves (a few MB, seconds): a target, a
different draft, and the same weights as the target for a draft whose every token is
accepted.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROBE_PROMPT = "def add(a, b):"
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "Hello, how are you today? I am fine, thank you.",
]


def build_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(seed: int, layers: int = 2, vocab_size: int = 320, eos_id: int | None = None) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,  # wide logits: greedy choices are far from ties
        tie_word_embeddings=False,
        eos_token_id=eos_id,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    return model


def save(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> Path:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@dataclass
class TinyModels:
    target_dir: Path
    draft_dir: Path  # ONNX export of a different model
    same_dir: Path  # ONNX export of the target itself: every draft is accepted
    eos_id: int


def build_tiny_pair(root: Path) -> TinyModels:
    """Target (HF directory) and drafts (through the real ONNX exporter) under `root`."""
    from specsplit.server.export import export_draft

    tok = build_tokenizer()
    probe = build_model(0)
    ids = torch.tensor([tok(PROBE_PROMPT)["input_ids"]])
    with torch.no_grad():
        cont = probe.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
    # An eos the target really produces: the first token that has not appeared before, past a few steps.
    eos = next(t for i, t in enumerate(cont) if i >= 5 and t not in cont[:i])
    target = save(build_model(0, eos_id=eos), tok, root / "target")
    draft_hf = save(build_model(1, layers=1, eos_id=eos), tok, root / "draft-hf")
    draft = root / "draft"
    export_draft(str(draft_hf), draft)
    same = root / "same"
    export_draft(str(target), same)
    return TinyModels(target, draft, same, eos)
