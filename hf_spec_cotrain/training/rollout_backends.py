"""The engines a rollout turn runs on, one per path, each with ``generate(prompt_ids, *, step, training)`` returning a
`BackendTurn` and handling its own weight sync and restarts: TRL's own generation (`TRLGeneration`, plain), the
package's HF-native generator (`HFNativeBackend`), a colocated vLLM engine (`ColocatedVLLMBackend`) and an
``hf-spec-cotrain vllm-serve`` server shared by every process (`ServerBackend`). The pipelined ones are in
`training.pipelined_rollouts`; `SpeculativeRollouts` chooses between a speculative backend and a plain one."""

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from torch import nn
from transformers.utils import logging
from trl.trainer.utils import pad

from ..draft import DraftModel
from ..generation.adaptive import AdaptiveSpeculation, SpeculationPolicy
from ..generation.decoder import eval_mode
from ..generation.engine import EngineRestartedError, EngineUnavailableError, RolloutEngine, SpecDecodeStats
from ..generation.pipelined import PipelinedTarget
from ..generation.speculative import SpeculativeOutput, speculative_generate
from ..parallel.fsdp import full_state_items
from .draft_cotraining import seeded_generator
from .timing import StepTimes


logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class RolloutSampling:
    """What every rollout turn samples with (the trainer's generation settings)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    eos_token_ids: list[int]
    pad_token_id: int
    pad_to_multiple_of: int | None


@dataclass
class BackendTurn:
    """One turn's completions and what the ``spec/*`` metrics are computed from: the generator's counters
    (`SpeculativeOutput` of the HF-native generator, else `SpecDecodeStats`), the seconds it took and, for an
    engine's or a plain call, its (batch size, K)."""

    completions: list[list[int]]
    counters: SpeculativeOutput | SpecDecodeStats
    seconds: float
    engine_call: tuple[int, int] | None = None
    logprobs: list | None = None


