"""A tiny policy taught to call an ``add`` tool, for the multi-turn (tool-calling) rollout tests.

A short supervised fit teaches the policy the whole conversation ``u:3+4\\n>[add a=3 b=4]</s>|7\\n>7</s>`` (the
compact tool-calling template of `build_char_tokenizer(tool_calling=True)`), so that TRL's tool loop really runs a
second turn: the policy calls the tool, TRL appends its result, the policy answers. Tests take the folder from the
session fixture `tool_policy_dir` (tests/conftest.py); `tool_trainer` builds the trainer around it with either
``tools=[add]`` or ``environment_factory=AddEnvironment``.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from tiny_policy import TINY_POLICY_SPEC, tiny_grpo_kwargs
from trl import GRPOConfig

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target


FIT_STEPS = 100
FIT_LEARNING_RATE = 3e-3
# The prompts the GRPO runs roll out (every prompt of the fit is one of the hundred sums of two digits).
TRAIN_SUMS = [(3, 4), (9, 8), (0, 5), (7, 7), (2, 9), (6, 1), (5, 5), (8, 3)]
# A conversation's completion: "[add a=3 b=4]</s>" (14 tokens), the tool result "|7\n>" (up to 5), "7</s>" (up to 3).
COMPLETION_TOKENS = 22


def add(a: int, b: int) -> int:
    """
    Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


class AddEnvironment:
    """An environment whose one tool is ``add``; it counts its calls."""

    def __init__(self):
        self.calls = 0

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """
        Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b


def tool_tokenizer():
    return build_char_tokenizer(tool_calling=True)


def sum_prompt(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"{a}+{b}"}]


def sum_conversation(a: int, b: int) -> list[dict]:
    """The conversation the policy is taught: it calls ``add``, reads the result and answers with it."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [
        *sum_prompt(a, b),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]


def tool_result_text(a: int, b: int) -> str:
    """What TRL appends after the tool call (the tool result and the next generation prompt): the tokens the loss
    masks (``tool_mask`` 0)."""
    return f"|{a + b}\n>"


