"""`StepTimes`: the parts of a step, each counted once, the tool loop less the turns it generates."""

from collections import defaultdict

import pytest

from hf_spec_cotrain.training import timing
from hf_spec_cotrain.training.timing import StepTimes


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_tool_loop_is_timed_less_its_turns_and_the_parts_add_up_to_the_step(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    metrics = defaultdict(lambda: defaultdict(list))
    times = StepTimes(metrics)
    with times.measure("step"):
        with times.measure("generation"):  # the first turn
            clock.now += 5.0
        with times.measure("tool_calls", excluding="generation"):
            clock.now += 1.0  # the tools
            with times.measure("generation"):  # the turn after the tool results
                clock.now += 3.0
            clock.now += 0.5  # parsing the turn
        clock.now += 2.0  # the policy's forward and backward
    times.log()
    logged = {name: values[0] for name, values in metrics["train"].items()}
    assert logged["time/tool_calls"] == pytest.approx(1.5)
    assert logged["time/generation"] == pytest.approx(8.0)
    assert logged["time/policy_training"] == pytest.approx(2.0)
    parts = ("generation", "draft_training", "weight_sync", "tool_calls", "policy_training")
    assert sum(logged[f"time/{part}"] for part in parts) == pytest.approx(logged["time/step"]) == 11.5
