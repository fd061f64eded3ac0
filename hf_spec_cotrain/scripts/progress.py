"""The main job's console: one progress bar over every run's steps and the job's own messages, while the per-step
metrics go to files (``results.csv``, ``log_history.json``) instead of being printed as transformers' callbacks do."""

import math
import sys

from tqdm.auto import tqdm
from transformers import PrinterCallback, ProgressCallback, TrainerCallback


class JobProgress:
    """A bar over the steps of all ``runs`` (name -> steps) with each run's latest reward (and acceptance, where it
    speculates) beside it. Where the output is not a terminal (a log file) the bar is off and a line is written every
    tenth of the job instead, so the log holds no cursor movements."""

    def __init__(self, runs: dict[str, int], *, stream=sys.stderr):
        self.total = sum(runs.values())
        self.done = 0
        self.latest: dict[str, dict[str, float]] = {name: {} for name in runs}
        self.bar = tqdm(
            total=self.total, desc="GRPO steps", unit="step", disable=None, file=stream, dynamic_ncols=True
        )
        self.line_every = max(1, math.ceil(self.total / 10))

    def attach(self, trainer, name: str) -> None:
        """Let ``trainer`` report to this bar instead of printing its own bar and log dicts."""
        for quiet in (ProgressCallback, PrinterCallback):
            trainer.remove_callback(quiet)
        trainer.add_callback(_RunProgress(self, name))

    def write(self, message: str) -> None:
        """A line for the console that leaves the bar intact."""
        if self.bar.disable:
            print(message, flush=True)
        else:
            self.bar.write(message)

    def step_done(self) -> None:
        self.done += 1
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.update(1)
        if self.bar.disable and (self.done % self.line_every == 0 or self.done == self.total):
            print(f"[grpo] {self.done}/{self.total} steps: {self.postfix()}", flush=True)

    def postfix(self) -> str:
        parts = []
        for name, latest in self.latest.items():
            values = [f"reward {latest['reward']:.3f}"] if "reward" in latest else []
            if "spec/acceptance_length" in latest:
                values.append(f"acceptance {latest['spec/acceptance_length']:.2f}")
            if values:
                parts.append(f"{name}: {', '.join(values)}")
        return "; ".join(parts)

    def close(self) -> None:
        self.bar.close()


class _RunProgress(TrainerCallback):
    def __init__(self, progress: JobProgress, name: str):
        self.progress, self.name = progress, name

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.progress.latest[self.name].update({k: v for k, v in logs.items() if isinstance(v, int | float)})

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.progress.step_done()
