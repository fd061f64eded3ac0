"""Multi-turn (tool-calling) rollouts through `SpecCoTrainGRPOTrainer.train()` on the package's colocated vLLM engine:
every turn speculative, the draft's loss mask without the tool's results, greedy conversations equal to plain TRL's,
and conversations that grow past the engine's context (``vllm_max_model_length``, below the policy's
``max_position_embeddings``) cut as TRL cuts them for an engine of its own, a longer prompt refused by name.

Each trainer starts its own engine: the session's shared one is closed first (one engine at a time)."""

import pytest
from tool_policy import (
    assert_multi_turn_and_speculative,
    prompt_sum,
    record_tool_run,
    taught_completion,
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
    """``top_k=1`` (at temperature 2, where a turn that sampled would differ) on the colocated engine: the tool is
    called, every turn speculates, the draft trains without the tool's results, and the conversations equal those of
    TRL's plain (HF) turns on the same prompts and weights."""
    vllm_engine_pool.close()
    common = dict(environment=environment, top_k=1, temperature=2.0, num_speculative_tokens=num_speculative_tokens)
    trainer = tool_trainer(tool_policy_dir, tmp_path / "vllm", vllm_max_model_length=64, **COLOCATED, **common)
    record = _train(trainer)
    assert_multi_turn_and_speculative(trainer, record)
    plain = tool_trainer(tool_policy_dir, tmp_path / "plain", speculative_decoding=False, **common)
    plain_record = record_tool_run(plain)
    plain.train()
    assert record.conversations == plain_record.conversations


def test_conversations_past_the_engines_context_are_cut_as_trl_cuts_them_and_a_longer_prompt_is_refused(
    tool_policy_dir, tmp_path, vllm_engine_pool
):
    """``vllm_max_model_length`` = 27 tokens, far below the policy's ``max_position_embeddings``: a tool result that
    would fill the engine's context is dropped (9+8: the 8-token prompt, "[add a=9 b=8]</s>" and "|17\\n>" make 27),
    one that fits is kept and the answer cut where the engine's context ends (3+4: one token left after "|7\\n>"),
    exactly as TRL's loop does for an engine of its own; no turn falls back to plain generation. A prompt the engine
    cannot take at all is refused with an error naming ``vllm_max_model_length``, not a fallback."""
    vllm_engine_pool.close()
    ceiling = 27
    trainer = tool_trainer(
        tool_policy_dir, tmp_path, top_k=1, num_speculative_tokens=2, vllm_max_model_length=ceiling, **COLOCATED
    )
    assert trainer.model.config.max_position_embeddings > ceiling
    record = record_tool_run(trainer)
    try:
        trainer.train()
        assert not any("spec/fallback" in entry for entry in trainer.state.log_history)
        assert record.speculative_turns == len(record.turns) == 3  # 3+4 ran its second turn, 9+8 did not
        tokenizer = trainer.processing_class
        for prompt_ids, completion_ids, _ in record.conversations:
            for prompt, completion in zip(prompt_ids, completion_ids):
                call, result, answer = taught_completion(tokenizer, *prompt_sum(tokenizer, prompt))
                kept = len(prompt) + len(call) + len(result) < ceiling
                assert completion == ((call + result + answer)[: ceiling - len(prompt)] if kept else call)

        too_long = [tokenizer.bos_token_id] + tokenizer("u:" + "1" * ceiling, add_special_tokens=False)["input_ids"]
        with pytest.raises(ValueError, match=rf"{len(too_long)} tokens.*vllm_max_model_length={ceiling}"):
            trainer._generate_single_turn([too_long], None, {}, 1)
        assert "spec/fallback" not in trainer._metrics["train"]
    finally:
        trainer.rollout_engine.close()
