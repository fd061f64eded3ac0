"""The drafters: the interface every family implements (`base`), the EAGLE-3 family (its head, configuration,
training-time-test loss and vLLM names) and the vocabulary maps they share."""

from .base import DraftLossOutput, DraftModel, DraftProposer, DraftTrainingBatch, SampleFn
from .configuration import EAGLE3_ARCHITECTURE, Eagle3DraftConfig
from .eagle3_ttt import Eagle3TrainingOptions, ttt_loss
from .modeling import Eagle3DecoderLayer, Eagle3DraftModel, Eagle3DraftOutput
from .vocab import count_tokens, select_draft_vocab, vocab_maps


__all__ = [
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
    "count_tokens",
    "select_draft_vocab",
    "ttt_loss",
    "vocab_maps",
]
