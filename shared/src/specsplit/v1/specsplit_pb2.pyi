from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerificationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFICATION_MODE_UNSPECIFIED: _ClassVar[VerificationMode]
    VERIFICATION_MODE_GREEDY: _ClassVar[VerificationMode]
    VERIFICATION_MODE_MATCH: _ClassVar[VerificationMode]
    VERIFICATION_MODE_SPARSE_Q: _ClassVar[VerificationMode]

class DraftMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_MODE_UNSPECIFIED: _ClassVar[DraftMode]
    DRAFT_MODE_ASYNC: _ClassVar[DraftMode]
    DRAFT_MODE_SYNC: _ClassVar[DraftMode]
    DRAFT_MODE_NONE: _ClassVar[DraftMode]

class DoneReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DONE_REASON_UNSPECIFIED: _ClassVar[DoneReason]
    DONE_REASON_EOS: _ClassVar[DoneReason]
    DONE_REASON_STOP: _ClassVar[DoneReason]
    DONE_REASON_LENGTH: _ClassVar[DoneReason]
    DONE_REASON_CONTEXT: _ClassVar[DoneReason]
    DONE_REASON_CANCELLED: _ClassVar[DoneReason]
VERIFICATION_MODE_UNSPECIFIED: VerificationMode
VERIFICATION_MODE_GREEDY: VerificationMode
VERIFICATION_MODE_MATCH: VerificationMode
VERIFICATION_MODE_SPARSE_Q: VerificationMode
DRAFT_MODE_UNSPECIFIED: DraftMode
DRAFT_MODE_ASYNC: DraftMode
DRAFT_MODE_SYNC: DraftMode
DRAFT_MODE_NONE: DraftMode
DONE_REASON_UNSPECIFIED: DoneReason
DONE_REASON_EOS: DoneReason
DONE_REASON_STOP: DoneReason
DONE_REASON_LENGTH: DoneReason
DONE_REASON_CONTEXT: DoneReason
DONE_REASON_CANCELLED: DoneReason

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "max_new_tokens", "stop_ids", "draft_model", "tokenizer_fingerprint", "verification", "draft_mode", "committed_ids")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    max_new_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_model: str
    tokenizer_fingerprint: str
    verification: VerificationMode
    draft_mode: DraftMode
    committed_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., draft_model: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., verification: _Optional[_Union[VerificationMode, str]] = ..., draft_mode: _Optional[_Union[DraftMode, str]] = ..., committed_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("start", "tokens", "parent_hash", "dists", "branch")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    dists: _containers.RepeatedCompositeFieldContainer[DraftDistribution]
    branch: bool
    def __init__(self, start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ..., dists: _Optional[_Iterable[_Union[DraftDistribution, _Mapping]]] = ..., branch: _Optional[bool] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EdgeMessage(_message.Message):
    __slots__ = ("open", "draft", "close")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    open: Open
    draft: Draft
    close: Close
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., draft: _Optional[_Union[Draft, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("session_id", "target_model", "max_context", "max_lookahead", "vocab_size")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    target_model: str
    max_context: int
    max_lookahead: int
    vocab_size: int
    def __init__(self, session_id: _Optional[str] = ..., target_model: _Optional[str] = ..., max_context: _Optional[int] = ..., max_lookahead: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("start", "tokens", "accepted", "proposed", "candidate_tip", "verifications", "chunks_received", "drafts_dropped", "verify_ms", "branch_tokens", "rejected")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_TIP_FIELD_NUMBER: _ClassVar[int]
    VERIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted: int
    proposed: int
    candidate_tip: int
    verifications: int
    chunks_received: int
    drafts_dropped: int
    verify_ms: float
    branch_tokens: int
    rejected: int
    def __init__(self, start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., accepted: _Optional[int] = ..., proposed: _Optional[int] = ..., candidate_tip: _Optional[int] = ..., verifications: _Optional[int] = ..., chunks_received: _Optional[int] = ..., drafts_dropped: _Optional[int] = ..., verify_ms: _Optional[float] = ..., branch_tokens: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("reason", "committed_length", "target_busy_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TARGET_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    reason: DoneReason
    committed_length: int
    target_busy_s: float
    def __init__(self, reason: _Optional[_Union[DoneReason, str]] = ..., committed_length: _Optional[int] = ..., target_busy_s: _Optional[float] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("opened", "verdict", "done")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    verdict: Verdict
    done: Done
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ...) -> None: ...
