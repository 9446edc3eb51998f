"""Per-generation statistics the edge reports (the stats line and --json)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from specsplit.common.acceptance import observed_acceptance
from specsplit.protocol.edge_session import EdgeSession
from specsplit.protocol.messages import Verdict


@dataclass
class GenerationStats:
    mode: str
    tokens: int = 0
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_s: float | None = None  # until the first committed token
    # Until the server's Opened: the call accepted and its Open read (the rest of the TTFT is
    # the server's first verification and the way back).
    opened_s: float | None = None
    verifications: int = 0
    drafts_proposed: int = 0  # drafts the server verified
    drafts_accepted: int = 0
    acceptance_rate: float = 0.0  # accepted / proposed: counts the drafts a verification took past its rejection
    rejections: int = 0  # drafts rejected: where a verification stopped, and where a branch it followed did
    # accepted / (accepted + rejections): how often a draft is right where the one before it
    # was, the per-position acceptance a simulated edge's alpha stands for
    acceptance_per_position: float = 0.0
    mean_accepted: float = 0.0  # accepted drafts per verification
    drafts_made: int = 0
    drafts_wasted: int = 0
    branch_drafted: int = 0  # tokens drafted for branches (beside drafts_made)
    branches_taken: int = 0  # verdicts that moved the edge onto the branch it had drafted
    bytes_up: int = 0
    bytes_down: int = 0
    done_reason: str = ""
    itl_p50_ms: float = 0.0  # inter-token latency over committed tokens (0 within one verdict)
    itl_p99_ms: float = 0.0
    # the server's time on this session's verifications (of an attempt a retry interrupted, unknown: not counted)
    target_busy_s: float = 0.0
    # of the generation's wall time, the target did not work for it (an attempt a retry
    # interrupted counts as idle: its busy time is unknown)
    server_idle_fraction: float = 0.0
    reconnects: int = 0  # streams re-opened after a lost server or network

    def add_verdict(self, v: Verdict, elapsed_s: float) -> None:
        if self.ttft_s is None and v.tokens:
            self.ttft_s = elapsed_s
        self.verifications += 1
        self.drafts_proposed += v.proposed
        self.drafts_accepted += v.accepted
        self.rejections += v.rejected

    def add_drafting(self, edge: EdgeSession) -> None:
        """Count an attempt's drafting (a retry's attempt drafts on a session of its own)."""
        self.drafts_made += edge.drafted
        self.drafts_wasted += edge.wasted
        self.branch_drafted += edge.branch_drafted
        self.branches_taken += edge.branches_taken

    def finish(self, tokens: int, elapsed_s: float, commit_times: list[float]) -> None:
        self.tokens = tokens
        if len(commit_times) > 1:
            gaps = np.diff(commit_times) * 1000
            self.itl_p50_ms = float(np.percentile(gaps, 50))
            self.itl_p99_ms = float(np.percentile(gaps, 99))
        self.server_idle_fraction = max(0.0, 1.0 - self.target_busy_s / elapsed_s) if elapsed_s > 0 else 0.0
        self.elapsed_s = elapsed_s
        self.tokens_per_s = self.tokens / elapsed_s if elapsed_s > 0 else 0.0
        self.acceptance_rate = self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0
        self.acceptance_per_position = observed_acceptance(self.drafts_accepted, self.rejections) or 0.0
        self.mean_accepted = self.drafts_accepted / self.verifications if self.verifications else 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        ttft = f"{self.ttft_s * 1000:.0f} ms" if self.ttft_s is not None else "n/a"
        return (
            f"[{self.mode}] {self.tokens} tokens in {self.elapsed_s:.2f} s ({self.tokens_per_s:.2f} tok/s), "
            f"ttft {ttft}, acceptance {self.acceptance_rate:.0%}, "
            f"mean accepted/verification {self.mean_accepted:.2f}, drafts wasted {self.drafts_wasted}, "
            f"bytes up {self.bytes_up} / down {self.bytes_down}, done: {self.done_reason}"
            + (f", reconnects {self.reconnects}" if self.reconnects else "")
        )
