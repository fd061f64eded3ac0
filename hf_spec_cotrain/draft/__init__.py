"""The drafters: the interface every family implements (`base`), the EAGLE-3 family (its head, configuration,
training-time-test loss and vLLM names), the registry of families (`families`) and the vocabulary maps they share."""

from .base import DraftLossOutput, DraftModel, DraftProposer, DraftTrainingBatch, SampleFn
from .configuration import EAGLE3_ARCHITECTURE, Eagle3DraftConfig
from .eagle3_ttt import Eagle3TrainingOptions, ttt_loss
from .families import (
    DEFAULT_DRAFTER,
    DRAFTER_FAMILIES,
    check_draft_family,
    checkpoint_drafter,
    checkpoint_family,
    drafter_family,
    load_draft,
)
from .modeling import Eagle3DecoderLayer, Eagle3DraftModel, Eagle3DraftOutput
from .vocab import count_tokens, select_draft_vocab, vocab_maps


__all__ = [
    "DEFAULT_DRAFTER",
    "DRAFTER_FAMILIES",
    "EAGLE3_ARCHITECTURE",
    "DraftLossOutput",
    "DraftModel",
    "DraftProposer",
    "DraftTrainingBatch",
    "Eagle3DecoderLayer",
    "Eagle3DraftConfig",
    "Eagle3DraftModel",
    "Eagle3DraftOutput",
    "Eagle3TrainingOptions",
    "SampleFn",
    "check_draft_family",
    "checkpoint_drafter",
    "checkpoint_family",
    "count_tokens",
    "drafter_family",
    "load_draft",
    "select_draft_vocab",
    "ttt_loss",
    "vocab_maps",
]
