"""A DFlash draft's tensors as vLLM holds them, for the per-step weight sync (`DFlashDraftModel.vllm_weight_names`).

vLLM's `DFlashQwen3ForCausalLM.load_weights` prefixes every tensor but ``lm_head`` and ``d2t`` with ``model.`` and
renames ``d2t``; its `DFlashQwen3Model` then stacks ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into
``gate_up_proj``, which `ModelLayout` does from vLLM's packed-module map, so the names here stay unfused. Plain
PyTorch and names: imports and is tested without vLLM.
"""

import torch


__all__ = ["DFlashNames"]


class DFlashNames:
    """DFlash checkpoint names (docs/design.md section 3b) <-> vLLM's parameter names."""

    # vLLM substitutes it for the mask token's embedding when a checkpoint ships `mask_embedding.pt` (a pickle:
    # never ours); ours reads the target's embedding row of `mask_token_id`.
    vllm_only = frozenset({"model.mask_embedding"})

    @staticmethod
    def to_vllm(name: str) -> str | None:
        if name == "d2t":
            return "draft_id_to_target_id"
        if name.startswith("lm_head."):
            return name
        return "model." + name

    @staticmethod
    def to_checkpoint(vllm_name: str) -> str:
        if vllm_name == "draft_id_to_target_id":
            return "d2t"
        if vllm_name.startswith("lm_head."):
            return vllm_name
        return vllm_name.removeprefix("model.")

    @staticmethod
    def relayout(vllm_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """vLLM holds each part of a fused parameter as the checkpoint does (the fusion is a concatenation)."""
        return tensor

    @staticmethod
    def unknown_problems(unknown: list[str]) -> list[str]:
        """Why tensors vLLM has no parameter for are missing there, where the reason is known."""
        if "lm_head.weight" not in unknown:
            return []
        return [
            "a full-vocabulary DFlash draft reads the target's lm_head (vLLM shares it), so it has none of its own to "
            "sync: the policy's sync carries it"
        ]
