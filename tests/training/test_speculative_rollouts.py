"""`SpeculativeRollouts` and the rollout backends without a trainer: the fallback to the plain backend, the adaptive
choice of plain decoding, and each vLLM backend's own weight sync and restarts, on stand-in engines."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hf_spec_cotrain.generation.adaptive import AdaptiveSpeculation, FixedSpeculation
from hf_spec_cotrain.generation.engine import (
    EngineRestartedError,
    EngineUnavailableError,
    RolloutOutput,
    SpecDecodeStats,
)
from hf_spec_cotrain.training.rollout_backends import (
    BackendTurn,
    ColocatedVLLMBackend,
    RolloutSampling,
    ServerBackend,
    TRLGeneration,
    merged_weights,
)
from hf_spec_cotrain.training.rollouts import SpeculativeRollouts
from hf_spec_cotrain.training.timing import StepTimes


SAMPLING = RolloutSampling(8, 1.0, 1.0, 0, [2], 0, None)


def accelerator(num_processes=1):
    return SimpleNamespace(
        device=torch.device("cpu"),
        num_processes=num_processes,
        process_index=0,
        is_main_process=True,
        wait_for_everyone=lambda: None,
    )


def metrics():
    return defaultdict(lambda: defaultdict(list))


class Backend:
    """Returns `completions` as an engine call of K = 2 that drafted, or raises `error`."""

    def __init__(self, completions=None, error=None):
        self.completions, self.error, self.calls = completions, error, []

    def prepare(self, step):
        self.calls.append(("prepare", step))

    def generate(self, prompt_ids, *, step, training, max_tokens=None):
        self.calls.append(("generate", step))
        if self.error is not None:
            raise self.error
        stats = SpecDecodeStats(num_drafts=2, num_draft_tokens=4, num_accepted_tokens=2, accepted_per_position=[1, 1])
        return BackendTurn(self.completions, stats, 1.0, (len(prompt_ids), 2))


def rollouts(backend, *, speculation=None, engine="engine"):
    args = SimpleNamespace(max_draft_tokens=2)
    plain = TRLGeneration(lambda prompt_ids: ([[9]] * len(prompt_ids), None))
    return SpeculativeRollouts(
        None,
        args,
        accelerator(),
        backend=backend,
        plain=plain,
        speculation=speculation or FixedSpeculation(2),
        metrics=metrics(),
        policy=lambda: torch.nn.Linear(1, 1),
        engine=engine,
    )


def test_a_speculative_turn_logs_its_metrics_and_history():
    turns = rollouts(Backend(completions=[[5, 6], [7]]))
    assert turns.generate([[1], [2]], step=3, training=True) == ([[5, 6], [7]], None)
    assert turns.metrics["train"]["spec/acceptance_length"] == [2.0]
    assert turns.acceptance_history == [(4, 2.0)]


def test_a_failed_turn_falls_back_to_the_plain_backend_and_is_counted():
    turns = rollouts(Backend(error=RuntimeError("draft broke")))
    assert turns.generate([[1], [2]], step=0, training=True) == ([[9], [9]], None)
    assert turns.metrics["train"]["spec/fallback"] == [1.0]
    assert "spec/acceptance_length" not in turns.metrics["train"]


@pytest.mark.parametrize("error", [EngineUnavailableError("gone"), EngineRestartedError("restarted")])
def test_an_engine_that_is_gone_stops_the_run_rather_than_falling_back(error):
    with pytest.raises(type(error)):
        rollouts(Backend(error=error)).generate([[1]], step=0, training=True)


def test_plain_turns_run_on_the_plain_backend_without_spec_metrics():
    backend = Backend(completions=[[5]])
    turns = rollouts(backend)
    assert turns.generate([[1]], step=0, training=True, speculative=False) == ([[9]], None)
    assert backend.calls == [] and not turns.metrics["train"]


def test_adaptive_speculation_sends_a_batch_where_plain_is_faster_to_the_plain_backend():
    speculation = AdaptiveSpeculation(2)
    speculation.observe_call(1, plain=False, seconds=2.0, num_tokens=100)
    speculation.observe_call(1, plain=True, seconds=1.0, num_tokens=100)
    backend = Backend(completions=[[5]])
    turns = rollouts(backend, speculation=speculation, engine=None)
    assert turns.generate([[1]], step=0, training=True)[0] == [[9]]
    assert ("generate", 0) not in backend.calls  # the HF-native backend did not run
    assert turns.metrics["train"]["spec/num_speculative_tokens"] == [0.0]


class Engine:
    """A stand-in vLLM engine: records its syncs; `restarts` generate calls meet a restart first."""

    shared_across_processes = False

    def __init__(self, restarts=0, unavailable=False):
        self.restarts, self.unavailable, self.synced = restarts, unavailable, []

    def sync_weights(self, kind, weights):
        self.synced.append(kind)

    def generate(self, prompt_ids, **sampling):
        if self.unavailable:
            raise EngineUnavailableError("unreachable")
        if self.restarts:
            self.restarts -= 1
            raise EngineRestartedError("restarted")
        return RolloutOutput(completion_ids=[[5]] * len(prompt_ids), logprobs=None, spec_decode=SpecDecodeStats())


def vllm_backend(kind, engine, num_processes=1):
    return kind(
        engine,
        torch.nn.Linear(1, 1),
        SAMPLING,
        accelerator(num_processes),
        weights=lambda: merged_weights(torch.nn.Linear(1, 1)),
        speculation=FixedSpeculation(2),
        max_draft_tokens=2,
        output_dir="out",
        step_times=StepTimes(metrics()),
    )


def test_a_colocated_engine_is_synced_once_per_step_and_again_after_a_restart():
    engine = Engine()
    backend = vllm_backend(ColocatedVLLMBackend, engine)
    backend.generate([[1]], step=0, training=True)
    backend.generate([[1]], step=0, training=True)
    assert engine.synced == ["policy", "draft"]
    engine.restarts = 1
    turn = backend.generate([[1]], step=0, training=True)
    assert engine.synced == ["policy", "draft"] * 2 and turn.completions == [[5]] and turn.engine_call == (1, 2)


def test_a_server_shared_by_several_processes_cannot_be_synced_again_mid_step():
    backend = vllm_backend(ServerBackend, Engine(restarts=1), num_processes=2)
    with pytest.raises(EngineRestartedError, match="2 training processes share this server"):
        backend.generate([[1]], step=0, training=True)


def test_an_unreachable_engine_stops_the_run_with_how_to_resume():
    backend = vllm_backend(ServerBackend, Engine(unavailable=True))
    with pytest.raises(EngineUnavailableError, match="Training stopped at step 3.*resume_from_checkpoint=True"):
        backend.generate([[1]], step=3, training=True)
