"""The main job's baselines: plain TRL GRPO, and plain GRPO on a colocated vLLM engine without a draft, both timed
with the same ``time/*`` split as `SpecCoTrainGRPOTrainer` so that their steps compare part by part."""

import time

from trl import GRPOTrainer

from ..training import StepTimes, StepTimesCallback
from ..training.rollouts import turns_per_rollout


class TimedGRPOTrainer(GRPOTrainer):
    """Plain TRL GRPO (the no-speculation baseline) that also logs its rollout throughput (over all of a step's
    turns), the same ``time/*`` split of its steps as `SpecCoTrainGRPOTrainer` (the tool loop's own time in
    ``tool_calls``) and, with tools, the assistant turns per rollout (``tools/turns_per_rollout``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_times = StepTimes(self._metrics)
        self.add_callback(StepTimesCallback(self.step_times))
        self._rollout_totals = (-1, 0, 0.0)  # the step, its turns' tokens and seconds

    def training_step(self, *args, **kwargs):
        with self.step_times.measure("step"):
            return super().training_step(*args, **kwargs)

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        with self.step_times.measure("generation"):
            self._before_rollouts()
            started = time.perf_counter()
            completions, logprobs = self._rollouts(prompt_ids, *args, **kwargs)
            seconds = time.perf_counter() - started
        step, tokens, total_seconds = self._rollout_totals
        if step != self.state.global_step:
            tokens, total_seconds = 0, 0.0
        tokens, total_seconds = tokens + sum(map(len, completions)), total_seconds + seconds
        self._rollout_totals = (self.state.global_step, tokens, total_seconds)
        # One value per step, over all its turns: a long turn weighs as much as its tokens.
        self._metrics["train" if self.model.training else "eval"]["rollout/tokens_per_second"] = [
            tokens / total_seconds
        ]
        return completions, logprobs

    def _generate(self, prompts):
        generated = super()._generate(prompts)
        if self.tools:  # TRL's completions: each rollout's messages
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["tools/turns_per_rollout"].append(turns_per_rollout(generated[3], self.accelerator))
        return generated

    def _tool_call_loop(self, *args, **kwargs):
        """TRL's tool loop, timed less its turns' generation, as `SpecCoTrainGRPOTrainer` times it."""
        with self.step_times.measure("tool_calls", excluding="generation"):
            return super()._tool_call_loop(*args, **kwargs)

    def _before_rollouts(self) -> None:
        """Work a rollout needs first that is not decoding (timed as part of the step, not of tokens/s)."""

    def _rollouts(self, prompt_ids, *args, **kwargs):
        return super()._generate_single_turn(prompt_ids, *args, **kwargs)


class VLLMBaselineGRPOTrainer(TimedGRPOTrainer):
    """The ``--use_vllm`` baseline: plain GRPO whose rollouts come from a colocated vLLM engine without a draft, the
    policy pushed into it once per step, as the speculative run's engine gets it. TRL's own colocated vLLM cannot
    be the baseline on a CPU: its weight sync does not run on vLLM-CPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from ..generation import VLLMRolloutEngine  # the vLLM extra loads only with this baseline

        config = self.args
        self.rollout_engine = VLLMRolloutEngine(
            self.model.config._name_or_path,
            seed=config.seed,
            max_model_len=config.vllm_max_model_length,
            max_num_seqs=config.per_device_train_batch_size * config.steps_per_generation,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        )
        self._synced_step = -1

    def _before_rollouts(self) -> None:
        if self.state.global_step != self._synced_step:
            with self.step_times.measure("weight_sync"):
                policy = self.accelerator.unwrap_model(self.model)
                self.rollout_engine.sync_weights("policy", policy.state_dict().items())
            self._synced_step = self.state.global_step

    def _rollouts(self, prompt_ids, *args, **kwargs):
        out = self.rollout_engine.generate(
            prompt_ids,
            max_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or 0,
        )
        return out.completion_ids, None
