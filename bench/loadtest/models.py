"""Which target and draft a load test uses: given directories, a Qwen2.5-shaped config
served with random weights, or (by default) the tiny test pair built on the spot."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.drafts import describe_draft
from loadtest.targets import describe_target, write_config_target, without_eos
from tiny_models import build_tiny_pair


@dataclass(frozen=True)
class Models:
    target_dir: Path
    target_name: str  # how the report names it (never a path on this machine)
    draft_dir: Path | None  # for onnx edges
    draft_name: str = ""
    server_args: tuple[str, ...] = field(default_factory=tuple)  # what serving this target needs

    def describe(self, dtype: str, device: str) -> dict:
        out: dict = {"target": {"name": self.target_name, "config": describe_target(self.target_dir),
                                "dtype": dtype, "device": device}}
        if self.draft_dir is not None:
            out["draft"] = describe_draft(self.draft_dir, self.draft_name)
        return out


def choose_models(work: Path, target: Path | None, target_config: str | None, draft: Path | None,
                  need_draft: bool) -> Models:
    """Build what is missing under `work` (the tiny pair takes some seconds to build and export)."""
    tiny = None
    if (target is None and target_config is None) or (need_draft and draft is None):
        with warnings.catch_warnings():
            # The ONNX tracer's warnings about the tiny model; export_draft checks the export's logits itself.
            warnings.simplefilter("ignore")
            tiny = build_tiny_pair(work / "tiny")
    server_args: tuple[str, ...] = ()
    if target is not None:
        target_dir, target_name = target, target.name
    elif target_config is not None:
        target_dir = write_config_target(work / target_config, target_config)
        target_name = f"{target_config} shape, random weights made to echo their input (--load-format dummy-echo), " \
            "tiny tokenizer"
        # Plain random weights have near-tied logits that bf16 batching flips: the simulated
        # edges' knowledge of the greedy continuation would go stale after a few tokens.
        server_args = ("--load-format", "dummy-echo")
    else:
        assert tiny is not None
        target_dir = without_eos(tiny.target_dir, work / "target")
        target_name = "tiny random-weight qwen2 (bench/tiny_models.py), eos removed"
    draft_dir, draft_name = None, ""
    if need_draft:
        if draft is not None:
            draft_dir, draft_name = draft, draft.name
        else:
            assert tiny is not None
            draft_dir, draft_name = tiny.draft_dir, "tiny random-weight qwen2 draft (bench/tiny_models.py)"
    return Models(target_dir, target_name, draft_dir, draft_name, server_args)
