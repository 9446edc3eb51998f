"""Protocol events as plain dataclasses; `specsplit.protocol.codec` maps them to protobuf."""
from __future__ import annotations

import enum
import math
import numbers
import struct
from dataclasses import dataclass, field

from specsplit.protocol.errors import InvalidOpen


class VerificationMode(enum.IntEnum):
    GREEDY = 1
    MATCH = 2
    SPARSE_Q = 3


class DraftMode(enum.IntEnum):
    ASYNC = 1
    SYNC = 2
    NONE = 3


class DoneReason(enum.IntEnum):
    EOS = 1
    STOP = 2
    LENGTH = 3
    CONTEXT = 4
    CANCELLED = 5


# The most draft tokens one chunk may carry (a server refuses more with RESOURCE_EXHAUSTED).
MAX_CHUNK = 64
# The most stop ids an Open, and ids a sparse-q draft distribution, may carry (INVALID_ARGUMENT
# past them): the server works through them on its event loop, for every session.
MAX_STOP_IDS = 64
MAX_DIST_IDS = 256


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0  # 0 or 1: off
    top_k: int = 0  # 0: off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def problem(self) -> tuple[str, str] | None:
        """(field, what is wrong with it) for the first setting no server takes, or None."""
        for name, kind, what in (("temperature", numbers.Real, "a number"), ("top_p", numbers.Real, "a number"),
                                 ("top_k", numbers.Integral, "a whole number"), ("seed", numbers.Integral, "a whole number")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                return name, f"must be {what}, got {value!r}"
        if not math.isfinite(self.temperature) or self.temperature < 0 or self.temperature > 100:
            return "temperature", f"must be in [0, 100], got {self.temperature}"
        if not math.isfinite(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            return "top_p", f"must be in [0, 1], got {self.top_p}"
        for name in ("temperature", "top_p"):  # floats of 32 bits on the wire
            value = getattr(self, name)
            if value > 0 and struct.unpack("f", struct.pack("f", value))[0] == 0:
                return name, f"{value} is 0 as a 32-bit float, as the server reads it: use 0 or a larger value"
        if not 0 <= self.top_k < 2**32:
            return "top_k", f"must be in [0, 2**32), got {self.top_k}"
        if not 0 <= self.seed < 2**64:
            return "seed", f"must fit in 64 unsigned bits, got {self.seed}"
        return None

    def validate(self) -> None:
        if problem := self.problem():
            raise InvalidOpen(" ".join(problem))


@dataclass(frozen=True)
class SparseDist:
    """A draft's top-k truncated distribution at one position (sparse-q mode)."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]

    def prob_of(self, token: int) -> float:
        for i, p in zip(self.ids, self.probs):
            if i == token:
                return p
        return 0.0


@dataclass(frozen=True)
class OpenRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    verification: VerificationMode | None = None  # None: greedy at T=0, else match
    draft_mode: DraftMode = DraftMode.ASYNC
    draft_model: str = ""
    tokenizer_fingerprint: str = ""
    committed_ids: tuple[int, ...] = ()  # resuming an interrupted generation

    def resolved_mode(self) -> VerificationMode:
        if self.sampling.greedy:
            return VerificationMode.GREEDY
        if self.verification in (None, VerificationMode.GREEDY):
            if self.verification is VerificationMode.GREEDY:
                raise InvalidOpen("verification mode greedy needs temperature 0")
            return VerificationMode.MATCH
        return self.verification


@dataclass(frozen=True)
class DraftChunk:
    start: int
    tokens: tuple[int, ...]
    parent_hash: int
    dists: tuple[SparseDist, ...] = ()
    branch: bool = False  # an alternative from `start` on, used only if a verdict corrects to tokens[0]


@dataclass(frozen=True)
class Opened:
    session_id: str
    target_model: str
    max_context: int
    max_lookahead: int
    vocab_size: int


@dataclass(frozen=True)
class Verdict:
    start: int
    tokens: tuple[int, ...]
    accepted: int
    proposed: int
    candidate_tip: int
    verifications: int = 0
    chunks_received: int = 0
    drafts_dropped: int = 0
    verify_ms: float = 0.0  # filled in by the transport, which owns the clock
    # The verdict moved the candidates onto the edge's branch: this many of them past the committed tokens.
    branch_tokens: int = 0
    # How many of tokens stand where a draft was rejected: the candidates' and a followed
    # branch's own (0 to 2). What a per-position acceptance counts: accepted < proposed
    # misses the branch's.
    rejected: int = 0


@dataclass(frozen=True)
class Done:
    reason: DoneReason
    committed_length: int
    target_busy_s: float = 0.0  # filled in by the transport, which owns the clock


@dataclass(frozen=True)
class Close:
    pass


@dataclass(frozen=True)
class ServerLimits:
    """What one server allows a session; sent back in `Opened` where the edge needs it."""

    vocab_size: int
    max_context: int
    max_lookahead: int = 64
    max_chunk: int = MAX_CHUNK
    max_new_tokens: int = 4096
    eos_ids: tuple[int, ...] = field(default_factory=tuple)
    target_model: str = ""
    tokenizer_fingerprint: str = ""  # empty: accept any
