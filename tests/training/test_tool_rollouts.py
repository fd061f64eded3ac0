"""Multi-turn (tool-calling) rollouts through `SpecCoTrainGRPOTrainer.train()` with HF-native speculative rollouts:
TRL's tool loop (``tools``, ``environment_factory``) runs every turn speculative, the draft never trains on the tool's
results, greedy speculative conversations are plain TRL's, and a conversation that reaches
``max_completion_length``, or an engine's context, is cut as TRL cuts it. The colocated vLLM engine's are in
test_tool_rollouts_vllm.py."""

from types import SimpleNamespace

import pytest
from tool_policy import (
    COMPLETION_TOKENS,
    assert_multi_turn_and_speculative,
    prompt_sum,
    record_tool_run,
    taught_completion,
    tool_trainer,
)

from hf_spec_cotrain.training.rollouts import conversation_budget


pytestmark = pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")


@pytest.mark.parametrize("num_speculative_tokens", [2, "auto"])
@pytest.mark.parametrize("environment", [False, True], ids=["tools", "environment_factory"])
def test_every_turn_speculates_and_the_draft_never_trains_on_tool_results(
    environment, num_speculative_tokens, tool_policy_dir, tmp_path
):
    trainer = tool_trainer(
        tool_policy_dir, tmp_path, environment=environment, num_speculative_tokens=num_speculative_tokens
    )
    record = record_tool_run(trainer)
    trainer.train()
    assert_multi_turn_and_speculative(trainer, record)
    if environment:
        assert sum(environment.calls for environment in trainer.environments) > 0


@pytest.mark.parametrize("environment", [False, True], ids=["tools", "environment_factory"])
def test_greedy_speculative_conversations_are_plain_trls(environment, tool_policy_dir, tmp_path):
    """``top_k=1``: every turn's tokens are the policy's argmax, so a speculative run's conversations (tool calls, tool
    results, answers, and which tokens the loss masks) equal those of TRL's plain turns on the same prompts. (At
    temperature 2 a turn that sampled instead would differ.)"""
    runs, trainers = {}, {}
    for speculative in (True, False):
        trainer = tool_trainer(
            tool_policy_dir,
            tmp_path / str(speculative),
            environment=environment,
            top_k=1,
            temperature=2.0,
            num_speculative_tokens=2,
            speculative_decoding=speculative,
        )
        record = record_tool_run(trainer)
        trainer.train()
        runs[speculative], trainers[speculative] = record, trainer
    assert_multi_turn_and_speculative(trainers[True], runs[True])
    assert runs[False].speculative_turns == 0 and len(runs[False].turns) == len(runs[True].turns)
    assert runs[True].conversations == runs[False].conversations


def test_a_conversation_that_reaches_max_completion_length_is_cut_as_trl_cuts_it(tool_policy_dir, tmp_path):
    """A tool result that would take the completion past ``max_completion_length`` is dropped (the row leaves the
    loop after its tool call); one that fits is kept and the answer after it cut at the limit, as TRL's tool loop does
    for any backend; every turn speculates."""
    # Step 1, 3+4: "[add a=3 b=4]</s>" and "|7\n>" fill the 18 tokens, the answer is cut to nothing. Step 2, 9+8:
    # "|17\n>" would take "[add a=9 b=8]</s>" to 19 tokens, so it is dropped.
    limit = 18
    trainer = tool_trainer(tool_policy_dir, tmp_path, top_k=1, max_completion_length=limit, num_speculative_tokens=2)
    record = record_tool_run(trainer)
    trainer.train()
    assert not any("spec/fallback" in entry for entry in trainer.state.log_history)
    assert record.speculative_turns == len(record.turns)
    tokenizer = trainer.processing_class
    for prompt_ids, completion_ids, _ in record.conversations:
        for prompt, completion in zip(prompt_ids, completion_ids):
            call, result, answer = taught_completion(tokenizer, *prompt_sum(tokenizer, prompt))
            expected = call if len(call) + len(result) > limit else (call + result + answer)[:limit]
            assert completion == expected


def test_the_tool_loop_sees_an_engines_context_below_the_policys(tool_policy_dir, tmp_path):
    """Rollouts on an engine of the package's whose context (27 tokens; a stand-in engine here: its context is all
    the loop reads) is below the policy's ``max_position_embeddings``: TRL's tool loop drops a tool result that would
    fill it (9+8: the 8-token prompt, "[add a=9 b=8]</s>" and "|17\\n>" make 27) and keeps one that fits (3+4: 26),
    as it does for an engine of its own; the policy's config is left as it was. A prompt that fills the context is
    refused, naming ``vllm_max_model_length``, rather than falling back to plain generation at every step."""
    ceiling = 27
    trainer = tool_trainer(tool_policy_dir, tmp_path, top_k=1, num_speculative_tokens=2)
    trainer.rollouts.engine = SimpleNamespace(max_model_len=ceiling)
    positions = trainer.model.config.max_position_embeddings
    assert positions > ceiling
    record = record_tool_run(trainer)
    trainer.train()
    assert trainer.model.config.max_position_embeddings == positions
    assert not any("spec/fallback" in entry for entry in trainer.state.log_history)
    assert record.speculative_turns == len(record.turns) == 3  # 3+4 ran its second turn, 9+8 did not
    tokenizer = trainer.processing_class
    for prompt_ids, completion_ids, _ in record.conversations:
        for prompt, completion in zip(prompt_ids, completion_ids):
            call, result, answer = taught_completion(tokenizer, *prompt_sum(tokenizer, prompt))
            kept = len(prompt) + len(call) + len(result) < ceiling
            assert completion == (call + result + answer if kept else call)

    too_long = [tokenizer.bos_token_id] + tokenizer("u:" + "1" * ceiling, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match=rf"{len(too_long)} tokens.*vllm_max_model_length={ceiling}"):
        trainer._generate_single_turn([too_long], None, {}, 1)
    assert "spec/fallback" not in trainer._metrics["train"]


