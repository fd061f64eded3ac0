"""Parallelism for the draft: context parallelism on the zigzag layout (DESIGN.md section 5).

`zigzag_shard` / `zigzag_unshard` / `zigzag_position_ids` / `pad_documents` implement the layout;
`ZigzagHalo` shifts the TTT inputs across shards; `all_reduce_gradients` is the reduction the caller applies
to the draft's gradients after a context-parallel `ttt_loss`. The ring attention itself is
`hf_spec_cotrain.attention.branch_attention(..., cp_group=...)`.
"""

from .context_parallel import ZigzagHalo, all_reduce_gradients
from .zigzag import (
    DocumentPadding,
    pad_documents,
    zigzag_bounds,
    zigzag_indices,
    zigzag_owner,
    zigzag_position_ids,
    zigzag_shard,
    zigzag_unshard,
)


__all__ = [
    "DocumentPadding",
    "ZigzagHalo",
    "all_reduce_gradients",
    "pad_documents",
    "zigzag_bounds",
    "zigzag_indices",
    "zigzag_owner",
    "zigzag_position_ids",
    "zigzag_shard",
    "zigzag_unshard",
]
