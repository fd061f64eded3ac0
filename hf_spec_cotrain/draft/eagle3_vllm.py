"""An EAGLE-3 draft's tensors as vLLM holds them, for the per-step weight sync (`Eagle3DraftModel.vllm_weight_names`).

Plain PyTorch and names: imports and is tested without vLLM.
"""

import torch


__all__ = ["DraftNames"]


class DraftNames:
    """EAGLE-3 checkpoint names (docs/design.md section 3) as vLLM's `Eagle3LlamaForCausalLM.load_weights` maps
    them."""

    vllm_only = frozenset()

    @staticmethod
    def to_vllm(name: str) -> str | None:
        if name == "t2d":
            return None
        if name == "d2t":
            return "draft_id_to_target_id"
        if name.startswith("lm_head."):
            return name
        return "model." + name.replace("midlayer.", "layers.0.", 1)

    @staticmethod
    def relayout(vllm_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """vLLM holds the draft's tensors as the checkpoint does."""
        return tensor

    @staticmethod
    def to_checkpoint(vllm_name: str) -> str:
        if vllm_name == "draft_id_to_target_id":
            return "d2t"
        if vllm_name.startswith("lm_head."):
            return vllm_name
        return vllm_name.removeprefix("model.").replace("layers.0.", "midlayer.", 1)

    @staticmethod
    def unknown_problems(unknown: list[str]) -> list[str]:
        """Why tensors vLLM has no parameter for are missing there, where the reason is known."""
        if "lm_head.weight" not in unknown:
            return []
        return [
            "vLLM shares the target's lm_head with a draft whose lm_head equals the target's when the engine "
            "starts (a full-vocabulary draft fresh from `from_target`), so it cannot be synced on its own: "
            "start the engine from a draft folder whose lm_head differs"
        ]
