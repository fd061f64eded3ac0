"""How a policy's or a draft's checkpoint tensors map onto a vLLM model's parameters, and the check of a whole set.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, drops a tied lm_head, names MoE experts, some
families' tensors (gpt-oss) and a draft's tensors (each drafter family's `vllm_weight_names`) its own way and
transposes gpt-oss's experts; a sync is checked against the layout below before anything reaches vLLM. The layout
itself is described inside vLLM's worker (`vllm_worker.describe_models`), but everything here is plain PyTorch, so
it imports and is tested without vLLM.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


__all__ = ["ModelLayout", "ParamShape", "PolicyNames", "WeightNames"]


# vLLM's fused-MoE layer holds the experts that transformers keeps fused in memory (`gate_up_proj`, `down_proj`)
# under its own names; its loader takes the HF names.
_EXPERTS = (
    (".mlp.experts.gate_up_proj", ".mlp.experts.routed_experts.w13_weight"),
    (".mlp.experts.down_proj", ".mlp.experts.routed_experts.w2_weight"),
)


@dataclass(frozen=True)
class _PolicyFamily:
    """How a vLLM model's policy parameters differ from transformers' in-memory tensors."""

    # (HF piece, vLLM piece) of names, replaced in this order.
    renames: tuple[tuple[str, str], ...] = _EXPERTS
    # Endings of vLLM names held as the HF tensor transposed (last two dimensions).
    transposed: tuple[str, ...] = ()
    # Endings of vLLM names that vLLM's loader writes with a plain copy, past the weight loaders that its in-place
    # reload hooks: a reload would keep the old values, so they are written after it.
    copied: tuple[str, ...] = ()
    # vLLM's loader copies fused experts straight into the parameters too, but takes one expert at a time under
    # vLLM's names (`...mlp.experts.{e}.w13_weight`, "streamed" experts) through the weight loaders.
    streams_experts: bool = False


# Qwen3-MoE's experts are vLLM's w13 [E, 2I, H] (gate rows first) and w2 [E, H, I] as they are; gpt-oss's are
# transposed (gate and up columns interleaved, which vLLM keeps), with biases, and gpt-oss renames more.
_FAMILIES = {
    "GptOssForCausalLM": _PolicyFamily(
        renames=(
            ("model.embed_tokens.", "model.embedding."),
            (".self_attn.", ".attn."),
            (".mlp.experts.gate_up_proj_bias", ".mlp.experts.routed_experts.w13_bias"),
            (".mlp.experts.down_proj_bias", ".mlp.experts.routed_experts.w2_bias"),
            *_EXPERTS,
        ),
        transposed=(".w13_weight", ".w2_weight"),
        copied=(".attn.sinks",),
        streams_experts=True,
    ),
}


def _replaced(name: str, pairs: Iterable[tuple[str, str]]) -> str:
    for old, new in pairs:
        name = name.replace(old, new)
    return name


class PolicyNames:
    """HF in-memory names and layouts as vLLM's: the same apart from the fusions for Llama, Qwen2, Qwen3 and Mistral;
    renamed experts for Qwen3-MoE; renames, transposed experts and tensors written past vLLM's reload for gpt-oss.

    Args:
        tie_word_embeddings: the policy's lm_head is its embedding.
        architecture: vLLM's model class (`ModelLayout.architecture`), which picks the family's differences.
    """

    vllm_only = frozenset()

    def __init__(self, *, tie_word_embeddings: bool, architecture: str = ""):
        self.tie_word_embeddings = tie_word_embeddings
        self.family = _FAMILIES.get(architecture, _PolicyFamily())

    def to_vllm(self, name: str) -> str | None:
        # A tied lm_head is the embedding: vLLM has no parameter for it and its loader skips it.
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return _replaced(name, self.family.renames)

    def to_checkpoint(self, vllm_name: str) -> str:
        return _replaced(vllm_name, ((new, old) for old, new in reversed(self.family.renames)))

    def relayout(self, vllm_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor in the other layout, HF's or vLLM's (a transpose, its own inverse, or nothing)."""
        return tensor.transpose(-2, -1) if vllm_name.endswith(self.family.transposed) else tensor

    def for_loader(
        self, weights: list[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """The weights as vLLM's in-place reload takes them, and those it would skip, by vLLM name."""
        reloaded, copied = [], {}
        for name, tensor in weights:
            vllm_name = self.to_vllm(name) or name  # a tied lm_head goes as it is: vLLM's loader skips it
            if vllm_name.endswith(self.family.copied):
                copied[vllm_name] = tensor
            elif self.family.streams_experts and ".mlp.experts.routed_experts." in vllm_name:
                layer, _, leaf = vllm_name.partition(".mlp.experts.routed_experts.")
                reloaded.extend((f"{layer}.mlp.experts.{e}.{leaf}", expert) for e, expert in enumerate(tensor))
            else:
                reloaded.append((name, tensor))
        return reloaded, copied

    @staticmethod
    def unknown_problems(unknown: list[str]) -> list[str]:
        return []


class WeightNames(Protocol):
    """How one model's checkpoint tensors are named and laid out in vLLM: `PolicyNames`, or a draft family's
    (`DraftModel.vllm_weight_names`)."""

    # vLLM parameters that no checkpoint of the model has (a feature of vLLM's class the model does not use): never
    # synced, never reported missing.
    vllm_only: frozenset[str]

    def to_vllm(self, name: str) -> str | None: ...

    def to_checkpoint(self, vllm_name: str) -> str: ...

    def relayout(self, vllm_name: str, tensor: torch.Tensor) -> torch.Tensor: ...

    def unknown_problems(self, unknown: list[str]) -> list[str]: ...


def _hf_shape(names: WeightNames, vllm_name: str, shape: Sequence[int]) -> list[int]:
    """A shape in vLLM's layout as the checkpoint tensor has it, for messages."""
    return list(names.relayout(vllm_name, torch.empty(tuple(shape), device="meta")).shape)


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
    # vLLM's model class, which tells a policy's names and layouts (`PolicyNames`).
    architecture: str = ""
    # The model config's vocabulary (the target's, for a draft too): where a draft's `d2t` ids must point.
    vocab_size: int | None = None

    def _split(self, vllm_name: str) -> tuple[str, str, str]:
        module_path, _, leaf = vllm_name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        return parent, module, leaf

    def checkpoint_names(self, vllm_name: str, names: WeightNames) -> list[str]:
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
        names: WeightNames,
        what: str,
        complete: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Map checkpoint tensors to vLLM parameters (concatenating fused ones) after checking names and shapes.

        Raises a ValueError naming every checkpoint tensor that is unknown, given twice, missing or
        mis-shaped, so that nothing reaches the engine unless the whole set fits. With `complete=False`
        (part of a set, e.g. one chunk of an upload) missing tensors are allowed and only the parameters
        whose parts are all present are returned.
        """
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
                sources[vllm_name][index] = (name, names.relayout(vllm_name, tensor))

        problems = []
        if unknown:
            problems.append(f"no {what} parameter in vLLM for: {', '.join(unknown)}")
            problems.extend(names.unknown_problems(unknown))
        if duplicated:
            problems.append(f"given more than once: {', '.join(duplicated)}")
        missing = [
            name
            for vllm_name in self.params
            if vllm_name not in names.vllm_only
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
                f"{name} has shape {_hf_shape(names, vllm_name, tensor.shape)}, "
                f"vLLM expects {_hf_shape(names, vllm_name, part_shapes[index])}"
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
