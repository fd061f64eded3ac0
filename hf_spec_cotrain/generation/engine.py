"""What every rollout engine shares: its outputs and its counters. Nothing here imports vLLM."""

import math
from dataclasses import dataclass, field


__all__ = ["RolloutOutput", "SpecDecodeStats", "SyncStats", "WeightSyncError"]


class WeightSyncError(RuntimeError):
    """The engine's weights differ from what was sent, or a sync failed inside vLLM."""


@dataclass
class SpecDecodeStats:
    """Speculative-decoding counters of one `generate` call (vLLM's `vllm:spec_decode_*` metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per target forward, `1 + accepted / drafts`; NaN when nothing was drafted."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens accepted; NaN when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    def __sub__(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        before = other.accepted_per_position + [0] * (
            len(self.accepted_per_position) - len(other.accepted_per_position)
        )
        return SpecDecodeStats(
            num_drafts=self.num_drafts - other.num_drafts,
            num_draft_tokens=self.num_draft_tokens - other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - other.num_accepted_tokens,
            accepted_per_position=[now - then for now, then in zip(self.accepted_per_position, before)],
        )


@dataclass
class RolloutOutput:
    """Completions of one `generate` call, prompt-major (`n` completions per prompt, in order)."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    spec_decode: SpecDecodeStats


@dataclass
class SyncStats:
    """What one weight sync did and how long its parts took (seconds)."""

    num_tensors: int
    load_seconds: float
    verify_seconds: float | None
