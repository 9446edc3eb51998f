"""Conversion between the protocol core's dataclasses and the specsplit.v1 protobuf messages.

The only module of the core that knows about protobuf; transports call it at the edges.
"""
from __future__ import annotations

from specsplit.protocol.errors import InvalidOpen, MalformedMessage, ProtocolError, ServerBrokeProtocol
from specsplit.protocol.messages import (
    Close,
    Done,
    DoneReason,
    DraftChunk,
    DraftMode,
    Opened,
    OpenRequest,
    SamplingParams,
    SparseDist,
    Verdict,
    VerificationMode,
)
from specsplit.v1 import specsplit_pb2 as pb

EdgeEvent = OpenRequest | DraftChunk | Close
ServerEvent = Opened | Verdict | Done


def _enum(enum_cls, value: int, what: str, error: type[ProtocolError] = InvalidOpen):  # type: ignore[no-untyped-def]
    """`value` as `enum_cls`, or `error` for a value this side does not know (a newer peer's)."""
    try:
        return enum_cls(value)
    except ValueError:
        raise error(f"unknown {what} {value}") from None


def open_to_pb(req: OpenRequest) -> pb.EdgeMessage:
    s = req.sampling
    return pb.EdgeMessage(
        open=pb.Open(
            prompt_ids=req.prompt_ids,
            sampling=pb.Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed),
            max_new_tokens=req.max_new_tokens,
            stop_ids=req.stop_ids,
            draft_model=req.draft_model,
            tokenizer_fingerprint=req.tokenizer_fingerprint,
            verification=0 if req.verification is None else int(req.verification),
            draft_mode=int(req.draft_mode),
            committed_ids=req.committed_ids,
        )
    )


def draft_to_pb(chunk: DraftChunk) -> pb.EdgeMessage:
    return pb.EdgeMessage(
        draft=pb.Draft(
            start=chunk.start,
            tokens=chunk.tokens,
            parent_hash=chunk.parent_hash,
            dists=[pb.DraftDistribution(ids=d.ids, probs=d.probs) for d in chunk.dists],
            branch=chunk.branch,
        )
    )


def edge_from_pb(msg: pb.EdgeMessage) -> EdgeEvent:
    kind = msg.WhichOneof("kind")
    if kind == "open":
        o = msg.open
        s = o.sampling
        return OpenRequest(
            prompt_ids=tuple(o.prompt_ids),
            max_new_tokens=o.max_new_tokens,
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed),
            stop_ids=tuple(o.stop_ids),
            verification=None if o.verification == 0 else _enum(VerificationMode, o.verification, "verification mode"),
            draft_mode=DraftMode.ASYNC if o.draft_mode == 0 else _enum(DraftMode, o.draft_mode, "draft mode"),
            draft_model=o.draft_model,
            tokenizer_fingerprint=o.tokenizer_fingerprint,
            committed_ids=tuple(o.committed_ids),
        )
    if kind == "draft":
        d = msg.draft
        return DraftChunk(
            start=d.start,
            tokens=tuple(d.tokens),
            parent_hash=d.parent_hash,
            dists=tuple(SparseDist(tuple(x.ids), tuple(x.probs)) for x in d.dists),
            branch=d.branch,
        )
    if kind == "close":
        return Close()
    raise MalformedMessage("edge message carries none of open, draft, close")


def server_to_pb(event: ServerEvent) -> pb.ServerMessage:
    if isinstance(event, Verdict):
        return pb.ServerMessage(
            verdict=pb.Verdict(
                start=event.start,
                tokens=event.tokens,
                accepted=event.accepted,
                proposed=event.proposed,
                candidate_tip=event.candidate_tip,
                verifications=event.verifications,
                chunks_received=event.chunks_received,
                drafts_dropped=event.drafts_dropped,
                verify_ms=event.verify_ms,
                branch_tokens=event.branch_tokens,
                rejected=event.rejected,
            )
        )
    if isinstance(event, Done):
        return pb.ServerMessage(
            done=pb.Done(
                reason=int(event.reason), committed_length=event.committed_length, target_busy_s=event.target_busy_s
            )
        )
    return pb.ServerMessage(
        opened=pb.Opened(
            session_id=event.session_id,
            target_model=event.target_model,
            max_context=event.max_context,
            max_lookahead=event.max_lookahead,
            vocab_size=event.vocab_size,
        )
    )


def server_from_pb(msg: pb.ServerMessage) -> ServerEvent:
    kind = msg.WhichOneof("kind")
    # What the edge could not go on with is the server's break of the protocol (a ProtocolError,
    # which the edge's callers handle), not a ValueError deep in the edge's session.
    if kind == "verdict":
        v = msg.verdict
        if not v.tokens:  # every verification commits the target's own token at least
            raise ServerBrokeProtocol(f"the server's verdict at {v.start} commits no token")
        return Verdict(
            start=v.start,
            tokens=tuple(v.tokens),
            accepted=v.accepted,
            proposed=v.proposed,
            candidate_tip=v.candidate_tip,
            verifications=v.verifications,
            chunks_received=v.chunks_received,
            drafts_dropped=v.drafts_dropped,
            verify_ms=v.verify_ms,
            branch_tokens=v.branch_tokens,
            # An older server sends none: one rejection where it took fewer drafts than it looked at.
            rejected=v.rejected if v.HasField("rejected") else int(v.accepted < v.proposed),
        )
    if kind == "done":
        # A reason from a newer server is the server's break of this edge's protocol, as an
        # unknown message is: a ProtocolError, which the edge's callers handle, not a bare ValueError.
        reason = _enum(DoneReason, msg.done.reason, "done reason", ServerBrokeProtocol)
        return Done(reason, msg.done.committed_length, msg.done.target_busy_s)
    if kind == "opened":
        o = msg.opened
        if o.max_lookahead < 1 or o.max_context < 2:
            raise ServerBrokeProtocol(f"the server's Opened allows a lookahead of {o.max_lookahead} and a "
                                      f"context of {o.max_context} tokens: no generation fits")
        return Opened(o.session_id, o.target_model, o.max_context, o.max_lookahead, o.vocab_size)
    raise ServerBrokeProtocol("server message carries none of opened, verdict, done")
