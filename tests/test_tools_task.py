"""The main job's embedded multi-turn task (``--task tools``, hf_spec_cotrain/scripts/tools_task.py): the tool, the
reward that needs its result, the rendered and parsed turns, the options, the report's lines, and a tiny run."""

import math

import pytest
import torch
from main_job_args import tiny_job_args
from trl.chat_template_utils import parse_response

from hf_spec_cotrain.scripts import grpo, report, tools_task
from hf_spec_cotrain.testing import build_char_tokenizer


CODE = "ABCD"
LETTERS = ("efghaefghe" * 20)[: tools_task.ANSWER_LETTERS]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(tools_task.ALPHABET, tool_calling=True)


def rollout(code: str, answer: str, *, called_with: str | None = None) -> list[dict]:
    """The completion messages of a rollout that called the tool on ``called_with`` (default: its code)."""
    return tools_task.conversation(called_with or code, answer)[1:]


def test_the_reward_needs_the_tools_result():
    key = tools_task.key(CODE)
    assert len(key) == tools_task.KEY_LENGTH and set(key) <= set(tools_task.CODE_LETTERS)
    assert tools_task.key(CODE) == key != tools_task.key("ABCE")  # deterministic, and it depends on the code
    prompts = [[{"role": "user", "content": CODE}]] * 5
    wrong_key = "".join("A" if letter != "A" else "B" for letter in key)
    other = "HHHH"
    rewards = tools_task.key_letters(
        prompts,
        [
            rollout(CODE, key + LETTERS),
            rollout(CODE, key[:2] + wrong_key[2:] + LETTERS),
            rollout(CODE, wrong_key + LETTERS),
            rollout(CODE, tools_task.key(other) + LETTERS, called_with=other),  # the key of another code
            [{"role": "assistant", "content": key + LETTERS}],  # the right key, but no tool was called
        ],
    )
    full = tools_task.letters_score(LETTERS, tools_task.ANSWER_LETTERS)
    assert rewards[0] == pytest.approx(full) and full > 0
    assert rewards[1] == pytest.approx(full / 2)  # graded: half of the key's letters in place
    assert rewards[2] == 0.0
    assert rewards[3] < full
    assert rewards[4] == 0.0


