"""`SpeculativeRollouts`: the trainer's rollouts with the draft of the current step, and what they measure.

Two engines: the package's HF-native generator (`speculative_generate`, on the policy the trainer is training), or
a vLLM engine that holds the policy and the draft (`RolloutEngine`: colocated in each process, or one server for
every process), into which both are pushed once per step. A turn that fails falls back to plain generation (logged
and counted in ``spec/fallback``); each turn logs the ``spec/*`` metrics. A server that restarted gets both pushed
again before the turn is served; one that cannot be reached stops the run (`EngineUnavailableError`).
"""

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import gather, is_peft_model
from torch import nn
from transformers.utils import logging
from trl.trainer.utils import pad

from ..draft import Eagle3DraftModel
from ..generation.adaptive import AdaptiveSpeculation, FixedSpeculation, PlainDecoding, SpeculationPolicy
from ..generation.engine import (
    EngineRestartedError,
    EngineUnavailableError,
    RolloutEngine,
    SpecDecodeStats,
    WeightSyncError,
)
from ..generation.pipelined import PipelinedTarget
from ..generation.speculative import SpeculativeOutput, check_speculative_target, speculative_generate
from .draft_cotraining import seeded_generator
from .timing import StepTimes


logger = logging.get_logger(__name__)

# Speculative turns failing this many times in a row get one error in the log, besides each turn's warning.
FALLBACKS_BEFORE_ERROR = 3


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


