"""Branch attention: causal trunk attention plus position-private branch keys in one softmax (docs/design.md
section 5), and the block-draft attention built on it (DFlash's anchor blocks).

`branch_attention` runs the blockwise kernel (linear memory in L), or with a context-parallel group the zigzag ring;
`block_draft_attention` maps a block drafter's anchors onto it; `branch_attention_reference` and
`block_draft_attention_reference` are the dense oracles used by tests.
"""

from .api import branch_attention
from .block_draft import anchor_query_positions, block_draft_attention
from .blockwise import BLOCK_SIZE
from .reference import block_draft_attention_reference, branch_attention_reference


__all__ = [
    "BLOCK_SIZE",
    "anchor_query_positions",
    "block_draft_attention",
    "block_draft_attention_reference",
    "branch_attention",
    "branch_attention_reference",
]
