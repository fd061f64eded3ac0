"""Numerically stable merge of partial attention results.

Two softmax-attention results over disjoint key sets, each given as a normalised output and the
log-sum-exp of its scores, combine exactly into the result over the union of the keys:
`lse = logaddexp(lse_a, lse_b)` and `out = out_a + sigmoid(lse_b - lse_a) * (out_b - out_a)`.
The sigmoid form never exponentiates a large number (the form used by ring-flash-attention).
A partial with no visible key has `lse = -inf` and contributes nothing; two such partials stay
empty (`-inf`, zero output) instead of producing NaN.
"""

import torch


def merge_attention_partials(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge `(block_out, block_lse)` into `(out, lse)`; outputs are `[..., N, D]`, log-sum-exps `[..., N]`."""
    weight = torch.sigmoid(block_lse - lse)
    # -inf - (-inf) is NaN: both partials are empty, and either weight gives the (zero) output.
    weight = torch.nan_to_num(weight, nan=0.0)
    merged_out = torch.lerp(out, block_out, weight.unsqueeze(-1).to(out.dtype))
    return merged_out, torch.logaddexp(lse, block_lse)
