"""The main job's embedded multi-turn task (``--task tools``): the letters task (`letters_task`) behind a tool call.

The user's turn is a code of 4 capitals of ``ABCDEFGH``. The policy first calls the tool ``[key s=<code>]``, whose
result is the code's key: 4 capitals that only the tool computes (a hash). It then answers with the key followed by
letters of the letters' Markov chain, until the completion budget runs out (no EOS, as the letters task). The reward
(`key_letters`) is the letters reward of the answer, scaled by the share of the code's key it starts with, and 0 for a
rollout that never got the tool's result: the policy cannot earn it without calling the tool. A rollout is thus two
assistant turns, a short call and a long answer, and the answer is where speculation pays.

Codes and keys are capitals so that they share no token with the rewarded letters: written in ``abcdefgh``, GRPO's
push towards ``efgh`` leaked into the copies of the code and the key: after 80 steps, the EAGLE-3 run's policy called
the tool on its code in 70% of rollouts and answered with the key in 31% (from 100% and 98%), and in every run (plain
TRL's too) whole groups scored 0, which gives GRPO no gradient back.

The rendered conversation (`build_char_tokenizer(tool_calling=True)`'s compact template) is
``<s>u:ABCD\\n>[key s=ABCD]</s>|HGFE\\n>HGFEefgh...``: the call is `CALL_TOKENS` tokens, the tool's result with the
next generation prompt `RESULT_TOKENS`, and TRL counts both, with the answer, in ``max_completion_length``.
"""

import hashlib
from pathlib import Path

import torch
from datasets import Dataset
from trl.chat_template_utils import parse_response

from ..testing import TOOL_CALLING_CHARACTERS, build_char_tokenizer
from .letters_task import (
    COMPLETION_LENGTH,
    LETTERS,
    SEED_LENGTH,
    cached_assets,
    generate_ids,
    letters_score,
    markov_chain,
    sample_letters,
    supervised_policy,
)


KEY_LENGTH = 4
TOOL_NAME = "key"
# "[key s=ABCD]" then EOS; "|HGFE\n" then the generation prompt ">".
CALL_TOKENS = len(f"[{TOOL_NAME} s=]") + SEED_LENGTH + 1
RESULT_TOKENS = len("|\n>") + KEY_LENGTH
PROMPT_TOKENS = 1 + len("u:\n>") + SEED_LENGTH  # BOS, the user's turn and the generation prompt
# The letters after the key that the default budget (`COMPLETION_LENGTH`, the letters task's) leaves the answer.
ANSWER_LETTERS = COMPLETION_LENGTH - CALL_TOKENS - RESULT_TOKENS - KEY_LENGTH
CODE_LETTERS = LETTERS.upper()
# the letters, the codes' and keys' capitals, the template's characters, and the tool's name and argument
ALPHABET = LETTERS + CODE_LETTERS + TOOL_CALLING_CHARACTERS + "kys"
ASSETS_VERSION = 2  # bump when the policy or the draft would be built differently
# Supervised steps that teach the call and the copy of its result. At 150 (the letters task's) the policy called the
# tool on its code in 41% of 128 rollouts at temperature 1 and none answered with the key, at 300 98% and 98% (codes in
# abcdefgh, the task's first version); in capitals, at 300: 99% and 99% of 256.
SFT_STEPS = 300


def sample_codes(count: int, generator: torch.Generator) -> list[str]:
    """``count`` codes, uniformly at random."""
    draws = torch.randint(0, len(CODE_LETTERS), (count, SEED_LENGTH), generator=generator).tolist()
    return ["".join(CODE_LETTERS[i] for i in row) for row in draws]


def key(s: str) -> str:
    """The key that opens a code: 4 capitals that nothing but this tool computes.

    Args:
        s: The code, 4 capitals of ABCDEFGH.
    """
    digest = hashlib.sha256(s.encode()).digest()
    return "".join(CODE_LETTERS[byte % len(CODE_LETTERS)] for byte in digest[:KEY_LENGTH])


TOOLS = [key]


def answer_score(answer: str, expected_key: str) -> float:
    """The letters reward of what follows the key in ``answer``, scaled by the share of the key's letters it starts
    with (each in its place)."""
    matched = sum(a == b for a, b in zip(answer[:KEY_LENGTH], expected_key))
    return matched / KEY_LENGTH * letters_score(answer[KEY_LENGTH:], ANSWER_LETTERS)


def key_letters(prompts, completions, **kwargs) -> list[float]:
    """`answer_score` of each rollout's answer (what the policy wrote after the tool's last result) against the key
    of the prompt's code; 0 for a rollout without a tool result."""
    rewards = []
    for prompt, messages in zip(prompts, completions):
        results = [index for index, message in enumerate(messages) if message["role"] == "tool"]
        if not results:
            rewards.append(0.0)
            continue
        answer = "".join(m.get("content") or "" for m in messages[results[-1] + 1 :] if m["role"] == "assistant")
        rewards.append(answer_score(answer, key(prompt[-1]["content"])))
    return rewards


def conversation(code: str, answer: str | None = None) -> list[dict]:
    """The task's conversation about ``code`` up to the tool's result, and ``answer`` after it where given."""
    messages = [
        {"role": "user", "content": code},
        {"role": "assistant", "content": "", "tool_calls": [tool_call(code)]},
        {"role": "tool", "name": TOOL_NAME, "content": key(code)},
    ]
    return messages + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def tool_call(code: str) -> dict:
    """The call on ``code`` as TRL's loop parses it (and the chat template renders it)."""
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"s": code}}}


