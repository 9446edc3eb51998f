"""The Qwen2.5 shapes a load test can serve with random weights (`--target-config`); data only,
so that the command line needs neither torch nor transformers."""
from __future__ import annotations

# The published Qwen2.5 1.5B and 7B shapes; the weights are random (served with --load-format dummy-echo).
_COMMON = {"num_hidden_layers": 28, "rope_theta": 1e6, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}
ARCHS: dict[str, dict] = {
    "qwen2-1.5b": {**_COMMON, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                   "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2-7b": {**_COMMON, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
}
