"""The drafters: the interface every family implements (`base`), the EAGLE-3 family (its head, configuration,
training-time-test loss and vLLM names), the DFlash block draft (`dflash_*`), the registry of families (`families`)
and the vocabulary maps they share."""

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
    "DFLASH_ARCHITECTURE",
    "DRAFTER_FAMILIES",
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
    "check_draft_family",
    "checkpoint_drafter",
    "checkpoint_family",
    "choose_mask_token_id",
    "count_tokens",
    "default_target_layer_ids",
    "drafter_family",
    "load_draft",
    "select_draft_vocab",
    "ttt_loss",
    "vocab_maps",
]
