"""How the edge picks a draft token from its logits, per verification mode.

The edge's random draws use a stream keyed like the server's but with another seed,
so draft choices are independent of the server's acceptance draws (exactness needs it).
"""
from __future__ import annotations

import numpy as np

from specsplit.protocol.messages import SamplingParams, SparseDist, VerificationMode
from specsplit.protocol.sampling import position_rng, process_logits, sample_from

EDGE_SEED_OFFSET = 0x9E3779B97F4A7C15


class Proposer:
    def __init__(self, mode: VerificationMode, sampling: SamplingParams, sparse_top_k: int = 8) -> None:
        if sparse_top_k < 1:
            raise ValueError("sparse_top_k must be at least 1")
        self.mode = mode
        self.sampling = sampling
        self.sparse_top_k = sparse_top_k
        self._seed = (int(sampling.seed) + EDGE_SEED_OFFSET) % 2**64  # int: a numpy seed would overflow

    def propose(self, logits: np.ndarray, position: int) -> tuple[int, SparseDist | None]:
        if self.mode is VerificationMode.GREEDY:
            return int(np.argmax(logits)), None
        u = position_rng(self._seed, position).random()
        if self.mode is VerificationMode.MATCH:
            return sample_from(process_logits(logits, self.sampling), u), None
        # sparse-q: q is the temperature-scaled softmax truncated to the draft's top k.
        z = np.asarray(logits, dtype=np.float64) / self.sampling.temperature
        k = min(self.sparse_top_k, z.shape[-1])
        ids = np.argpartition(-z, k - 1)[:k]
        ids = ids[np.argsort(-z[ids], kind="stable")]
        q = np.exp(z[ids] - z[ids].max())
        # The server sees float32 probabilities; sample from exactly those.
        q32 = (q / q.sum()).astype(np.float32)
        nonzero = q32 > 0  # far-tail entries can underflow in float32
        ids, q32 = ids[nonzero], q32[nonzero]
        pick = sample_from(q32.astype(np.float64), u)
        return int(ids[pick]), SparseDist(tuple(int(i) for i in ids), tuple(float(x) for x in q32))