def render(tokenizer, messages: list[dict]) -> str:
    """``messages`` as the policy reads them: after a tool result with the generation prompt; after an answer
    without the template's closing EOS (answers run to the budget)."""
    if messages[-1]["role"] == "tool":
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return text.removesuffix(tokenizer.eos_token) if messages[-1]["role"] == "assistant" else text


def probe_prompts(dataset: Dataset, count: int, tokenizer, reward):
    """The drift probe's prompts: the conversations of the last ``count`` GRPO prompts up to the answer (the call
    made and its result read), rendered, as acceptance matters on the long answer turns; and its reward, which
    scores those answers against each prompt's key (not the job's ``reward``, which reads whole rollouts)."""
    codes = [prompt[-1]["content"] for prompt in dataset["prompt"][-count:]] if count else []
    keys = [key(code) for code in codes]

    def answers_with_key(completions, **kwargs) -> list[float]:
        return [answer_score(answer, expected) for answer, expected in zip(completions, keys, strict=True)]

    return [render(tokenizer, conversation(code)) for code in codes], answers_with_key


@torch.no_grad()
def sample_conversations(
    policy, tokenizer, codes: list[str], *, temperature: float, answer_tokens: int = COMPLETION_LENGTH
) -> list[list[dict]]:
    """Rollouts of the policy as GRPO runs them: its first turn, parsed; where it called the tool, the tool's result
    and the policy's answer (``answer_tokens`` long at most)."""
    conversations = [[{"role": "user", "content": code}] for code in codes]
    for max_new_tokens in (CALL_TOKENS, answer_tokens):
        going_on = [messages for messages in conversations if messages[-1]["role"] in ("user", "tool")]
        if not going_on:
            break
        prompts = [
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            for messages in going_on
        ]
        turns = generate_ids(policy, tokenizer, prompts, temperature=temperature, max_new_tokens=max_new_tokens)
        for messages, prompt, ids in zip(going_on, prompts, turns):
            message = parse_response(tokenizer, ids, prefix=list(prompt), tools=TOOLS)
            messages.append(message)
            for call in message.get("tool_calls") or []:
                function = call["function"]
                try:
                    result = key(**function["arguments"]) if function["name"] == TOOL_NAME else None
                except TypeError:  # arguments the tool does not take
                    result = None
                messages.append({"role": "tool", "name": function["name"], "content": str(result)})
    return conversations


def rollout_shares(conversations: list[list[dict]]) -> tuple[float, float]:
    """The share of rollouts that called the tool on their code, and the share that then answered with its key."""
    called = [
        messages
        for messages in conversations
        if len(messages) > 1 and tool_call(messages[0]["content"]) in (messages[1].get("tool_calls") or [])
    ]
    answered = [
        messages
        for messages in called
        if len(messages) > 3 and (messages[3].get("content") or "").startswith(key(messages[0]["content"]))
    ]
    return len(called) / len(conversations), len(answered) / len(conversations)


def embedded_assets(
    cache_dir: str | Path,
    *,
    sft_steps: int,
    warm_start_steps: int,
    warm_start_samples: int,
    seed: int,
    drafters: tuple[str, ...] = ("eagle3",),
) -> tuple[Path, dict[str, Path], Dataset]:
    """The tool task's policy, a warm-start draft of each of ``drafters`` trained on the policy's own multi-turn
    rollouts (each built once, then cached under ``cache_dir``) and the GRPO prompts (conversational)."""
    chain = markov_chain()
    generator = torch.Generator().manual_seed(seed)
    codes = sample_codes(1024, generator)
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": code}] for code in codes]})
    tokenizer = build_char_tokenizer(alphabet=ALPHABET, tool_calling=True)
    answer_length = COMPLETION_LENGTH  # what a rollout's answer turn generates before TRL cuts it to the budget

    def conversations(generator: torch.Generator) -> list[str]:
        batch = sample_codes(16, generator)
        letters = sample_letters(chain, 16, answer_length - KEY_LENGTH, generator)
        return [render(tokenizer, conversation(code, key(code) + rest)) for code, rest in zip(batch, letters)]

    def samples(policy) -> Dataset:
        with torch.random.fork_rng(devices=[]):  # the same samples whatever ran before
            torch.manual_seed(seed)
            rollouts = sample_conversations(policy, tokenizer, codes[:warm_start_samples], temperature=1.0)
        called, answered = rollout_shares(rollouts)
        print(f"[grpo] tool task, policy samples: {called:.0%} call the tool, {answered:.0%} answer with its key")
        return Dataset.from_dict({"text": [render(tokenizer, messages) for messages in rollouts]})

    policy_dir, draft_dirs = cached_assets(
        Path(cache_dir).expanduser() / "embedded-tools",
        {"version": ASSETS_VERSION, "sft_steps": sft_steps, "seed": seed},
        tokenizer,
        train_policy=lambda: supervised_policy(tokenizer, conversations, sft_steps, seed),
        policy_samples=samples,
        drafters=drafters,
        warm_start_steps=warm_start_steps,
        warm_start_samples=warm_start_samples,
        seed=seed,
        max_length=PROMPT_TOKENS + CALL_TOKENS + RESULT_TOKENS + answer_length,
    )
    return policy_dir, draft_dirs, prompts
