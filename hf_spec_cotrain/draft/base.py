"""The drafter interface (docs/design.md section 3a): what the trainer, the rollouts, the warm start, the checkpoints
and the model card ask of a draft, whatever its family (EAGLE-3, DFlash, ...).

A family is one draft model class implementing `DraftModel`, registered in `DRAFTER_FAMILIES` under the name
`SpecCoTrainConfig.drafter` takes. Nothing outside a family's own modules branches on the family: callers use these
methods only, so a new family is a new module plus one registry entry.
"""

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel


@dataclass
class DraftTrainingBatch:
    """One policy forward's taps and targets, as every family's training objective takes them.

    ``aux_hidden_states``: the tapped layer inputs concatenated, ``[B, L, n * target_hidden]`` (in the order of
    `DraftModel.tap_layer_ids`); ``input_embeds``: the policy's token embeddings ``[B, L, hidden]``;
    ``teacher_logits``: ``[B, L, draft_vocab_size]``, at position ``p`` the policy's prediction of ``x_{p+1}``
    (`DraftModel.teacher_logits`); ``loss_mask``: ``[B, L]``, True where predicting ``x_p`` counts (completion
    tokens); ``attention_mask``: ``[B, L]`` padding of rows whose real tokens are contiguous, or None;
    ``cu_seqlens``: packed document boundaries (B = 1), or None; under context parallelism every ``[B, L]`` tensor is
    this rank's zigzag shard and ``cu_seqlens`` stays global.
    """

    aux_hidden_states: torch.Tensor
    input_embeds: torch.Tensor
    teacher_logits: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None


@dataclass
class DraftLossOutput:
    """A family's training loss and its per-position metrics, detached, each ``[K]``: position ``d`` is the d-th
    drafted token of a round (EAGLE-3: the d-th unrolled step; DFlash: the d-th mask position of a block).
    ``step_losses`` and ``step_accuracies`` are means over the ``step_counts`` counted positions; the whole loss is
    ``(step_weights * step_losses).sum()`` (what decides a skip when ``loss`` is one context-parallel rank's share)."""

    loss: torch.Tensor
    step_losses: torch.Tensor
    step_accuracies: torch.Tensor
    step_counts: torch.Tensor
    step_weights: torch.Tensor


# sample(draft_logits [R, draft_vocab]) -> (target ids [R], the distribution q [R, vocab] they were drawn from, or
# None for an argmax): the decoder's, which applies the rollout's warpers and random stream.
SampleFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class DraftProposer(abc.ABC):
    """One `speculative_generate` call's drafting state over its live rows (the draft's own caches).

    The decoder verifies and keeps the target's state; it hands the proposer what the target verified
    (`catch_up`), asks for up to K tokens per round (`propose`) and tells it which rows remain (`keep_rows`).
    """

    @abc.abstractmethod
    def catch_up(
        self, next_tokens: torch.Tensor, taps: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """Positions the target verified since the last round, ``[R, L]``: ``taps[:, j]`` the target's taps at
        ``position_ids[:, j]``, ``next_tokens[:, j]`` the token that follows it, ``valid`` False at holes
        (rejected slots). Called before each `propose`; may defer its work to it."""

    @abc.abstractmethod
    def propose(
        self, last_token: torch.Tensor, next_position: torch.Tensor, k: int, sample: SampleFn
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """``k >= 1`` draft tokens per row after ``last_token`` (the last verified token, at ``next_position``):
        target ids ``[R, k]`` and, per drafted position, the distribution each was drawn from (`SampleFn`)."""

    @abc.abstractmethod
    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (int64 indices into the current rows), in that order."""

    @abc.abstractmethod
    def compact(self) -> None:
        """Drop cache slots no later round can see (a hint, called after each round)."""


class DraftModel(PreTrainedModel):
    """A drafter family's model: a small network on the target's taps that proposes tokens for the target to
    verify, reading the target's token embedding (bound by `bind_target`, never saved, never trained).

    Subclasses set `drafter_name` (the `SpecCoTrainConfig.drafter` value) and `vllm_method` (vLLM's
    `speculative_config["method"]`) and implement the abstract methods below.
    """

    drafter_name: ClassVar[str]
    vllm_method: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def from_target(cls, target: PreTrainedModel, **options: Any) -> "DraftModel":
        """A fresh draft sized for ``target``, bound to it (`bind_target`)."""

    @abc.abstractmethod
    def bind_target(self, target: PreTrainedModel) -> "DraftModel":
        """Check that this draft fits ``target`` (a ValueError naming the field otherwise); read its embedding."""

    @abc.abstractmethod
    def tap_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose *inputs* the draft reads (`hf_spec_cotrain.taps.TapRecorder` ids), in the order
        its input projection concatenates them."""

    @property
    @abc.abstractmethod
    def draft_to_target_ids(self) -> torch.Tensor:
        """Target id of every draft id, ``[draft_vocab_size]``."""

    @abc.abstractmethod
    def teacher_logits(self, final_hidden: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary from its final-norm output and lm_head weight."""

    @classmethod
    @abc.abstractmethod
    def training_options(cls, args: Any) -> Any:
        """The family's objective settings (a frozen dataclass) from a `SpecCoTrainConfig` or `DraftTrainingConfig`."""

    @abc.abstractmethod
    def training_loss(
        self,
        batch: DraftTrainingBatch,
        options: Any,
        *,
        cp_group: dist.ProcessGroup | None = None,
        generator: torch.Generator | None = None,
        gradient_checkpointing: bool = False,
    ) -> DraftLossOutput:
        """The family's objective on one forward's taps (``options`` from `training_options`), with the policy's
        distribution as teacher. Under context parallelism (``cp_group`` of W > 1) ``loss`` is this rank's share of
        the single-device loss and the metrics are global. ``generator``: the family's own randomness (DFlash's
        anchors), reproducible from the trainer's seed."""

    @abc.abstractmethod
    def new_proposer(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposer:
        """HF-native drafting state for one generate call; ``embed`` maps token ids to the target's embeddings
        (through the pipeline's first stage under pipeline parallelism)."""

    @abc.abstractmethod
    def validate_weights(self, *, what: str = "The draft") -> None:
        """Raise a ValueError if a weight is non-finite, not in the draft's dtype, or a vocabulary map is broken."""

    @abc.abstractmethod
    def vllm_speculative_config(self, model: str, num_speculative_tokens: int) -> dict[str, Any]:
        """vLLM's ``speculative_config`` for this draft saved at ``model``."""

    @property
    @abc.abstractmethod
    def vllm_weight_names(self) -> Any:
        """The draft's names in vLLM (`to_vllm`, `to_checkpoint`, `relayout`) for the per-step weight sync."""

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
