"""Rollouts under pipeline parallelism, where no rank holds the whole policy: the last stage (the driver, which holds
the draft) generates every rank's rows while the other stages serve its forwards (`PipelinedRanks`), HF-native
through the stages (`HFNativeBackend` with the `PipelinedTarget`, speculative or plain) or from a vLLM server into
which every stage pushes its own weights (`PipelinedServerBackend`)."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers.utils import logging

from ..generation.engine import EngineRestartedError, EngineUnavailableError, WeightSyncError
from ..generation.pipelined import PipelinedTarget
from .rollout_backends import BackendTurn, ServerBackend


logger = logging.get_logger(__name__)


class PipelinedRanks:
    """Every rank's prompts gathered to the driver, which runs the turn (``generate_all``) while the other stages
    serve its forwards; each rank gets back its own rows. Only the driver counts the turn's ``spec/*`` counters: the
    batch's sum over the ranks (`SpeculativeRollouts.generation_batch`) gives every rank its metrics."""

    def __init__(self, pipeline: PipelinedTarget, *, process_index: int, num_processes: int):
        self.pipeline, self.process_index, self.num_processes = pipeline, process_index, num_processes

    def generate(self, prompt_ids, generate_all: Callable):
        per_rank = [None] * self.num_processes
        dist.all_gather_object(per_rank, prompt_ids)
        driver = self.pipeline.driver
        if not self.pipeline.is_driver:
            self.pipeline.serve()
            results = [None]
            dist.broadcast_object_list(results, src=driver)
            if isinstance(results[0], Exception):
                raise RuntimeError("The last stage's rollouts failed (its traceback is in its log).") from results[0]
            return results[0][self.process_index]
        results = [None]
        try:
            everyone = [ids for ids in per_rank for ids in ids]
            completions, logprobs = generate_all(everyone)
            bounds = torch.tensor([0, *map(len, per_rank)]).cumsum(0).tolist()
            rows = [
                (completions[start:end], None if logprobs is None else logprobs[start:end])
                for start, end in zip(bounds[:-1], bounds[1:])
            ]
            results = [rows]
            return rows[-1]
        except Exception as error:
            results = [RuntimeError(f"{type(error).__name__}: {error}")]
            raise
        finally:
            self.pipeline.finish()
            dist.broadcast_object_list(results, src=driver)


class PipelinedServerBackend(ServerBackend):
    """A vLLM server that every stage pushes its own weights into, and the last one the draft, each set as one
    transaction (`sync_stages`), once per step before the turn (`prepare`, on every stage). A failed push (the same
    on every stage) is kept for the turn, which then fails and falls back to plain rollouts through the stages
    (logged, ``spec/fallback``); a server that restarted gets both pushed again before the next turn; one out of
    reach stops the run on every stage."""

    def __init__(self, *args, pipeline: PipelinedTarget, **kwargs):
        super().__init__(*args, **kwargs)
        self.pipeline = pipeline
        self.push_error: str | None = None  # why this step's push failed
        self.restart_seen = False  # whether the driver's rollout request met a restarted server since the push

    def prepare(self, step: int) -> None:
        from ..generation.stage_sync import on_one_stage  # with the server's client, which needs the vLLM extra

        # Whether the last stage's rollout request met a restarted server since the last push, on every stage.
        restart_seen = on_one_stage(lambda: self.restart_seen, src=self.pipeline.driver, group=self.pipeline.group)
        if step == self.synced_step and not restart_seen:
            return
        self.restart_seen = False
        self.push_error = None
        try:
            with self.step_times.measure("weight_sync"):
                try:
                    self.push_stage_weights()
                except EngineRestartedError as restarted:
                    if self.pipeline.is_driver:
                        logger.warning(f"{restarted} The stages push the policy and the draft again.")
                    self.follow_restart()
                    self.push_stage_weights()
        except EngineUnavailableError as error:
            raise self.stopped(error, step) from error
        except Exception as error:
            self.push_error = f"{type(error).__name__}: {error}"
            return
        self.synced_step = step

    def push_stage_weights(self) -> None:
        from ..generation.stage_sync import sync_stages

        group = self.pipeline.group
        with self.weights() as weights:
            sync_stages(self.engine, "policy", weights, group=group)
        draft = self.draft.state_dict().items() if self.pipeline.is_driver else []
        sync_stages(self.engine, "draft", draft, group=group)

    def follow_restart(self) -> None:
        """Let this stage's client take the restarted server's instance (the stage that met it first already did).
        Raises nothing, so that every stage goes on to the push together: any problem with the server meets the push,
        which shares it with every stage."""
        try:
            self.engine.health()
        except Exception:
            pass

    def engine_turn(self, prompt_ids, *, step: int, max_tokens: int | None = None) -> BackendTurn:
        if step != self.synced_step or self.restart_seen:
            # The stages' push (`prepare`) failed, or the server restarted since: plain pipelined rollouts.
            raise WeightSyncError(
                f"The rollout server does not hold step {step}'s weights ({self.push_error}); the policy and the "
                "draft are untouched."
            )
        return super().engine_turn(prompt_ids, step=step, max_tokens=max_tokens)

    def after_restart(
        self, restarted: EngineRestartedError, prompt_ids, *, step: int, max_tokens: int | None = None
    ) -> BackendTurn:
        """The stages push together, before the next turn: this one falls back to plain until then."""
        self.restart_seen, self.push_error = True, f"the server restarted since: {restarted}"
        raise WeightSyncError(f"{restarted} The stages push their weights again before the next turn.") from restarted


__all__ = ["PipelinedRanks", "PipelinedServerBackend"]
