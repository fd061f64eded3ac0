"""Branch attention: causal trunk attention plus position-private branch keys in one softmax (DESIGN.md section 5).

`branch_attention` is the blockwise kernel (linear memory in L); `branch_attention_reference` is the
dense oracle used by tests.
"""

from .blockwise import BLOCK_SIZE, branch_attention
from .reference import branch_attention_reference


__all__ = ["BLOCK_SIZE", "branch_attention", "branch_attention_reference"]