class SpeculativeRollouts:
    """Speculative rollout turns for one training process.

    Args:
        draft: the co-trained draft (the very object the trainer updates).
        args: the trainer's `SpecCoTrainConfig`.
        accelerator: the trainer's accelerator (device, process index, gathering of metrics).
        sampling: the trainer's generation settings.
        metrics: the trainer's ``_metrics`` (mode -> name -> list of values), where ``spec/*`` values go.
        policy: returns the policy as the accelerator unwraps it (PEFT wrapper kept), whose weights are pushed.
        engine: the vLLM engine holding the policy and the draft (`build_rollout_engine`); None: HF-native turns.
        generates_for_all_ranks: one rank generates every rank's rollouts (pipeline parallelism), so the metrics
            are this rank's alone, not summed over the processes.
        step_times: where the engine's weight syncs are timed (``time/weight_sync``).
    """

    def __init__(
        self,
        draft: Eagle3DraftModel,
        args,
        accelerator,
        *,
        sampling: RolloutSampling,
        metrics,
        policy: Callable[[], nn.Module],
        engine: RolloutEngine | None = None,
        generates_for_all_ranks: bool = False,
        step_times: StepTimes | None = None,
    ):
        self.draft, self.args, self.accelerator, self.sampling = draft, args, accelerator, sampling
        self.metrics, self.policy, self.engine = metrics, policy, engine
        self.acceptance_history: list[tuple[int, float]] = []
        self.generates_for_all_ranks = generates_for_all_ranks
        # Under pipeline parallelism, the policy's stages (`PipelinedTarget`): HF-native turns run through them.
        self.pipeline: PipelinedTarget | None = None
        self._engine_synced_step = -1
        # Under pipeline parallelism: why this step's push from the stages failed, and whether the last stage's rollout
        # request met a restarted server since the last push.
        self._push_error: str | None = None
        self._restart_seen = False
        self._engine_calls = 0
        self._fallbacks_in_a_row = 0
        self.step_times = step_times or StepTimes(metrics)
        # An engine call is seen as its average decoding step, already an average over many: one per K will do.
        self.speculation: SpeculationPolicy = (
            AdaptiveSpeculation(args.max_speculative_tokens, first_rounds=1 if engine is not None else 2)
            if args.num_speculative_tokens == "auto"
            else FixedSpeculation(args.num_speculative_tokens)
        )

    def check_can_serve(self, policy: nn.Module) -> None:
        """Refuse at start a policy this rollout path cannot serve, rather than falling back at every step: the
        HF-native generator verifies full and sliding-window attention layers and the linear-attention layers of
        Qwen3.5 and Qwen3-Next (`check_speculative_target`); the vLLM engine (colocated or a server) must hold a
        parameter for every policy tensor, of the same shape."""
        family = policy.config.get_text_config().model_type
        hf_native_error = None
        try:
            check_speculative_target(policy.config)
        except ValueError as error:
            hf_native_error = error
        if self.engine is None:
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

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        step: int,
        training: bool,
        policy_for_generation: Callable[[], AbstractContextManager[nn.Module]],
        plain: Callable[[], tuple],
    ) -> tuple[list[list[int]], None]:
        """Completions of one turn, speculative with this step's draft; ``plain()`` (the trainer's own generation)
        when adaptive speculation expects plain decoding to be fastest for this batch, or when the speculative turn
        fails, so the run goes on and loses nothing."""
        try:
            if self.engine is not None:
                turn = self.vllm_turn(prompt_ids, step=step, training=training)
            elif isinstance(self.speculation, AdaptiveSpeculation) and self.speculation.prefers_plain(len(prompt_ids)):
                turn = self.plain_turn(prompt_ids, plain, step=step, training=training)
            else:
                turn = self.hf_native_turn(prompt_ids, step=step, training=training, policy=policy_for_generation)
            self._fallbacks_in_a_row = 0
            return turn
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
            self.metrics["train" if training else "eval"]["spec/fallback"].append(1.0)
            return plain()

    # ------------------------------------------------------------------ HF-native

    def plain_turn(self, prompt_ids: list[list[int]], plain: Callable[[], tuple], *, step: int, training: bool):
        """TRL's own generation, for a call where adaptive speculation measured plain calls to be faster (or
        re-measures them); its tokens per second are fed back."""
        started = time.perf_counter()
        completions, logprobs = plain()
        elapsed = time.perf_counter() - started
        num_tokens = sum(map(len, completions))
        self.speculation.observe_call(len(prompt_ids), plain=True, seconds=elapsed, num_tokens=num_tokens)
        self._log_metrics(
            SpecDecodeStats(), num_tokens, elapsed, step=step, training=training, engine_call=(len(prompt_ids), 0)
        )
        return completions, logprobs

    def hf_native_turn(
        self,
        prompt_ids: list[list[int]],
        *,
        step: int,
        training: bool,
        policy: Callable[[], AbstractContextManager[nn.Module]],
    ) -> tuple[list[list[int]], None]:
        """`speculative_generate` on the policy the trainer holds (``policy()`` unwraps it for generation)."""
        completions, out, elapsed = self._hf_native_generate(
            prompt_ids, step=step, training=training, policy=policy, speculation=self.speculation
        )
        num_tokens = sum(map(len, completions))
        if isinstance(self.speculation, AdaptiveSpeculation):
            self.speculation.observe_call(len(prompt_ids), plain=False, seconds=elapsed, num_tokens=num_tokens)
        self._log_metrics(out, num_tokens, elapsed, step=step, training=training)
        return completions, None

    def pipelined_plain(
        self,
        prompt_ids: list[list[int]],
        *,
        step: int,
        training: bool,
        policy: Callable[[], AbstractContextManager[nn.Module]],
    ) -> tuple[list[list[int]], None]:
        """Plain decoding through the pipeline's stages (K = 0: the draft never runs), where no rank holds the whole
        policy that TRL's own generation would need."""
        completions, _, _ = self._hf_native_generate(
            prompt_ids, step=step, training=training, policy=policy, speculation=PlainDecoding()
        )
        return completions, None

    def _hf_native_generate(
        self,
        prompt_ids: list[list[int]],
        *,
        step: int,
        training: bool,
        policy: Callable[[], AbstractContextManager[nn.Module]],
        speculation: SpeculationPolicy,
    ) -> tuple[list[list[int]], SpeculativeOutput, float]:
        """The completions (up to and including the first EOS), the generator's output and the seconds it took."""
        sampling, device = self.sampling, self.accelerator.device

        def left_padded(rows: list[torch.Tensor], value: int) -> torch.Tensor:
            return pad(
                rows, padding_value=value, padding_side="left", pad_to_multiple_of=sampling.pad_to_multiple_of
            ).to(device)

        padded_ids = left_padded([torch.tensor(ids) for ids in prompt_ids], sampling.pad_token_id)
        attention_mask = left_padded([torch.ones(len(ids), dtype=torch.long) for ids in prompt_ids], 0)
        # Rollout randomness from (seed, step, rank) rather than the global RNG: a resumed run samples exactly
        # the rollouts the uninterrupted run would have.
        mode_offset = 0 if training else 1
        generator = seeded_generator(self.args.seed, step, self.accelerator.process_index, mode_offset, device=device)
        started = time.perf_counter()
        with policy() as model, torch.no_grad():
            out = speculative_generate(
                model,
                self.draft,
                padded_ids,
                attention_mask,
                max_new_tokens=sampling.max_tokens,
                num_speculative_tokens=speculation,
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                draft_sampling=self.args.draft_sampling,
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
        return completions, out, elapsed

    # ------------------------------------------------------------------ vLLM

    def vllm_turn(self, prompt_ids: list[list[int]], *, step: int, training: bool) -> tuple[list[list[int]], None]:
        """Rollouts from the vLLM engine, after pushing this step's policy and draft into it (once per step, and again
        after the engine restarted; under pipeline parallelism the stages pushed them before the turn,
        `push_stages`)."""
        try:
            try:
                return self._vllm_turn(prompt_ids, step=step, training=training)
            except EngineRestartedError as restarted:
                if self.pipeline is not None:  # the stages push together, before the next turn: plain until then
                    self._restart_seen, self._push_error = True, f"the server restarted since: {restarted}"
                    raise WeightSyncError(
                        f"{restarted} The stages push their weights again before the next turn."
                    ) from restarted
                if self.engine.shared_across_processes and self.accelerator.num_processes > 1:
                    raise EngineRestartedError(
                        f"{restarted} {self.accelerator.num_processes} training processes share this server and "
                        "push into it from the main one only, between steps: the run cannot re-sync it now. Resume "
                        "from the last checkpoint (resume_from_checkpoint=True)."
                    ) from restarted
                logger.warning(f"{restarted} Pushing the policy and the draft again, then serving this turn.")
                self._engine_synced_step = -1
                return self._vllm_turn(prompt_ids, step=step, training=training)
        except EngineUnavailableError as error:
            raise self._stopped(error, step) from error

    def _stopped(self, error: EngineUnavailableError, step: int) -> EngineUnavailableError:
        """The error that stops the run once the engine cannot be reached, saying how to resume."""
        return EngineUnavailableError(
            f"{error} Training stopped at step {step}; the checkpoints in {self.args.output_dir} are as saved. "
            "Once the server is back, resume with resume_from_checkpoint=True."
        )

    def _vllm_turn(self, prompt_ids: list[list[int]], *, step: int, training: bool) -> tuple[list[list[int]], None]:
        if self.pipeline is not None and (step != self._engine_synced_step or self._restart_seen):
            # The stages' push (`push_stages`) failed, or the server restarted since: plain pipelined rollouts.
            raise WeightSyncError(
                f"The rollout server does not hold step {step}'s weights ({self._push_error}); the policy and the "
                "draft are untouched."
            )
        if step != self._engine_synced_step:
            with self.step_times.measure("weight_sync"):
                self.sync_engine()
            self._engine_synced_step = step
        sampling = self.sampling
        k = self._engine_k(len(prompt_ids))
        started = time.perf_counter()
        out = self.engine.generate(
            prompt_ids,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
        )
        elapsed = time.perf_counter() - started
        num_tokens = sum(map(len, out.completion_ids))
        # An engine's first call also sets up its drafting (3-4x slower on vLLM-CPU): not a sample of its cost.
        if self._adapts_engine and self._engine_calls:
            _observe_engine_call(self.speculation, len(prompt_ids), k, out.spec_decode, num_tokens, elapsed)
        self._engine_calls += 1
        self._log_metrics(
            out.spec_decode, num_tokens, elapsed, step=step, training=training, engine_call=(len(prompt_ids), k)
        )
        return out.completion_ids, None

    @property
    def _adapts_engine(self) -> bool:
        return isinstance(self.speculation, AdaptiveSpeculation) and getattr(
            self.engine, "adaptive_speculation", False
        )

    def _engine_k(self, batch_size: int) -> int:
        """K of this engine call: the cost model's choice for the call's batch when the engine can change it."""
        if not self._adapts_engine:
            return self.args.max_draft_tokens
        k = self.speculation.choose(batch_size)
        self.engine.set_num_speculative_tokens(k)
        return k

    def sync_engine(self) -> None:
        """Push the policy and the draft: into this process's engine, or once, from the main process, into the
        engine every process shares (a server)."""
        engine = self.engine
        if not engine.shared_across_processes or self.accelerator.is_main_process:
            with self.policy_weights() as weights:
                engine.sync_weights("policy", weights)
            engine.sync_weights("draft", self.draft.state_dict().items())
        if engine.shared_across_processes:
            self.accelerator.wait_for_everyone()

    def push_stages(self, step: int) -> None:
        """Under pipeline parallelism, on every stage before the turn: each stage pushes its own weights into the
        server, and the last one the draft, each set as one transaction (`sync_stages`), once per step. A failed push
        (the same on every stage) is kept for the turn, which then falls back to plain rollouts through the stages
        (logged, ``spec/fallback``); a server that restarted gets both pushed again; one out of reach stops the run
        on every stage."""
        from ..generation.stage_sync import on_one_stage  # with the server's client, which needs the vLLM extra

        # Whether the last stage's rollout request met a restarted server since the last push, on every stage.
        restart_seen = on_one_stage(lambda: self._restart_seen, src=self.pipeline.driver, group=self.pipeline.group)
        if step == self._engine_synced_step and not restart_seen:
            return
        self._restart_seen = False
        self._push_error = None
        try:
            with self.step_times.measure("weight_sync"):
                try:
                    self._push_stage_weights()
                except EngineRestartedError as restarted:
                    if self.pipeline.is_driver:
                        logger.warning(f"{restarted} The stages push the policy and the draft again.")
                    self._follow_restart()
                    self._push_stage_weights()
        except EngineUnavailableError as error:
            raise self._stopped(error, step) from error
        except Exception as error:
            self._push_error = f"{type(error).__name__}: {error}"
            return
        self._engine_synced_step = step

    def _push_stage_weights(self) -> None:
        from ..generation.stage_sync import sync_stages

        group = self.pipeline.group
        with self.policy_weights() as weights:
            sync_stages(self.engine, "policy", weights, group=group)
        draft = self.draft.state_dict().items() if self.pipeline.is_driver else []
        sync_stages(self.engine, "draft", draft, group=group)

    def _follow_restart(self) -> None:
        """Let this stage's client take the restarted server's instance (the stage that met it first already did).
        Raises nothing, so that every stage goes on to the push together: any problem with the server meets the push,
        which shares it with every stage."""
        try:
            self.engine.health()
        except Exception:
            pass

    @contextmanager
    def policy_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The policy's weights under HF names, LoRA adapters merged in (and unmerged afterwards)."""
        model = self.policy()
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

    # ------------------------------------------------------------------ metrics

    def _log_metrics(
        self,
        counters,
        num_tokens: int,
        elapsed: float,
        *,
        step: int,
        training: bool,
        engine_call: tuple[int, int] | None = None,
    ) -> None:
        """``spec/*`` from one turn's counters (`SpeculativeOutput` or `SpecDecodeStats`), summed over the processes
        that generated. Acceptance is over the rounds that drafted (K >= 1): a turn that drafted nothing logs none
        (TRL's `log` then averages the turns that did), and the rounds of K = 0 are counted apart, in
        ``spec/plain_round_share``. The acceptance history gets one entry per training turn, NaN for a turn that
        drafted nothing."""
        mode = "train" if training else "eval"
        k = self.args.max_draft_tokens
        per_position = [float(a) for a in counters.accepted_per_position][:k]
        row_rounds, plain_row_rounds = _row_rounds(counters, num_tokens, engine_call)
        local = torch.tensor(
            [
                counters.num_drafts,
                counters.num_accepted_tokens,
                num_tokens,
                elapsed,
                row_rounds,
                plain_row_rounds,
                *per_position,
                *[0.0] * (k - len(per_position)),  # a call of a smaller K: every process sends as many values
            ],
            device=self.accelerator.device,
        )
        total = (local if self.generates_for_all_ranks else gather(local.unsqueeze(0)).sum(0)).tolist()
        drafts, accepted, tokens, seconds, row_rounds, plain_row_rounds = total[:6]
        generating_processes = 1 if self.generates_for_all_ranks else self.accelerator.num_processes
        metrics = self.metrics[mode]
        acceptance = math.nan
        if drafts:
            acceptance = 1.0 + accepted / drafts
            metrics["spec/acceptance_length"].append(acceptance)
            for position, accepted_at in enumerate(total[6:]):
                metrics[f"spec/accepted_per_position_{position}"].append(accepted_at / drafts)
        if row_rounds:
            metrics["spec/plain_round_share"].append(plain_row_rounds / row_rounds)
        metrics["spec/tokens_per_second"].append(tokens / (seconds / generating_processes))
        for name, value in self._speculation_metrics(counters, engine_call).items():
            metrics[name].append(value)
        if training:
            # `step` is TRL's global_step, still the previous one while rollouts run: the step they feed is the next,
            # numbered from 1 as TRL logs it.
            self.acceptance_history.append((step + 1, acceptance))

    def _speculation_metrics(self, counters, engine_call: tuple[int, int] | None) -> dict[str, float]:
        """This process's K (averaged over rows and rounds) and, under adaptive speculation, the cost model's
        predicted speed-up over plain decoding and the measured one where both were run. ``engine_call``: a vLLM
        call's (batch size, K)."""
        rounds = counters.rounds if isinstance(counters, SpeculativeOutput) else [engine_call]
        if not rounds:
            return {}
        values = {"spec/num_speculative_tokens": _row_weighted_mean([(live, k) for live, k in rounds])}
        if isinstance(self.speculation, AdaptiveSpeculation):
            model = self.speculation
            for name, estimate in (("predicted", model.predicted_speedup), ("measured", model.measured_speedup)):
                mean = _row_weighted_mean([(live, estimate(live, k)) for live, k in rounds])
                if not math.isnan(mean):
                    values[f"spec/{name}_speedup"] = mean
        return values


def _observe_engine_call(
    model: AdaptiveSpeculation, batch_size: int, k: int, counters, num_tokens: int, seconds: float
) -> None:
    """Feed the cost model one engine call as its average decoding step: the engine reports no per-step times, so
    the draft's share stays in the step's time (the model's cost of K + 1 tokens carries it)."""
    row_steps = _engine_row_steps(counters, k, num_tokens)
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


def _engine_row_steps(counters, k: int, num_tokens: int) -> int:
    """Decoding steps of an engine (or plain) call summed over its rows: every running row drafts once per step when
    K >= 1, and emits one token per step when K = 0."""
    return counters.num_drafts if k else num_tokens


def _row_rounds(counters, num_tokens: int, engine_call: tuple[int, int] | None) -> tuple[int, int]:
    """A turn's decoding rounds summed over rows (one per row and target forward), and those of them with K = 0: the
    HF-native generator's own rounds, or an engine or plain call (``engine_call``: batch size, K) as a whole."""
    if isinstance(counters, SpeculativeOutput):
        return sum(live for live, _ in counters.rounds), sum(live for live, k in counters.rounds if k == 0)
    _, k = engine_call
    row_steps = _engine_row_steps(counters, k, num_tokens)
    return row_steps, 0 if k else row_steps


def _row_weighted_mean(values: list[tuple[int, float]]) -> float:
    """Mean of per-round values weighted by the round's live rows, NaN values (not measured) left out."""
    known = [(rows, value) for rows, value in values if not math.isnan(value)]
    return sum(rows * value for rows, value in known) / sum(rows for rows, _ in known) if known else math.nan


def build_rollout_engine(
    draft: Eagle3DraftModel, args, *, policy: nn.Module, tokenizer, max_num_seqs: int
) -> RolloutEngine:
    """The vLLM engine (policy + draft) of speculative vLLM rollouts: colocated in this process, or a client of an
    ``hf-spec-cotrain vllm-serve`` server (``vllm_mode="server"``)."""
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

    policy_folder = Path(policy.config._name_or_path or "")
    if not (policy_folder / "config.json").exists():  # a model built in memory: vLLM needs a folder
        policy_folder = Path(args.output_dir) / "rollout_policy_init"
        policy.save_pretrained(policy_folder)
        tokenizer.save_pretrained(policy_folder)
    # The engine starts from a bootstrap draft and gets the real weights at its first sync. Its lm_head must
    # differ from the policy's, or vLLM would share the two and the draft's own head could never be synced.
    draft_folder = Path(args.output_dir) / "rollout_draft_init"
    bootstrap = {**draft.state_dict(), "lm_head.weight": -draft.lm_head.weight.detach()}
    draft.save_pretrained(draft_folder, state_dict=bootstrap)
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


def vllm_sampling_methods(draft: Eagle3DraftModel, args) -> tuple[str | None, str | None]:
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