def save_tool_policy(folder: str | Path) -> Path:
    """Teach the tiny policy (`TINY_POLICY_SPEC`) every ``a+b`` conversation of two digits by a short supervised fit
    (the assistant's and the tool's tokens), and save it with the tool-calling tokenizer to `folder`."""
    tokenizer = tool_tokenizer()
    spec = dict(TINY_POLICY_SPEC)
    model = build_tiny_target(spec.pop("family"), tokenizer=tokenizer, **spec)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rows = [tokenizer.apply_chat_template(sum_conversation(a, b), tokenize=True, return_dict=False) for a, b in pairs]
    prompt_lengths = [
        len(
            tokenizer.apply_chat_template(
                sum_prompt(a, b), add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for a, b in pairs
    ]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (row, prompt_length) in enumerate(zip(rows, prompt_lengths)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        labels[i, prompt_length : len(row)] = input_ids[i, prompt_length : len(row)]
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=FIT_LEARNING_RATE, weight_decay=0.0)
    for _ in range(FIT_STEPS):
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.random.set_rng_state(generator_state)
    model.eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def correct_sum(prompts, completions, **kwargs) -> list[float]:
    """1 where the conversation's last message is the prompt's sum."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        a, b = map(int, prompt[-1]["content"].split("+"))
        rewards.append(float(completion[-1].get("content") == str(a + b)))
    return rewards


def tool_trainer(
    policy_dir: str | Path,
    output_dir: str | Path,
    *,
    environment: bool = False,
    sums: list[tuple[int, int]] = TRAIN_SUMS,
    **overrides,
) -> SpecCoTrainGRPOTrainer:
    """A 2-step GRPO run of the taught policy on `sums` (one prompt of 4 generations per step) with ``tools=[add]``,
    or ``environment_factory=AddEnvironment`` with `environment`; ``overrides``: config fields."""
    spec = {"draft_learning_rate": 1e-3, "draft_warmup_steps": 0}
    spec.update({k: overrides.pop(k) for k in list(overrides) if k not in GRPOConfig.__dataclass_fields__})
    settings = tiny_grpo_kwargs(output_dir, max_steps=2, max_completion_length=COMPLETION_TOKENS + 4) | overrides
    return SpecCoTrainGRPOTrainer(
        model=str(policy_dir),
        reward_funcs=correct_sum,
        args=SpecCoTrainConfig(**settings, **spec),
        train_dataset=Dataset.from_dict({"prompt": [sum_prompt(a, b) for a, b in sums]}),
        processing_class=tool_tokenizer(),
        **({"environment_factory": AddEnvironment} if environment else {"tools": [add]}),
    )


@dataclass
class ToolRunRecord:
    """What a run's multi-turn rollouts did: every turn TRL generated (its prompts), the turns the speculative
    rollouts served, each step's conversations (`_generate`'s prompt ids, completion ids and tool mask) and what the
    draft co-trainer received (the policy's GRPO inputs with the draft's loss mask)."""

    turns: list[list[list[int]]] = field(default_factory=list)
    speculative_turns: int = 0
    conversations: list[tuple[list, list, list]] = field(default_factory=list)
    draft_inputs: list[tuple[dict, torch.Tensor]] = field(default_factory=list)


def record_tool_run(trainer: SpecCoTrainGRPOTrainer) -> ToolRunRecord:
    """Wrap the trainer's turns, rollouts, conversations and the draft's recorded taps to fill a `ToolRunRecord`."""
    record = ToolRunRecord()
    generate_turn, speculative_turn = trainer._generate_single_turn, trainer.rollouts.turn
    generate, record_taps = trainer._generate, trainer.parallel.record_taps

    def single_turn(prompt_ids, *args, **kwargs):
        record.turns.append([list(ids) for ids in prompt_ids])
        return generate_turn(prompt_ids, *args, **kwargs)

    def turn(*args, **kwargs):
        record.speculative_turns += 1
        return speculative_turn(*args, **kwargs)

    def conversations(prompts):
        out = generate(prompts)
        prompt_ids, completion_ids, tool_mask = out[:3]
        record.conversations.append(([list(i) for i in prompt_ids], [list(i) for i in completion_ids], tool_mask))
        return out

    def taps(taps, inputs):
        recorded = trainer.draft_cotrainer.record

        def keep(item):
            record.draft_inputs.append(({k: v for k, v in inputs.items() if torch.is_tensor(v)}, item.loss_mask))
            return recorded(item)

        trainer.draft_cotrainer.record = keep
        try:
            return record_taps(taps, inputs)
        finally:
            trainer.draft_cotrainer.record = recorded

    trainer._generate_single_turn, trainer.rollouts.turn = single_turn, turn
    trainer._generate, trainer.parallel.record_taps = conversations, taps
    return record


def prompt_sum(tokenizer, prompt_ids: list[int]) -> tuple[int, int]:
    """The two digits of a rendered prompt ``<s>u:a+b\\n>``."""
    content = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    a, b = content.removeprefix("u:").removesuffix(">").strip().split("+")
    return int(a), int(b)


def taught_completion(tokenizer, a: int, b: int) -> tuple[list[int], list[int], list[int]]:
    """The taught conversation's completion as TRL builds it: the tool call turn, the tool result (with the next
    generation prompt) and the answer turn, as token ids."""
    full = tokenizer.apply_chat_template(sum_conversation(a, b), tokenize=True, return_dict=False)
    prompt = tokenizer.apply_chat_template(
        sum_prompt(a, b), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    call_end = full.index(tokenizer.eos_token_id) + 1
    result = tokenizer(tool_result_text(a, b), add_special_tokens=False)["input_ids"]
    return full[len(prompt) : call_end], result, full[call_end + len(result) :]


def assert_multi_turn_and_speculative(trainer: SpecCoTrainGRPOTrainer, record: ToolRunRecord) -> None:
    """Every step called the tool and ran a second turn, every turn was served by the speculative rollouts (none fell
    back), and the draft co-trainer's loss mask is the policy's (`completion_mask * tool_mask`) with the tool results
    out of it."""
    steps = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert len(steps) == trainer.args.max_steps
    assert all(entry["tools/call_frequency"] > 0 for entry in steps)
    assert not any("spec/fallback" in entry for entry in trainer.state.log_history)
    assert all("spec/num_speculative_tokens" in entry for entry in steps)
    assert "spec/acceptance_length" in steps[0]
    assert len(record.turns) == 2 * len(steps)  # the tool call, then the answer after the tool's result
    assert record.speculative_turns == len(record.turns)

    tokenizer = trainer.processing_class
    assert record.draft_inputs
    tool_tokens = 0
    for inputs, loss_mask in record.draft_inputs:
        completion_mask, tool_mask = inputs["completion_mask"], inputs["tool_mask"]
        prompt_zeros = torch.zeros_like(inputs["prompt_mask"])
        assert torch.equal(loss_mask, torch.cat([prompt_zeros, completion_mask * tool_mask], dim=1))
        for prompt_ids, prompt_mask, completion_ids, completion, tool in zip(
            inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], completion_mask, tool_mask
        ):
            a, b = prompt_sum(tokenizer, prompt_ids[prompt_mask.bool()].tolist())
            masked_out = completion_ids[(completion * (1 - tool)).bool()].tolist()
            assert tokenizer.decode(masked_out) == tool_result_text(a, b)
            tool_tokens += len(masked_out)
    assert tool_tokens > 0