@contextmanager
def merged_weights(model: nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`model`'s weights under HF names, LoRA adapters merged in (and unmerged afterwards)."""
    if not is_peft_model(model):
        yield list(model.state_dict().items())
        return
    model.merge_adapter()
    try:
        weights = []
        for name, tensor in model.state_dict().items():
            if "lora_" in name or "original_module" in name:
                continue
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            weights.append((name.replace("modules_to_save.default.", ""), tensor))
        yield weights
    finally:
        model.unmerge_adapter()


def check_greedy_tokens(tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """Raise a ValueError unless each of ``tokens`` [L] is the argmax of its row of ``logits`` [L, V] up to the
    rounding of their dtype (a near-tie may break either way between a batched verification and one forward)."""
    tolerance = max(8 * torch.finfo(logits.dtype).eps, 1e-4) * logits.abs().max().item()
    logits = logits.float()
    shortfall = logits.max(-1).values - logits.gather(-1, tokens[:, None])[:, 0]
    if (shortfall > tolerance).any():
        position = int(shortfall.argmax())
        raise ValueError(
            f"its greedy token {position + 1} ({int(tokens[position])}) is not the argmax of the policy's own logits "
            f"(short by {shortfall[position].item():.3g} > {tolerance:.2g}): the generator's rollouts would not be "
            "the policy's. Its attention may not go through transformers' attention interface, which carries the "
            "generator's cache masks."
        )


class TRLGeneration:
    """TRL's own (plain) generation of a turn, ``generate(prompt_ids) -> (completions, logprobs)``."""

    def __init__(self, generate: Callable[[list[list[int]]], tuple]):
        self._generate = generate

    def prepare(self, step: int) -> None:
        """Nothing to sync before a turn."""

    def generate(
        self, prompt_ids: list[list[int]], *, step: int, training: bool, max_tokens: int | None = None
    ) -> BackendTurn:
        """TRL's turn at TRL's own budget (``max_tokens`` is left to TRL, which cuts a tool-loop turn after it)."""
        started = time.perf_counter()
        completions, logprobs = self._generate(prompt_ids)
        elapsed = time.perf_counter() - started
        return BackendTurn(completions, SpecDecodeStats(), elapsed, (len(prompt_ids), 0), logprobs)


class HFNativeBackend:
    """`speculative_generate` on the policy the trainer is training (``policy()``: the strategy's context that
    unwraps it for generation), with the draft of this very step; through the pipeline's stages where given."""

    def __init__(
        self,
        draft: DraftModel,
        sampling: RolloutSampling,
        *,
        policy: Callable[[], AbstractContextManager[nn.Module]],
        speculation: SpeculationPolicy,
        seed: int,
        draft_sampling: str | None,
        device,
        process_index: int,
        pipeline: PipelinedTarget | None = None,
    ):
        self.draft, self.sampling, self.policy, self.speculation = draft, sampling, policy, speculation
        self.seed, self.draft_sampling, self.device, self.process_index = seed, draft_sampling, device, process_index
        self.pipeline = pipeline
        self._calls: dict[tuple[int, int], int] = {}  # (step, mode): calls so far, this step's only

    def prepare(self, step: int) -> None:
        """Nothing to sync: the generator runs on the trained weights themselves."""

    def call_generator(self, step: int, *, training: bool) -> torch.Generator:
        """This call's randomness, from (seed, step, rank, mode, call): a resumed run samples exactly the rollouts
        the uninterrupted run would have, and each call of a step (a multi-turn rollout's turns, a step's later
        batches) draws afresh, as the policy's law requires, rather than reusing the first call's draws."""
        mode = 0 if training else 1
        calls = {key: count for key, count in self._calls.items() if key[0] == step}  # older steps are done
        index = calls.get((step, mode), 0)
        self._calls = {**calls, (step, mode): index + 1}
        return seeded_generator(self.seed, step, self.process_index, mode, index, device=self.device)

    def probe(self, num_speculative_tokens: int) -> None:
        """Run a few greedy speculative rounds of ``num_speculative_tokens`` on two short prompts of different
        lengths, raising what the generator raises, and check that the longer (unpadded) row's tokens are the argmax
        of the policy's own forward over them, up to rounding: a policy whose layers the generator cannot run, or
        runs wrongly (an attention that ignores the generator's masks, as CodeGen's and Falcon's, which do not go
        through transformers' attention interface), fails here, when the trainer is built, rather than at every
        step's rollouts or silently. No EOS ends it early."""
        vocab_size = self.draft.config.vocab_size
        prompts = [[token % vocab_size for token in range(5, 8)], [9 % vocab_size]]
        padded_ids = pad(
            [torch.tensor(ids) for ids in prompts], padding_value=self.sampling.pad_token_id, padding_side="left"
        )
        attention_mask = pad(
            [torch.ones(len(ids), dtype=torch.long) for ids in prompts], padding_value=0, padding_side="left"
        )
        with self.policy() as model, torch.no_grad(), eval_mode(model):
            sequence = speculative_generate(
                model,
                self.draft,
                padded_ids.to(self.device),
                attention_mask.to(self.device),
                max_new_tokens=2 * num_speculative_tokens + 2,
                num_speculative_tokens=num_speculative_tokens,
                eos_token_id=[],
                pad_token_id=self.sampling.pad_token_id,
            ).sequences[:1]
            logits = model(input_ids=sequence).logits[0, len(prompts[0]) - 1 : -1]
        check_greedy_tokens(sequence[0, len(prompts[0]) :], logits)

    def generate(
        self, prompt_ids: list[list[int]], *, step: int, training: bool, max_tokens: int | None = None
    ) -> BackendTurn:
        """The completions (up to and including the first EOS, at most ``max_tokens``: by default the sampling's), the
        generator's output and the seconds it took."""
        sampling, device = self.sampling, self.device

        def left_padded(rows: list[torch.Tensor], value: int) -> torch.Tensor:
            return pad(
                rows, padding_value=value, padding_side="left", pad_to_multiple_of=sampling.pad_to_multiple_of
            ).to(device)

        padded_ids = left_padded([torch.tensor(ids) for ids in prompt_ids], sampling.pad_token_id)
        attention_mask = left_padded([torch.ones(len(ids), dtype=torch.long) for ids in prompt_ids], 0)
        generator = self.call_generator(step, training=training)
        started = time.perf_counter()
        with self.policy() as model, torch.no_grad():
            out = speculative_generate(
                model,
                self.draft,
                padded_ids,
                attention_mask,
                max_new_tokens=max_tokens or sampling.max_tokens,
                num_speculative_tokens=self.speculation,
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                draft_sampling=self.draft_sampling,
                eos_token_id=sampling.eos_token_ids,
                pad_token_id=sampling.pad_token_id,
                generator=generator,
                pipeline=self.pipeline,
            )
        elapsed = time.perf_counter() - started
        completion_ids = out.sequences[:, padded_ids.shape[1] :]
        is_eos = torch.isin(completion_ids, torch.tensor(sampling.eos_token_ids, device=completion_ids.device))
        # Keep tokens up to and including the first EOS, as TRL does after generate(); only padding follows it.
        keep = (is_eos.cumsum(1) - is_eos.int()) == 0
        completions = [row[mask].tolist() for row, mask in zip(completion_ids.cpu(), keep.cpu())]
        return BackendTurn(completions, out, elapsed)


class VLLMBackend:
    """Rollouts from a vLLM engine that holds the policy and the draft, pushed into it once per step (`sync`) and
    again after it restarted (`after_restart`); one out of reach stops the run.

    Args:
        engine: the engine (`build_rollout_engine`).
        weights: returns the policy's weights as the engine takes them (`merged_weights`), as a context.
        speculation: the rollouts' K policy; an engine that can change K gets the cost model's choice per call.
        max_draft_tokens: K of an engine that cannot change it.
        output_dir: where the run's checkpoints are (the error that stops the run names it).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        draft: DraftModel,
        sampling: RolloutSampling,
        accelerator,
        *,
        weights: Callable[[], AbstractContextManager[list]],
        speculation: SpeculationPolicy,
        max_draft_tokens: int,
        output_dir: str,
        step_times: StepTimes,
    ):
        self.engine, self.draft, self.sampling, self.accelerator = engine, draft, sampling, accelerator
        self.weights, self.speculation, self.max_draft_tokens = weights, speculation, max_draft_tokens
        self.output_dir, self.step_times = output_dir, step_times
        self.synced_step = -1
        self.calls = 0

    def prepare(self, step: int) -> None:
        """Nothing before the turn: the turn itself pushes this step's weights."""

    def generate(
        self, prompt_ids: list[list[int]], *, step: int, training: bool, max_tokens: int | None = None
    ) -> BackendTurn:
        try:
            try:
                return self.engine_turn(prompt_ids, step=step, max_tokens=max_tokens)
            except EngineRestartedError as restarted:
                return self.after_restart(restarted, prompt_ids, step=step, max_tokens=max_tokens)
        except EngineUnavailableError as error:
            raise self.stopped(error, step) from error

    def after_restart(
        self, restarted: EngineRestartedError, prompt_ids, *, step: int, max_tokens: int | None = None
    ) -> BackendTurn:
        """Push the policy and the draft again, then serve the turn."""
        logger.warning(f"{restarted} Pushing the policy and the draft again, then serving this turn.")
        self.synced_step = -1
        return self.engine_turn(prompt_ids, step=step, max_tokens=max_tokens)

    def stopped(self, error: EngineUnavailableError, step: int) -> EngineUnavailableError:
        """The error that stops the run once the engine cannot be reached, saying how to resume."""
        return EngineUnavailableError(
            f"{error} Training stopped at step {step}; the checkpoints in {self.output_dir} are as saved. "
            "Once the server is back, resume with resume_from_checkpoint=True."
        )

    def engine_turn(self, prompt_ids: list[list[int]], *, step: int, max_tokens: int | None = None) -> BackendTurn:
        if step != self.synced_step:
            with self.step_times.measure("weight_sync"):
                self.sync()
            self.synced_step = step
        sampling = self.sampling
        k = self.engine_k(len(prompt_ids))
        started = time.perf_counter()
        out = self.engine.generate(
            prompt_ids,
            max_tokens=max_tokens or sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )
        elapsed = time.perf_counter() - started
        num_tokens = sum(map(len, out.completion_ids))
        # An engine's first call also sets up its drafting (3-4x slower on vLLM-CPU): not a sample of its cost.
        if self.adapts_k and self.calls:
            observe_engine_call(self.speculation, len(prompt_ids), k, out.spec_decode, num_tokens, elapsed)
        self.calls += 1
        return BackendTurn(out.completion_ids, out.spec_decode, elapsed, (len(prompt_ids), k))

    @property
    def adapts_k(self) -> bool:
        return isinstance(self.speculation, AdaptiveSpeculation) and getattr(
            self.engine, "adaptive_speculation", False
        )

    def engine_k(self, batch_size: int) -> int:
        """K of this engine call: the cost model's choice for the call's batch when the engine can change it."""
        if not self.adapts_k:
            return self.max_draft_tokens
        k = self.speculation.choose(batch_size)
        self.engine.set_num_speculative_tokens(k)
        return k

    def sync(self) -> None:
        """Push the policy and the draft into the engine."""
        with self.weights() as weights:
            self.engine.sync_weights("policy", weights)
        self.engine.sync_weights("draft", full_state_items(self.draft))


class ColocatedVLLMBackend(VLLMBackend):
    """A vLLM engine in this process: it takes this process's policy and draft."""


class ServerBackend(VLLMBackend):
    """An ``hf-spec-cotrain vllm-serve`` server that every process shares: the main process pushes, once."""

    def sync(self) -> None:
        if self.accelerator.is_main_process:
            super().sync()
        else:  # a sharded draft is gathered tensor by tensor, a collective that every rank joins
            for _ in full_state_items(self.draft):
                pass
        self.accelerator.wait_for_everyone()

    def after_restart(
        self, restarted: EngineRestartedError, prompt_ids, *, step: int, max_tokens: int | None = None
    ) -> BackendTurn:
        if self.accelerator.num_processes > 1:
            raise EngineRestartedError(
                f"{restarted} {self.accelerator.num_processes} training processes share this server and "
                "push into it from the main one only, between steps: the run cannot re-sync it now. Resume "
                "from the last checkpoint (resume_from_checkpoint=True)."
            ) from restarted
        return super().after_restart(restarted, prompt_ids, step=step, max_tokens=max_tokens)


def observe_engine_call(
    model: AdaptiveSpeculation, batch_size: int, k: int, counters, num_tokens: int, seconds: float
) -> None:
    """Feed the cost model one engine call as its average decoding step: the engine reports no per-step times, so
    the draft's share stays in the step's time (the model's cost of K + 1 tokens carries it)."""
    row_steps = engine_row_steps(counters, k, num_tokens)
    if not row_steps:
        return
    steps = max(row_steps / batch_size, 1.0)
    model.observe_round(
        batch_size, k, seconds=seconds / steps, draft_seconds=0.0, tokens_per_row=num_tokens / row_steps
    )
    if k:
        accepted = list(counters.accepted_per_position)[:k]
        reached = [counters.num_drafts, *accepted[:-1]]  # a position is reached once the one before is accepted
        model.observe_acceptance(reached, accepted)


def engine_row_steps(counters, k: int, num_tokens: int) -> int:
    """Decoding steps of an engine (or plain) call summed over its rows: every running row drafts once per step when
    K >= 1, and emits one token per step when K = 0."""
    return counters.num_drafts if k else num_tokens


def build_rollout_engine(draft: DraftModel, args, *, policy: nn.Module, tokenizer, max_num_seqs: int) -> RolloutEngine:
    """The vLLM engine (policy + draft) of speculative vLLM rollouts: colocated in this process, once vLLM's registry
    says it can serve them there (`check_colocated_vllm_can_serve`), or a client of an ``hf-spec-cotrain vllm-serve``
    server (``vllm_mode="server"``), which checks its own at start."""
    if args.vllm_mode == "server":
        from ..generation.client import VLLMServerClient

        base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        client = VLLMServerClient(
            base_url,
            timeout=max(args.vllm_server_timeout, 600.0),
            api_key=args.vllm_server_api_key,
            reconnect_timeout=args.vllm_server_timeout,
        )
        client.wait_until_ready(timeout=args.vllm_server_timeout)
        if args.num_speculative_tokens == "auto":
            logger.warning(
                "num_speculative_tokens='auto' with vllm_mode='server': the server speculates the fixed K it was "
                "started with (spec/num_speculative_tokens shows it); colocated vLLM and HF-native rollouts adapt K."
            )
        return client
    from ..generation.vllm_engine import VLLMRolloutEngine
    from ..generation.vllm_support import check_colocated_vllm_can_serve

    check_colocated_vllm_can_serve(policy, draft)  # before anything is written or started
    policy_folder = Path(policy.config._name_or_path or "")
    if not (policy_folder / "config.json").exists():  # a model built in memory: vLLM needs a folder
        policy_folder = Path(args.output_dir) / "rollout_policy_init"
        policy.save_pretrained(policy_folder)
        tokenizer.save_pretrained(policy_folder)
    # The engine starts from a bootstrap draft (one whose every weight vLLM keeps its own, `vllm_bootstrap_state_dict`)
    # and gets the real weights at its first sync.
    draft_folder = Path(args.output_dir) / "rollout_draft_init"
    draft.save_pretrained(draft_folder, state_dict=draft.vllm_bootstrap_state_dict())
    draft_sample_method, rejection_sample_method = vllm_sampling_methods(draft, args)
    adaptive = args.num_speculative_tokens == "auto"
    eager = {}
    if adaptive and torch.cuda.is_available():
        logger.warning(
            "num_speculative_tokens='auto' runs the colocated vLLM engine without CUDA graphs (enforce_eager=True), "
            "so that K can change between calls; a fixed num_speculative_tokens keeps them."
        )
        eager = {"enforce_eager": True}
    return VLLMRolloutEngine(
        policy_folder,
        draft_model=draft_folder,
        num_speculative_tokens=args.max_draft_tokens,
        adaptive_speculation=adaptive,
        **eager,
        draft_sample_method=draft_sample_method,
        rejection_sample_method=rejection_sample_method,
        seed=args.seed,
        max_model_len=args.vllm_max_model_length,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
    )


def vllm_sampling_methods(draft: DraftModel, args) -> tuple[str | None, str | None]:
    """vLLM's draft/rejection sampling methods: probabilistic drafting whenever vLLM accepts it."""
    if args.vllm_draft_sample_method is not None:
        return args.vllm_draft_sample_method, args.vllm_rejection_sample_method
    wanted = args.draft_sampling or "probabilistic"
    if wanted == "probabilistic" and draft.config.draft_vocab_size < draft.config.vocab_size:
        logger.warning(
            "vLLM 0.31 refuses probabilistic drafting with a reduced draft vocabulary (draft_vocab_size="
            f"{draft.config.draft_vocab_size} < {draft.config.vocab_size}): vLLM rollouts use greedy "
            "drafting, whose acceptance collapses at temperature ~1. Use the full vocabulary to avoid this."
        )
        wanted = "greedy"
    return wanted, args.vllm_rejection_sample_method or "standard"


__all__ = [
    "BackendTurn",
    "ColocatedVLLMBackend",
    "HFNativeBackend",
    "RolloutSampling",
    "ServerBackend",
    "TRLGeneration",
    "VLLMBackend",
    "build_rollout_engine",
    "engine_row_steps",
    "merged_weights",
    "observe_engine_call",
    "vllm_sampling_methods",
]
