"""`SpeculativeRollouts`: the trainer's speculative rollout turns with the draft of the current step, and what they
measure; `build_rollouts` builds them with the backends of the run's path (`training.rollout_backends`,
`training.pipelined_rollouts`), once.

A turn runs on the speculative backend (HF-native, pipelined HF-native, colocated vLLM, a server, a server that the
pipeline's stages push into); adaptive speculation may choose the plain backend for a batch instead, and a turn that
fails falls back to it (logged and counted in ``spec/fallback``). The turns of one batch of rollouts (a multi-turn
rollout's tool turns included: `SpeculativeRollouts.generation_batch`) add up their counters, and the batch logs the
``spec/*`` metrics once, weighted by tokens and verifications. An engine that cannot be reached stops the run
(`EngineUnavailableError`).
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
from accelerate.utils import gather
from torch import nn
from transformers.utils import logging

from ..draft import DraftModel
from ..generation.adaptive import AdaptiveSpeculation, FixedSpeculation, PlainDecoding, SpeculationPolicy
from ..generation.engine import EngineRestartedError, EngineUnavailableError, RolloutEngine, SpecDecodeStats
from ..generation.pipelined import PipelinedTarget
from ..generation.speculative import SpeculativeOutput, check_speculative_target
from .pipelined_rollouts import PipelinedRanks, PipelinedServerBackend
from .rollout_backends import (
    BackendTurn,
    ColocatedVLLMBackend,
    HFNativeBackend,
    RolloutSampling,
    ServerBackend,
    TRLGeneration,
    engine_row_steps,
    merged_weights,
)
from .timing import StepTimes


logger = logging.get_logger(__name__)

# Speculative turns failing this many times in a row get one error in the log, besides each turn's warning.
FALLBACKS_BEFORE_ERROR = 3


class ThisProcess:
    """Each process generates its own rows."""

    def generate(self, prompt_ids, generate_all: Callable):
        return generate_all(prompt_ids)


@dataclass
class BatchCounters:
    """What the speculative turns of one batch of rollouts add up to on this process: summed over its turns, then
    over the processes, so that every ``spec/*`` value of the batch is weighted by what it measures (acceptance by
    verifications, throughput by tokens and seconds, K and the speed-ups by decoding rounds)."""

    turns: int = 0
    fallbacks: int = 0
    drafts: float = 0.0
    accepted: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    row_rounds: float = 0.0  # decoding rounds summed over rows
    plain_row_rounds: float = 0.0  # those of them with K = 0
    k_sum: float = 0.0  # K summed over row rounds
    predicted_rows: float = 0.0  # row rounds the cost model predicted a speed-up for, and the sum of its predictions
    predicted_sum: float = 0.0
    measured_rows: float = 0.0
    measured_sum: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)  # one per draft position up to the largest K

    def as_list(self) -> list[float]:
        """The counters as one vector (of the same length on every process: the positions are the largest K's)."""
        return [float(getattr(self, name)) for name in self.scalars()] + self.accepted_per_position

    @classmethod
    def from_list(cls, values: list[float]) -> "BatchCounters":
        names = cls.scalars()
        return cls(**dict(zip(names, values[: len(names)])), accepted_per_position=list(values[len(names) :]))

    @classmethod
    def scalars(cls) -> list[str]:
        return [item.name for item in fields(cls) if item.name != "accepted_per_position"]


class SpeculativeRollouts:
    """Speculative rollout turns for one training process.

    Args:
        draft: the co-trained draft (the very object the trainer updates).
        args: the trainer's `SpecCoTrainConfig`.
        accelerator: the trainer's accelerator (device, process index, gathering of metrics).
        backend: what speculative turns run on.
        plain: what plain turns run on (adaptive speculation's choice, a failed speculative turn's fallback).
        speculation: K per round or per call (`AdaptiveSpeculation`, `FixedSpeculation`), shared with `backend`.
        metrics: the trainer's ``_metrics`` (mode -> name -> list of values), where ``spec/*`` values go.
        policy: returns the policy as the accelerator unwraps it (PEFT wrapper kept), whose weights an engine takes.
        engine: the vLLM engine of `backend`, if any.
        ranks: who generates whose rows (`ThisProcess`, or the pipeline's driver for every rank, `PipelinedRanks`).
        generates_plain_turns: the trainer's plain turns run here too (no rank holds the whole policy to run TRL's).
    """

    def __init__(
        self,
        draft: DraftModel,
        args,
        accelerator,
        *,
        backend,
        plain,
        speculation: SpeculationPolicy,
        metrics,
        policy: Callable[[], nn.Module],
        engine: RolloutEngine | None = None,
        ranks: ThisProcess | PipelinedRanks | None = None,
        generates_plain_turns: bool = False,
    ):
        self.draft, self.args, self.accelerator = draft, args, accelerator
        self.backend, self.plain, self.speculation = backend, plain, speculation
        self.metrics, self.policy, self.engine = metrics, policy, engine
        self.ranks = ranks or ThisProcess()
        self.generates_for_all_ranks = isinstance(self.ranks, PipelinedRanks)
        self.generates_plain_turns = generates_plain_turns
        self.acceptance_history: list[tuple[int, float]] = []
        self._last_history_counts: tuple[float, float] | None = None  # (drafts, accepted) of the last entry
        self._batch: BatchCounters | None = None
        self._fallbacks_in_a_row = 0

    def check_can_serve(self, policy: nn.Module) -> None:
        """Refuse at start a policy this rollout path cannot serve, rather than falling back at every step: the
        HF-native generator verifies full and sliding-window attention layers and the linear-attention layers of
        Qwen3.5 and Qwen3-Next (`check_speculative_target`), and must run a trial generation on the policy that
        follows the policy's own argmax (`HFNativeBackend.probe`: what its attention or cache cannot do shows here);
        the vLLM engine (colocated or a server) must hold a parameter for every policy tensor, of the same shape."""
        family = policy.config.get_text_config().model_type
        hf_native_error = None
        try:
            check_speculative_target(policy.config)
        except ValueError as error:
            hf_native_error = error
        if self.engine is None:
            if hf_native_error is None and not self.generates_for_all_ranks:
                try:
                    self.backend.probe(self.args.max_draft_tokens)
                except Exception as error:  # whatever it is, it would happen at every step
                    hf_native_error = f"a trial speculative generation failed ({type(error).__name__}: {error})."
            if hf_native_error is not None:
                raise ValueError(
                    f"HF-native speculative rollouts cannot serve this {family} policy: {hf_native_error} Use "
                    "use_vllm=True (the engine checks at start that it can take the policy's weights), or "
                    "speculative_decoding=False to co-train the draft with plain rollouts."
                )
            return
        with self.policy_weights() as weights:
            shapes = [(name, tensor.shape) for name, tensor in weights]
        if self.generates_for_all_ranks:  # pipeline parallelism: each rank holds its stage, the engine all of them
            stages = [None] * dist.get_world_size()
            dist.all_gather_object(stages, shapes)
            shapes = [named_shape for stage in stages for named_shape in stage]
        try:
            self.engine.check_weights("policy", shapes)
        except ValueError as error:
            instead = (
                "use_vllm=False (the HF-native generator) serves it"
                if hf_native_error is None
                else "speculative_decoding=False co-trains the draft with plain rollouts"
            )
            raise ValueError(
                f"The vLLM engine cannot take this {family} policy's weights, so every step would fall back "
                f"to plain generation: {error}. Instead, {instead}."
            ) from error

    @property
    def context_ceiling(self) -> int | None:
        """The most tokens a conversation may hold in this process's colocated engine (``vllm_max_model_length``,
        or what vLLM inferred from the policy); None without one: HF-native rollouts, or a server's client, which
        does not know the server's limit (TRL's tool loop does not read its own server's either)."""
        return getattr(self.engine, "max_model_len", None)

    def check_fits_context(self, prompt_ids: list[list[int]]) -> None:
        """Refuse a prompt that leaves no room in the engine's context for one generated token: vLLM would refuse it
        at every step, each step falling back to plain generation. (TRL's tool loop keeps the later turns of a
        conversation within the ceiling: `SpecCoTrainGRPOTrainer._tool_call_loop`.)"""
        ceiling = self.context_ceiling
        longest = max(map(len, prompt_ids), default=0)
        if ceiling is not None and longest >= ceiling:
            raise ValueError(
                f"A rollout prompt of {longest} tokens leaves no room in the colocated vLLM engine's context "
                f"(vllm_max_model_length={ceiling} tokens, prompt and completion together): vLLM refuses it, and "
                f"every step would fall back to plain generation. Set vllm_max_model_length above {longest} (at most "
                "the policy's max_position_embeddings), or shorten the prompts."
            )

    @contextmanager
    def policy_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The policy's weights under HF names, LoRA adapters merged in (and unmerged afterwards)."""
        with merged_weights(self.policy()) as weights:
            yield weights

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        step: int,
        training: bool,
        speculative: bool = True,
        max_tokens: int | None = None,
    ) -> tuple[list[list[int]], list | None]:
        """Completions of one turn (and their log-probs where the plain backend returns them): speculative with this
        step's draft, or plain (``speculative=False``) where the trainer's plain turns run here too; at most
        ``max_tokens`` each (default: the sampling's budget)."""
        with self.generation_batch(step=step, training=training):
            if speculative:
                self.backend.prepare(step)  # on every rank: the pipeline's stages push their weights together
            return self.ranks.generate(
                prompt_ids,
                lambda rows: self.turn(
                    rows, step=step, training=training, speculative=speculative, max_tokens=max_tokens
                ),
            )

    @contextmanager
    def generation_batch(self, *, step: int, training: bool) -> Iterator[None]:
        """One batch of rollouts, every turn of it (the trainer opens it around TRL's ``_generate``, whose tool loop
        runs a turn per tool call): the turns add up their counters, and on leaving, the ``spec/*`` metrics get one
        value each and the acceptance history one entry, weighted by what each turn measured. A turn outside any
        batch is its own. Every process must enter and leave it (leaving sums the counters over the processes);
        nested, it is the outer one."""
        if self._batch is not None:
            yield
            return
        self._batch = BatchCounters(accepted_per_position=[0.0] * self.args.max_draft_tokens)
        try:
            yield
            batch = self._batch
        finally:
            self._batch = None
        self._log_batch(batch, step=step, training=training)

    def turn(
        self,
        prompt_ids: list[list[int]],
        *,
        step: int,
        training: bool,
        speculative: bool = True,
        max_tokens: int | None = None,
    ):
        """This process's turn over `prompt_ids`: on the plain backend when adaptive speculation expects plain
        decoding to be fastest for this batch, or when the speculative turn fails, so the run goes on and loses
        nothing."""
        budget = dict(step=step, training=training, max_tokens=max_tokens)
        if not speculative:
            turn = self.plain.generate(prompt_ids, **budget)
            return turn.completions, turn.logprobs
        self.check_fits_context(prompt_ids)
        try:
            adaptive = isinstance(self.speculation, AdaptiveSpeculation)
            if self.engine is None and adaptive and self.speculation.prefers_plain(len(prompt_ids)):
                turn = self.plain.generate(prompt_ids, **budget)
                # Logged as one plain call, whatever decoded it.
                turn.counters, turn.engine_call = SpecDecodeStats(), (len(prompt_ids), 0)
                plain = True
            else:
                turn = self.backend.generate(prompt_ids, **budget)
                plain = False
            self._fallbacks_in_a_row = 0
        except (EngineUnavailableError, EngineRestartedError):
            raise  # plain generation would hide that the engine is gone, at every step: stop instead
        except Exception as err:
            self._fallbacks_in_a_row += 1
            logger.warning(f"Speculative rollout failed ({type(err).__name__}: {err}); plain generation this step.")
            if self._fallbacks_in_a_row == FALLBACKS_BEFORE_ERROR:
                logger.error(
                    f"Speculative rollouts have failed {FALLBACKS_BEFORE_ERROR} times in a row: this run is training "
                    "WITHOUT speculation (spec/fallback counts the plain turns). The last failure is above."
                )
            self._batch.fallbacks += 1
            turn = self.plain.generate(prompt_ids, **budget)
            return turn.completions, turn.logprobs
        self._observe(turn, len(prompt_ids), plain=plain)
        self._count(turn.counters, sum(map(len, turn.completions)), turn.seconds, engine_call=turn.engine_call)
        return turn.completions, turn.logprobs

    def _observe(self, turn: BackendTurn, batch_size: int, *, plain: bool) -> None:
        """Feed adaptive speculation a HF-native or plain call's speed (an engine's backend feeds its own calls)."""
        if isinstance(self.speculation, AdaptiveSpeculation) and (plain or self.engine is None):
            num_tokens = sum(map(len, turn.completions))
            self.speculation.observe_call(batch_size, plain=plain, seconds=turn.seconds, num_tokens=num_tokens)

    def _count(self, counters, num_tokens: int, elapsed: float, *, engine_call: tuple[int, int] | None = None):
        """Add one turn's counters (`SpeculativeOutput` or `SpecDecodeStats`) to the open batch. Acceptance is over
        the rounds that drafted (K >= 1); the rounds of K = 0 are counted apart, for ``spec/plain_round_share``."""
        batch = self._batch
        row_rounds, plain_row_rounds = _row_rounds(counters, num_tokens, engine_call)
        batch.turns += 1
        batch.drafts += counters.num_drafts
        batch.accepted += counters.num_accepted_tokens
        batch.tokens += num_tokens
        batch.seconds += elapsed
        batch.row_rounds += row_rounds
        batch.plain_row_rounds += plain_row_rounds
        for position, accepted_at in enumerate(list(counters.accepted_per_position)[: self.args.max_draft_tokens]):
            batch.accepted_per_position[position] += float(accepted_at)
        # (row rounds, live rows, K) of each round: an engine's or a plain call is one round of its batch and K,
        # weighted by the row rounds it ran
        if isinstance(counters, SpeculativeOutput):
            rounds = [(live, live, k) for live, k in counters.rounds]
        else:
            rounds = [(row_rounds, *engine_call)]
        batch.k_sum += sum(weight * k for weight, _, k in rounds)
        if isinstance(self.speculation, AdaptiveSpeculation):
            model = self.speculation
            for name, estimate in (("predicted", model.predicted_speedup), ("measured", model.measured_speedup)):
                known = [(weight, value) for weight, live, k in rounds if not math.isnan(value := estimate(live, k))]
                setattr(batch, f"{name}_rows", getattr(batch, f"{name}_rows") + sum(weight for weight, _ in known))
                setattr(batch, f"{name}_sum", getattr(batch, f"{name}_sum") + sum(weight * v for weight, v in known))

    def _log_batch(self, batch: BatchCounters, *, step: int, training: bool) -> None:
        """The batch's ``spec/*`` metrics, its counters summed over the processes that generated, and its entry in
        the acceptance history (training batches; NaN for a batch that drafted nothing). A batch that drafted
        nothing logs no acceptance (TRL's `log` then averages the batches that did)."""
        local = torch.tensor(batch.as_list(), device=self.accelerator.device, dtype=torch.float64)
        # Under pipeline parallelism only the driver counted: the sum over the world is its counters, on every rank.
        total = BatchCounters.from_list(gather(local.unsqueeze(0)).sum(0).tolist())
        metrics = self.metrics["train" if training else "eval"]
        if total.fallbacks:
            metrics["spec/fallback"].append(total.fallbacks)
        if not total.turns:
            return
        acceptance = math.nan
        if total.drafts:
            acceptance = 1.0 + total.accepted / total.drafts
            metrics["spec/acceptance_length"].append(acceptance)
            for position, accepted_at in enumerate(total.accepted_per_position):
                metrics[f"spec/accepted_per_position_{position}"].append(accepted_at / total.drafts)
        if total.row_rounds:
            metrics["spec/plain_round_share"].append(total.plain_row_rounds / total.row_rounds)
            metrics["spec/num_speculative_tokens"].append(total.k_sum / total.row_rounds)
        generating_processes = 1 if self.generates_for_all_ranks else self.accelerator.num_processes
        if total.seconds:
            metrics["spec/tokens_per_second"].append(total.tokens / (total.seconds / generating_processes))
        for name in ("predicted", "measured"):
            if getattr(total, f"{name}_rows"):
                metrics[f"spec/{name}_speedup"].append(getattr(total, f"{name}_sum") / getattr(total, f"{name}_rows"))
        if training:
            self._add_to_history(step, total)

    def _add_to_history(self, step: int, total: BatchCounters) -> None:
        """One acceptance entry per optimizer step: a step's later batch (steps_per_generation below the
        accumulation steps) merges into its entry, weighted by verifications."""
        # `step` is TRL's global_step, still the previous one while rollouts run: the step they feed is the next,
        # numbered from 1 as TRL logs it.
        step += 1
        drafts, accepted = total.drafts, total.accepted
        if self.acceptance_history and self.acceptance_history[-1][0] == step and self._last_history_counts:
            self.acceptance_history.pop()
            drafts, accepted = drafts + self._last_history_counts[0], accepted + self._last_history_counts[1]
        self._last_history_counts = (drafts, accepted)
        self.acceptance_history.append((step, 1.0 + accepted / drafts if drafts else math.nan))


def _row_rounds(counters, num_tokens: int, engine_call: tuple[int, int] | None) -> tuple[int, int]:
    """A turn's decoding rounds summed over rows (one per row and target forward), and those of them with K = 0: the
    HF-native generator's own rounds, or an engine or plain call (``engine_call``: batch size, K) as a whole."""
    if isinstance(counters, SpeculativeOutput):
        return sum(live for live, _ in counters.rounds), sum(live for live, k in counters.rounds if k == 0)
    _, k = engine_call
    row_steps = engine_row_steps(counters, k, num_tokens)
    return row_steps, 0 if k else row_steps


def conversation_budget(rows: list[list[int]], prompts: list[list[int]], max_completion_length: int) -> int:
    """The most new tokens of a tool-loop turn that TRL keeps: each row is a conversation that began with one of the
    batch's ``prompts`` and may hold ``max_completion_length`` tokens after it (TRL cuts the rest after the turn), so
    the turn needs no more than its roomiest row's rest. A row that no prompt begins, or that several do (the
    shortest taken), never gets less than TRL keeps; at least 1."""
    starts = {tuple(prompt) for prompt in prompts}
    lengths = sorted({len(prompt) for prompt in prompts})
    rest = 1
    for row in rows:
        start = next((length for length in lengths if tuple(row[:length]) in starts), None)
        if start is None:
            return max_completion_length
        rest = max(rest, max_completion_length - (len(row) - start))
    return min(rest, max_completion_length)


def turns_per_rollout(completions: list, accelerator) -> float:
    """Assistant turns per rollout over every process (a collective): TRL's tool loop returns each rollout as its
    messages, the tool calls' answers among them."""
    turns = [sum(message.get("role") == "assistant" for message in rollout) for rollout in completions]
    local = torch.tensor([[sum(turns), len(turns)]], device=accelerator.device)
    total_turns, rollouts = gather(local).sum(0).tolist()
    return total_turns / max(rollouts, 1)


def build_rollouts(
    draft: DraftModel,
    args,
    accelerator,
    *,
    sampling: RolloutSampling,
    metrics,
    policy: Callable[[], nn.Module],
    policy_for_generation: Callable,
    trl_generation: Callable[[list[list[int]]], tuple],
    engine: RolloutEngine | None,
    pipeline: PipelinedTarget | None,
    step_times: StepTimes,
) -> SpeculativeRollouts:
    """The rollouts of the run's path, their backends chosen once: HF-native (``engine`` None) or vLLM (colocated,
    or a server), pipelined under pipeline parallelism (``pipeline``: the stages, every turn's plain decoding runs
    through them too); elsewhere the plain backend is TRL's own generation (``trl_generation``).

    ``policy_for_generation``: the strategy's context that unwraps the policy for HF-native generation."""
    # An engine call is seen as its average decoding step, already an average over many: one per K will do.
    speculation = (
        AdaptiveSpeculation(
            args.max_speculative_tokens,
            draft_forwards=draft.draft_forwards,
            first_rounds=1 if engine is not None else 2,
        )
        if args.num_speculative_tokens == "auto"
        else FixedSpeculation(args.num_speculative_tokens)
    )

    def hf_native(speculation: SpeculationPolicy) -> HFNativeBackend:
        return HFNativeBackend(
            draft,
            sampling,
            policy=policy_for_generation,
            speculation=speculation,
            seed=args.seed,
            draft_sampling=args.draft_sampling,
            device=accelerator.device,
            process_index=accelerator.process_index,
            pipeline=pipeline,
        )

    plain = TRLGeneration(trl_generation) if pipeline is None else hf_native(PlainDecoding())
    if engine is None:
        backend = hf_native(speculation)
    else:
        vllm = dict(
            weights=lambda: merged_weights(policy()),
            speculation=speculation,
            max_draft_tokens=args.max_draft_tokens,
            output_dir=args.output_dir,
            step_times=step_times,
        )
        if pipeline is not None:
            backend = PipelinedServerBackend(engine, draft, sampling, accelerator, pipeline=pipeline, **vllm)
        elif engine.shared_across_processes:
            backend = ServerBackend(engine, draft, sampling, accelerator, **vllm)
        else:
            backend = ColocatedVLLMBackend(engine, draft, sampling, accelerator, **vllm)
    ranks = None
    if pipeline is not None:
        ranks = PipelinedRanks(
            pipeline, process_index=accelerator.process_index, num_processes=accelerator.num_processes
        )
    return SpeculativeRollouts(
        draft,
        args,
        accelerator,
        backend=backend,
        plain=plain,
        speculation=speculation,
        metrics=metrics,
        policy=policy,
        engine=engine,
        ranks=ranks,
        generates_plain_turns=pipeline is not None,
    )


__all__ = ["SpeculativeRollouts", "ThisProcess", "build_rollouts", "conversation_budget", "turns_per_rollout"]
