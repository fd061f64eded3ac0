"""`StepTimes`: where an optimizer step's time goes, logged every step as ``time/*``.

TRL logs ``step_time`` (its training step, generation included) but not how it splits; RL runs are tuned on that
split. Parts are timed where they run and summed per optimizer step: ``time/generation`` (rollouts, speculative or
plain; the syncs they start excluded), ``time/draft_training`` (the draft's TTT and its update),
``time/weight_sync`` (pushing weights into a rollout engine), ``time/tool_calls`` (the tool loop of multi-turn
rollouts less its turns' generation: the tools themselves, their results' tokenization and parsing), ``time/step`` (the
training steps and the draft's update) and ``time/policy_training`` (the rest of ``time/step``: the policy's forward
and backward, rewards, bookkeeping).
"""

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from transformers import TrainerCallback


__all__ = ["StepTimes", "StepTimesCallback"]

PARTS = ("generation", "draft_training", "weight_sync", "tool_calls")


class StepTimes:
    """Seconds per part of the current optimizer step; `log` appends them to the trainer's ``_metrics``."""

    def __init__(self, metrics):
        self.metrics = metrics
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: set[str] = set()

    @contextmanager
    def measure(self, part: str, *, excluding: str | None = None) -> Iterator[None]:
        """Add the block's wall time to ``part`` (a block nested in the same part is counted once), less what the
        part ``excluding`` measured inside it."""
        if part in self._open:
            yield
            return
        self._open.add(part)
        started, excluded = time.perf_counter(), self.seconds.get(excluding, 0.0)
        try:
            yield
        finally:
            inside = self.seconds.get(excluding, 0.0) - excluded
            self.seconds[part] += time.perf_counter() - started - inside
            self._open.discard(part)

    def log(self) -> None:
        """Close the step: append every part (0 for a part that did not run) and reset."""
        metrics = self.metrics["train"]
        seconds = {part: self.seconds.get(part, 0.0) for part in (*PARTS, "step")}
        seconds["generation"] = max(seconds["generation"] - seconds["weight_sync"], 0.0)  # syncs run inside it
        for part, value in seconds.items():
            metrics[f"time/{part}"].append(value)
        metrics["time/policy_training"].append(max(seconds["step"] - sum(seconds[part] for part in PARTS), 0.0))
        self.seconds.clear()


class StepTimesCallback(TrainerCallback):
    """Closes `StepTimes` at the end of every optimizer step, before the step is logged."""

    def __init__(self, step_times: StepTimes):
        self.step_times = step_times

    def on_step_end(self, args, state, control, **kwargs):
        self.step_times.log()
        return control
