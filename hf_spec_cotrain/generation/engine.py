"""What every rollout engine shares: its outputs, its counters and the `RolloutEngine` protocol.

The colocated `VLLMRolloutEngine` and the `VLLMServerClient` of a rollout server both satisfy `RolloutEngine`,
so the trainer drives either one without knowing which. Nothing here imports vLLM.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch


__all__ = [
    "WEIGHT_SETS",
    "EngineRestartedError",
    "EngineUnavailableError",
    "RolloutEngine",
    "RolloutOutput",
    "SpecDecodeStats",
    "SyncStats",
    "WeightSet",
    "WeightSyncError",
    "check_weight_set",
    "finite_or_none",
]

# The two weight sets an engine holds: the policy (HF names) and its draft (checkpoint names).
WeightSet = Literal["policy", "draft"]
WEIGHT_SETS: tuple[WeightSet, ...] = ("policy", "draft")


def check_weight_set(which: str) -> None:
    """Refuse a `which` that names neither weight set."""
    if which not in WEIGHT_SETS:
        raise ValueError(f"which={which!r} names no weight set: choose 'policy' or 'draft'.")


class WeightSyncError(RuntimeError):
    """The engine's weights differ from what was sent, or a sync failed inside vLLM."""


class EngineRestartedError(RuntimeError):
    """The engine restarted (a rollout server) and holds the weights it started with, not those pushed into it:
    push the policy and the draft again. The call that raised was not served."""


class EngineUnavailableError(RuntimeError):
    """The engine could not be reached within the bounded retries: a run should stop (and resume from its last
    checkpoint) rather than go on without it."""


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

    def to_json(self) -> dict[str, Any]:
        """The counters as the rollout server sends them, with the acceptance length for readers of the raw JSON
        (null when nothing was drafted: JSON has no NaN)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": self.accepted_per_position,
            "acceptance_length": finite_or_none(self.acceptance_length),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SpecDecodeStats":
        """The inverse of `to_json` (the acceptance length is recomputed from the counters)."""
        return cls(
            num_drafts=data["num_drafts"],
            num_draft_tokens=data["num_draft_tokens"],
            num_accepted_tokens=data["num_accepted_tokens"],
            accepted_per_position=data["accepted_per_position"],
        )


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN or infinity: such values travel as null."""
    return value if math.isfinite(value) else None


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


class RolloutEngine(Protocol):
    """A speculative rollout engine holding a policy and its draft, whose weights the trainer replaces every step."""

    # False: each training process holds an engine of its own and syncs it. True: one engine serves every process,
    # so only the main process pushes weights.
    shared_across_processes: ClassVar[bool]

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        n: int = 1,
        logprobs: bool = False,
        **sampling_kwargs: Any,
    ) -> RolloutOutput:
        """`n` completions per prompt, prompt-major, with the speculative counters of this call."""
        ...

    def sync_weights(self, which: WeightSet, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> object:
        """Replace every weight of `which` (the complete set, in checkpoint names); returns what the sync did."""
        ...

    def check_weights(self, which: WeightSet, named_shapes: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Raise the ValueError a sync of tensors of these names and shapes would meet, sending nothing."""
        ...

    def close(self) -> None:
        """Release the engine (or the connection to it)."""
        ...