def test_a_multi_turn_step_logs_its_turns_once_weighted_by_what_each_measured(tool_policy_dir, tmp_path):
    """A step of two turns (the tool call, the answer after its result) logs one value per ``spec/*`` metric over both
    turns (acceptance over all verifications, throughput over all tokens and seconds, not means over turns of
    different lengths) and gets one acceptance entry on the model card; its tool loop is timed apart from the
    generation, and the turns per rollout are logged."""
    trainer = tool_trainer(tool_policy_dir, tmp_path, num_speculative_tokens=2)
    counted, by_step = trainer.rollouts._count, []

    def count(counters, num_tokens, elapsed, **kwargs):
        by_step[-1].append((counters.num_drafts, counters.num_accepted_tokens, num_tokens, elapsed))
        return counted(counters, num_tokens, elapsed, **kwargs)

    generate = trainer._generate

    def generate_step(prompts):
        by_step.append([])
        return generate(prompts)

    trainer.rollouts._count, trainer._generate = count, generate_step
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert len(steps) == len(by_step) == trainer.args.max_steps
    for entry, turns in zip(steps, by_step):
        drafts, accepted, tokens, seconds = (sum(values) for values in zip(*turns))
        assert len(turns) == 2
        assert entry["spec/acceptance_length"] == pytest.approx(1 + accepted / drafts)
        assert entry["spec/tokens_per_second"] == pytest.approx(tokens / seconds)
        assert entry["tools/turns_per_rollout"] == 2.0  # every rollout called the tool once, then answered
        assert entry["time/tool_calls"] > 0
        parts = ("generation", "draft_training", "weight_sync", "tool_calls", "policy_training")
        assert sum(entry[f"time/{part}"] for part in parts) == pytest.approx(entry["time/step"])
    assert [step for step, _ in trainer.rollouts.acceptance_history] == [entry["step"] for entry in steps]


def test_a_later_turn_asks_for_no_more_than_its_conversations_budget_leaves():
    """The rows of a tool-loop turn extend the batch's prompts; TRL keeps at most ``max_completion_length`` tokens
    after a prompt, so the turn asks for its roomiest row's rest; a row no prompt begins gets the whole budget."""
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5]]
    assert conversation_budget([[1, 2, 3, 9, 9, 9, 9], [4, 5, 9, 9]], prompts, 10) == 8
    assert conversation_budget([[1, 2, 3, *[9] * 10]], prompts, 10) == 1  # nothing left: one token, cut by TRL
    assert conversation_budget([[7, 7, 7, 7]], prompts, 10) == 10
    # a row two prompts begin (one a prefix of the other) takes the shorter: the larger rest
    assert conversation_budget([[1, 2, 3, 4, 9]], [[1, 2], [1, 2, 3, 4]], 10) == 7


def test_the_answer_turn_asks_for_the_budget_the_conversation_leaves(tool_policy_dir, tmp_path):
    """In the loop the answer turn asks for what the call and the tool's result leave of ``max_completion_length``
    (TRL would cut the rest), the first turn for all of it; the conversations stay TRL's (the greedy test above)."""
    trainer = tool_trainer(tool_policy_dir, tmp_path, num_speculative_tokens=2)
    asked, generate = [], trainer.rollouts.generate

    def recorded(prompt_ids, **kwargs):
        asked.append((prompt_ids, kwargs["max_tokens"]))
        return generate(prompt_ids, **kwargs)

    trainer.rollouts.generate = recorded
    trainer.train()
    limit = COMPLETION_TOKENS + 4
    assert len(asked) == 2 * trainer.args.max_steps  # each step: the call turn, then the answer turn
    assert [max_tokens for _, max_tokens in asked[::2]] == [None] * trainer.args.max_steps
    for (first, _), (second, max_tokens) in zip(asked[::2], asked[1::2]):
        # one prompt per step: a row's conversation so far is its call and the tool's result after that prompt
        assert all(row[: len(first[0])] == first[0] for row in second)
        assert max_tokens == limit - min(len(row) - len(first[0]) for row in second) < limit