def test_the_conversation_renders_as_the_token_counts_say_and_a_sampled_call_parses(tokenizer):
    messages = tools_task.conversation(CODE, tools_task.key(CODE) + LETTERS)
    user = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(user) == tools_task.PROMPT_TOKENS
    text = tools_task.render(tokenizer, messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # the call turn, then the tool's result and the next generation prompt, then the answer without EOS
    call = ids[len(user) : len(user) + tools_task.CALL_TOKENS]
    assert call[-1] == tokenizer.eos_token_id and tokenizer.decode(call[:-1]) == f"[key s={CODE}]"
    result = ids[len(user) + tools_task.CALL_TOKENS : len(user) + tools_task.CALL_TOKENS + tools_task.RESULT_TOKENS]
    assert tokenizer.decode(result) == f"|{tools_task.key(CODE)}\n>"
    assert ids[-1] != tokenizer.eos_token_id
    assert len(ids) == tools_task.PROMPT_TOKENS + tools_task.CALL_TOKENS + tools_task.RESULT_TOKENS + 4 + len(LETTERS)
    # the call as the policy samples it, parsed as TRL's tool loop parses it, runs the tool
    message = parse_response(tokenizer, call, prefix=user, tools=tools_task.TOOLS)
    assert message["tool_calls"] == [tools_task.tool_call(CODE)]
    arguments = message["tool_calls"][0]["function"]["arguments"]
    assert tools_task.key(**arguments) == tools_task.key(CODE)
    # the probe's prompt is the rollout up to the answer: the ids TRL's loop builds for the answer turn
    prompts, reward = tools_task.probe_prompts({"prompt": [messages[:1]]}, 1, tokenizer, reward=None)
    assert tokenizer(prompts[0], add_special_tokens=False)["input_ids"] == ids[: len(user) + len(call) + len(result)]
    assert reward(completions=[tools_task.key(CODE) + LETTERS]) == tools_task.key_letters(
        [messages[:1]], [messages[1:]]
    )


class ScriptedPolicy:
    """Writes the task's turns, as a taught policy would: the call on the prompt's code, then (after the tool's
    result) the result read back and letters; ``answer_with`` replaces what it reads back."""

    def __init__(self, tokenizer, answer_with: str | None = None):
        self.tokenizer, self.answer_with = tokenizer, answer_with

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        rows = []
        for ids in input_ids.tolist():
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            if text.endswith("|" + text[-6:-2] + "\n>"):  # after the tool's result
                turn = (self.answer_with or text[-6:-2]) + LETTERS
            else:
                turn = f"[key s={text[-6:-2]}]" + self.tokenizer.eos_token
            rows.append(ids + self.tokenizer(turn, add_special_tokens=False)["input_ids"][:max_new_tokens])
        return torch.tensor(rows)


def test_sampled_rollouts_call_the_tool_and_answer_with_its_result(tokenizer):
    codes = ["ABCD", "HGFE"]
    rollouts = tools_task.sample_conversations(ScriptedPolicy(tokenizer), tokenizer, codes, temperature=1.0)
    for code, messages in zip(codes, rollouts):
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
        assert messages[1]["tool_calls"] == [tools_task.tool_call(code)]  # the sampled call, parsed
        assert messages[2]["content"] == tools_task.key(code)  # the tool ran on it
        assert messages[3]["content"].startswith(tools_task.key(code))
    assert tools_task.rollout_shares(rollouts) == (1.0, 1.0)
    assert min(tools_task.key_letters([m[:1] for m in rollouts], [m[1:] for m in rollouts])) > 0
    # a policy that ignores the result: still called, never answered with the key
    ignoring = tools_task.sample_conversations(ScriptedPolicy(tokenizer, "AAAA"), tokenizer, codes, temperature=1.0)
    assert tools_task.rollout_shares(ignoring) == (1.0, 0.0)


def test_the_task_option_sets_the_tool_tasks_defaults_and_refuses_what_cannot_run():
    letters, letters_config = grpo.parse_args([])
    tools, tools_config = grpo.parse_args(["--task", "tools"])
    assert letters.task == "letters" and letters.reward_funcs == ["letters"]
    assert tools.task == "tools" and tools.reward_funcs == ["key_letters"]
    assert letters_config.output_dir == "outputs/grpo/embedded-hf"
    assert tools_config.output_dir == "outputs/grpo/embedded-tools-hf"
    assert tools_config.max_completion_length == letters_config.max_completion_length
    assert tools_config.vllm_max_model_length > letters_config.vllm_max_model_length  # the call and result
    assert grpo.parse_args(["--task=tools"])[0].reward_funcs == ["key_letters"]
    with pytest.raises(ValueError, match="--model_name_or_path"):
        grpo.parse_args(["--task", "tools", "--model_name_or_path", "some/policy"])
    shortest = tools_task.CALL_TOKENS + tools_task.RESULT_TOKENS + tools_task.KEY_LENGTH + 1
    with pytest.raises(ValueError, match=f"max_completion_length`={shortest - 1}"):
        grpo.parse_args(["--task", "tools", "--max_completion_length", str(shortest - 1)])
    grpo.parse_args(["--task", "tools", "--max_completion_length", str(shortest)])
    with pytest.raises(SystemExit):  # argparse names the choices
        grpo.parse_args(["--task", "chess"])


def _history(generation: float, tools: bool) -> list[dict]:
    entry = {"step": 1, "reward": 0.5, "time/step": 1.0, "time/generation": generation, "time/policy_training": 0.4}
    entry.update({"rollout/tokens_per_second": 100.0, "spec/tokens_per_second": 150.0, "time/tool_calls": 0.0})
    if tools:  # every run logs the tool loop's time, 0 without tools
        entry.update({"time/tool_calls": 0.1, "tools/turns_per_rollout": 2.0, "tools/call_frequency": 1.0})
    return [entry]


@pytest.mark.parametrize("tools", [False, True])
def test_the_report_adds_the_tools_lines_only_where_tools_ran(tmp_path, capsys, tools):
    runs = {"eagle3": (_history(0.4, tools), 10.0), report.PLAIN: (_history(0.5, tools), 12.0)}
    summary = report.report(runs, {}, tmp_path)["summary"]
    console = capsys.readouterr().out
    assert ("share of step: tool_calls" in console) == tools
    assert ("assistant turns per rollout" in console) == tools
    for run in runs:
        shares = [value for name, value in summary[run].items() if name.startswith("share_")]
        assert sum(shares) == pytest.approx(1.0)
        assert ("turns_per_rollout" in summary[run]) == tools
    if tools:
        assert summary["eagle3"]["share_tool_calls"] == pytest.approx(0.1 / 0.9)
        assert summary[report.PLAIN]["turns_per_rollout"] == 2.0
    else:  # the default task's table as it was
        assert "share_tool_calls" not in summary["eagle3"]
        assert summary["eagle3"]["share_generation"] == pytest.approx(0.4 / 0.8)
    assert not math.isnan(summary["eagle3"]["end_to_end_speedup"])


@pytest.mark.slow
def test_the_main_job_runs_the_tool_task_multi_turn_in_both_runs(tmp_path, capsys):
    """A tiny `--task tools` run: both runs (EAGLE-3 co-trained, plain TRL) roll out with the tool, log the tools'
    metrics, and the probes read the answer turn."""
    result = grpo.main(["--task", "tools", "--drafter", "eagle3", *tiny_job_args(tmp_path, max_completion_length=32)])
    rows, summary = result["rows"], result["summary"]
    console = capsys.readouterr().out
    assert "[grpo] eagle3 probe at step 2" in console and "tool calls per rollout" in console
    for row in rows[1:]:
        for run in ("eagle3", "plain"):
            assert 0.0 <= row[f"reward_{run}"] <= 1.0 and row[f"tokens_per_s_{run}"] > 0
            assert row[f"tool_calls_per_rollout_{run}"] >= 0
    assert rows[1]["turns_per_rollout_plain"] >= 1
    assert rows[0]["acceptance_cotrained_eagle3"] == rows[0]["acceptance_frozen_eagle3"] >= 1.0
    assert 0 <= summary["eagle3"]["probe_rollout_p_value"] <= 1
    assert (tmp_path / "cache" / "embedded-tools" / "manifest.json").exists()
