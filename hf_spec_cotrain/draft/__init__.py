"""The EAGLE-3 draft head, its configuration and its vocabulary maps."""

from .configuration import EAGLE3_ARCHITECTURE, Eagle3DraftConfig
from .modeling import Eagle3DecoderLayer, Eagle3DraftModel, Eagle3DraftOutput
from .vocab import count_tokens, select_draft_vocab, vocab_maps


__all__ = [
    "EAGLE3_ARCHITECTURE",
    "Eagle3DecoderLayer",
    "Eagle3DraftConfig",
    "Eagle3DraftModel",
    "Eagle3DraftOutput",
    "count_tokens",
    "select_draft_vocab",
    "vocab_maps",
]
