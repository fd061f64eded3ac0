"""The drafters: the interface every family implements (`base`), the EAGLE-3 family (its head, configuration,
training-time-test loss and vLLM names), the DFlash block draft (`dflash_*`) and the vocabulary maps they share."""

from .base import DraftLossOutput, DraftModel, DraftProposer, DraftTrainingBatch, SampleFn
from .configuration import EAGLE3_ARCHITECTURE, Eagle3DraftConfig
from .dflash_configuration import (
    DFLASH_ARCHITECTURE,
    DFlashDraftConfig,
    choose_mask_token_id,
    default_target_layer_ids,
)
from .dflash_modeling import DFlashDraftModel
from .eagle3_ttt import Eagle3TrainingOptions, ttt_loss
from .modeling import Eagle3DecoderLayer, Eagle3DraftModel, Eagle3DraftOutput
from .vocab import count_tokens, select_draft_vocab, vocab_maps


__all__ = [
    "DFLASH_ARCHITECTURE",
    "EAGLE3_ARCHITECTURE",
    "DFlashDraftConfig",
    "DFlashDraftModel",
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
    "choose_mask_token_id",
    "count_tokens",
    "default_target_layer_ids",
    "select_draft_vocab",
    "ttt_loss",
    "vocab_maps",
]
