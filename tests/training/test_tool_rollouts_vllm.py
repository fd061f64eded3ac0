"""Multi-turn (tool-calling) rollouts through `SpecCoTrainGRPOTrainer.train()` on the package's colocated vLLM engine:
every turn speculative, the draft's loss mask without the tool's results, greedy conversations equal to plain TRL's.

Each trainer starts its own engine: the session's shared one is closed first (one engine at a time)."""

import pytest
from tool_policy import (
    assert_multi_turn_and_speculative,
    record_tool_run,
    tool_trainer,
)


pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")]
COLOCATED = {"use_vllm": True, "vllm_mode": "colocate"}


def _train(trainer):
    """Train, then close the trainer's engine (before the next one starts)."""
    record = record_tool_run(trainer)
    try:
        trainer.train()
    finally:
        trainer.rollout_engine.close()
    return record


@pytest.mark.parametrize(
    "environment, num_speculative_tokens",
    [
        pytest.param(False, 2, id="tools-2"),
        pytest.param(True, "auto", id="environment_factory-auto"),
        pytest.param(True, 2, id="environment_factory-2"),
        pytest.param(False, "auto", id="tools-auto"),
    ],
)
def test_every_engine_turn_speculates_and_greedy_conversations_are_plain_trls(
    environment, num_speculative_tokens, tool_policy_dir, tmp_path, vllm_engine_pool
):
    """``top_k=1`` (at temperature 2, where a turn that sampled would differ) on the colocated engine: the tool is called, every turn speculates, the draft trains without the
    tool's results, and the conversations equal those of TRL's plain (HF) turns on the same prompts and weights."""
    vllm_engine_pool.close()
    common = dict(environment=environment, top_k=1, temperature=2.0, num_speculative_tokens=num_speculative_tokens)
    trainer = tool_trainer(tool_policy_dir, tmp_path / "vllm", vllm_max_model_length=64, **COLOCATED, **common)
    record = _train(trainer)
    assert_multi_turn_and_speculative(trainer, record)
    plain = tool_trainer(tool_policy_dir, tmp_path / "plain", speculative_decoding=False, **common)
    plain_record = record_tool_run(plain)
    plain.train()
    assert record.conversations == plain_record.conversations
