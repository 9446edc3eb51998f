"""Version-agnostic handling of transformers' KV cache objects.

transformers 5 renamed the forward argument `past_key_values` to `cache`; both take
the fourth positional slot, so callers pass it positionally and read it back here.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.utils import ModelOutput


def output_cache(out: ModelOutput) -> DynamicCache:
    """The cache a forward pass returned (`cache` where the model names it so)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_from_tensors(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    for i, (k, v) in enumerate(pairs):
        cache.update(k, v, i)
    return cache


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values): per-layer caches since transformers 4.54, the only kind
    from 4.56 on, which removed `key_cache`."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def kv_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a decoder's config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def position_bytes(model: torch.nn.Module) -> int:
    """One position's keys and values over all of the model's layers, in its dtype."""
    layers, heads, head_dim = kv_shape(model.config)
    return layers * 2 * heads * head_dim * next(model.parameters()).element_size()
