"""Branch attention: causal trunk attention plus position-private branch keys in one softmax (docs/design.md
section 5).

`branch_attention` runs the blockwise kernel (linear memory in L), or with a context-parallel group the zigzag ring;
`branch_attention_reference` is the dense oracle used by tests.
"""

from .api import branch_attention
from .blockwise import BLOCK_SIZE
from .reference import branch_attention_reference


__all__ = ["BLOCK_SIZE", "branch_attention", "branch_attention_reference"]
