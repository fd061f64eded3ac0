"""How a policy's or a draft's checkpoint tensors map onto a vLLM model's parameters, and the check of a whole set.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, drops a tied lm_head and names the EAGLE-3 draft's
tensors its own way; a sync is checked against the layout below before anything reaches vLLM. The layout itself
is described inside vLLM's worker (`vllm_worker.describe_models`), but everything here is plain PyTorch, so it
imports and is tested without vLLM.
"""

from dataclasses import dataclass

import torch


__all__ = ["DraftNames", "ModelLayout", "ParamShape", "PolicyNames"]


# vLLM's fused-MoE layer holds the experts that transformers keeps fused in memory (`gate_up_proj` [E, 2I, H], gate
# rows first, and `down_proj` [E, H, I]) in the same layout under its own names; its loader takes the HF names.
_HF_TO_VLLM_EXPERTS = {
    ".mlp.experts.gate_up_proj": ".mlp.experts.routed_experts.w13_weight",
    ".mlp.experts.down_proj": ".mlp.experts.routed_experts.w2_weight",
}
_VLLM_TO_HF_EXPERTS = {vllm: hf for hf, vllm in _HF_TO_VLLM_EXPERTS.items()}
# vLLM models whose layout differs from transformers' beyond what the names above map, with why and what to do.
_UNSYNCABLE_POLICIES = {
    "GptOssForCausalLM": (
        "vLLM's gpt-oss names and lays out its tensors its own way (`model.embedding`, `attn.*`, experts' gate/up "
        "and down transposed, with biases), and its loader writes the unquantised experts and the attention sinks "
        "with a plain copy that bypasses the parameters' weight loaders, where vLLM's in-place reload hooks in: a "
        "reload keeps the old experts and sinks. The HF-native generator refuses gpt-oss too (its sliding-window "
        "layers), so a gpt-oss policy co-trains its draft with plain rollouts only (speculative_decoding=False)"
    ),
}


def _renamed(name: str, suffixes: dict[str, str]) -> str:
    for suffix, replacement in suffixes.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + replacement
    return name


class PolicyNames:
    """HF names are vLLM's for the supported families (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE) apart from the
    fusions and the fused-MoE experts."""

    def __init__(self, *, tie_word_embeddings: bool):
        self.tie_word_embeddings = tie_word_embeddings

    def to_vllm(self, name: str) -> str | None:
        # A tied lm_head is the embedding: vLLM has no parameter for it and its loader skips it.
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return _renamed(name, _HF_TO_VLLM_EXPERTS)

    def to_checkpoint(self, vllm_name: str) -> str:
        return _renamed(vllm_name, _VLLM_TO_HF_EXPERTS)


class DraftNames:
    """EAGLE-3 checkpoint names (docs/design.md section 3) as vLLM's `Eagle3LlamaForCausalLM.load_weights` maps
    them."""

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
    def to_checkpoint(vllm_name: str) -> str:
        if vllm_name == "draft_id_to_target_id":
            return "d2t"
        if vllm_name.startswith("lm_head."):
            return vllm_name
        return vllm_name.removeprefix("model.").replace("layers.0.", "midlayer.", 1)


@dataclass
class ParamShape:
    """The logical shape of one vLLM parameter (unpacked, unpadded), as a sync must provide it."""

    shape: tuple[int, ...]
    # Shapes of the checkpoint tensors concatenated (dim 0) into this parameter, for fused layers.
    part_shapes: list[tuple[int, ...]] | None = None


@dataclass
class ModelLayout:
    """The parameters a sync must provide, in vLLM's names and logical (unpacked, unpadded) shapes."""

    params: dict[str, ParamShape]
    packed_modules: dict[str, list[str]]
    tie_word_embeddings: bool
    # vLLM's model class: a policy in _UNSYNCABLE_POLICIES is refused before its names are checked.
    architecture: str = ""

    def _split(self, vllm_name: str) -> tuple[str, str, str]:
        module_path, _, leaf = vllm_name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        return parent, module, leaf

    def checkpoint_names(self, vllm_name: str, names: PolicyNames | DraftNames) -> list[str]:
        """The checkpoint tensors that make up a vLLM parameter (several for a fused one)."""
        parent, module, leaf = self._split(vllm_name)
        if module not in self.packed_modules:
            return [names.to_checkpoint(vllm_name)]
        return [
            names.to_checkpoint(".".join(filter(None, (parent, part, leaf)))) for part in self.packed_modules[module]
        ]

    def fuse_and_check(
        self,
        weights: list[tuple[str, torch.Tensor]],
        *,
        names: PolicyNames | DraftNames,
        what: str,
        complete: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Map checkpoint tensors to vLLM parameters (concatenating fused ones) after checking names and shapes.

        Raises a ValueError naming every checkpoint tensor that is unknown, given twice, missing or
        mis-shaped, so that nothing reaches the engine unless the whole set fits. With `complete=False`
        (part of a set, e.g. one chunk of an upload) missing tensors are allowed and only the parameters
        whose parts are all present are returned.
        """
        if isinstance(names, PolicyNames) and self.architecture in _UNSYNCABLE_POLICIES:
            raise ValueError(
                f"Cannot sync the {what} weights of vLLM's {self.architecture}: "
                f"{_UNSYNCABLE_POLICIES[self.architecture]}."
            )
        fused_of = {part: fused for fused, parts in self.packed_modules.items() for part in parts}
        sources: dict[str, dict[int, tuple[str, torch.Tensor]]] = {}
        unknown, duplicated = [], []
        for name, tensor in weights:
            vllm_name = names.to_vllm(name)
            if vllm_name is None:
                continue
            parent, module, leaf = self._split(vllm_name)
            index = 0
            if module in fused_of:
                index = self.packed_modules[fused_of[module]].index(module)
                vllm_name = ".".join(filter(None, (parent, fused_of[module], leaf)))
            if vllm_name not in self.params:
                unknown.append(name)
            elif index in sources.setdefault(vllm_name, {}):
                duplicated.append(name)
            else:
                sources[vllm_name][index] = (name, tensor)

        problems = []
        if unknown:
            problems.append(f"no {what} parameter in vLLM for: {', '.join(unknown)}")
            if isinstance(names, DraftNames) and "lm_head.weight" in unknown:
                problems.append(
                    "vLLM shares the target's lm_head with a draft whose lm_head equals the target's when the engine "
                    "starts (a full-vocabulary draft fresh from `from_target`), so it cannot be synced on its own: "
                    "start the engine from a draft folder whose lm_head differs"
                )
        if duplicated:
            problems.append(f"given more than once: {', '.join(duplicated)}")
        missing = [
            name
            for vllm_name in self.params
            for index, name in enumerate(self.checkpoint_names(vllm_name, names))
            if index not in sources.get(vllm_name, {})
        ]
        if missing and complete:
            problems.append(f"missing: {', '.join(missing)}")
        expected = {}
        for vllm_name, parts in sources.items():
            spec = self.params[vllm_name]
            part_shapes = spec.part_shapes or [spec.shape]
            wrong = [
                f"{name} has shape {list(tensor.shape)}, vLLM expects {list(part_shapes[index])}"
                for index, (name, tensor) in sorted(parts.items())
                if tuple(tensor.shape) != part_shapes[index]
            ]
            problems.extend(wrong)
            if not wrong and len(parts) == len(part_shapes):
                tensors = [tensor for _, (_, tensor) in sorted(parts.items())]
                expected[vllm_name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        if problems:
            raise ValueError(f"Cannot sync the {what} weights, nothing was sent to vLLM: " + "; ".join(problems))
        return expected
