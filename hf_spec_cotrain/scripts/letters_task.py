"""The main job's embedded task: continue a letter sequence drawn from a fixed random Markov chain over ``abcdefgh``.

A small policy learns the chain by supervised training and a draft is warm-started on the policy's own samples (both
cached); GRPO then rewards completions rich in ``efgh`` (`letters`), which moves the policy far from where the draft
was trained: the case co-training is for.
"""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..testing import build_char_tokenizer, build_tiny_target
from ..warmstart import DraftTrainingConfig, train_draft


LETTERS = "abcdefgh"
REWARDED_LETTERS = set("efgh")
SEED_LENGTH, COMPLETION_LENGTH = 4, 128
MIN_DISTINCT_LETTERS = 5
TASK_SEED = 0
ASSETS_VERSION = 6  # bump when the policy or the draft would be built differently


def markov_chain() -> torch.Tensor:
    """Transition probabilities of the task's letter sequences, ``[8, 8]`` (row: current letter)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TASK_SEED)
        return torch.distributions.Dirichlet(torch.full((len(LETTERS),), 0.7)).sample((len(LETTERS),))


def sample_letters(chain: torch.Tensor, count: int, length: int, generator: torch.Generator) -> list[str]:
    current = torch.randint(0, len(LETTERS), (count,), generator=generator)
    rows = [current]
    for _ in range(length - 1):
        current = torch.multinomial(chain[current], 1, generator=generator).squeeze(1)
        rows.append(current)
    return ["".join(LETTERS[i] for i in seq) for seq in torch.stack(rows, 1).tolist()]


def letters(completions, **kwargs) -> list[float]:
    """Share of e/f/g/h letters, scaled by how well a completion keeps the rules: 128 letters of ``abcdefgh``, at
    least 5 distinct, no letter 3 times in a row.

    A completion that keeps every rule scores its ``efgh`` share; each broken rule scales that down in proportion to
    how badly it is broken (the share of other characters, of letters opening a triple repeat, of missing distinct
    letters). A graded reward leaves every group of samples a gradient: with an all-or-nothing one (0 for any break),
    a policy that drifted to breaking a rule everywhere scored 0 on every sample and never came back.
    """
    return [letters_score(text, COMPLETION_LENGTH) for text in completions]


def letters_score(text: str, length: int) -> float:
    """`letters`'s score of ``text`` where ``length`` letters are due (a shorter text counts as that long)."""
    length = max(len(text), length)
    in_alphabet = sum(ch in LETTERS for ch in text) / length
    triples = sum(text[i] == text[i + 1] == text[i + 2] for i in range(len(text) - 2))
    no_triples = 1.0 - triples / max(len(text) - 2, 1)
    distinct = min(len(set(text) & set(LETTERS)) / MIN_DISTINCT_LETTERS, 1.0)
    share = sum(ch in REWARDED_LETTERS for ch in text) / length
    return share * in_alphabet * no_triples * distinct


def probe_prompts(dataset: Dataset, count: int, tokenizer, reward):
    """The drift probe's prompts (the last ``count`` of the GRPO prompts) and its reward (the job's, ``reward``)."""
    return (dataset["prompt"][-count:] if count else []), reward


# The warm start of each drafter family: EAGLE-3 as before; DFlash two layers (one block forward reads the whole
# context once, where EAGLE-3's chain runs its layer K times) and more anchors per sequence (its blocks are few).
WARM_STARTS = {
    "eagle3": {},
    "dflash": {"num_layers": 2, "dflash_anchors_per_row": 16},
}


def embedded_assets(
    cache_dir: str | Path,
    *,
    sft_steps: int,
    warm_start_steps: int,
    warm_start_samples: int,
    seed: int,
    drafters: tuple[str, ...] = ("eagle3",),
) -> tuple[Path, dict[str, Path], Dataset]:
    """The embedded policy, a warm-start draft of each of ``drafters`` (each built once, then cached under
    ``cache_dir``) and the GRPO prompts. Budgets are in steps, not seconds, so that a busy machine builds the same
    policy and drafts."""
    chain = markov_chain()
    generator = torch.Generator().manual_seed(seed)
    prompts = Dataset.from_dict({"prompt": [s + ":" for s in sample_letters(chain, 1024, SEED_LENGTH, generator)]})
    tokenizer = build_char_tokenizer(alphabet=LETTERS + ":")

    def sequences(generator: torch.Generator) -> list[str]:
        # No EOS: a rollout runs to `max_completion_length`, as RL rollouts of a fixed budget do.
        texts = sample_letters(chain, 16, SEED_LENGTH + COMPLETION_LENGTH, generator)
        return [text[:SEED_LENGTH] + ":" + text[SEED_LENGTH:] for text in texts]

    def samples(policy) -> Dataset:
        texts = generate_texts(policy, tokenizer, prompts["prompt"][:warm_start_samples], temperature=1.0)
        return Dataset.from_dict({"text": texts})

    policy_dir, draft_dirs = cached_assets(
        Path(cache_dir).expanduser() / "embedded",
        {"version": ASSETS_VERSION, "sft_steps": sft_steps, "seed": seed},
        tokenizer,
        train_policy=lambda: supervised_policy(tokenizer, sequences, sft_steps, seed),
        policy_samples=samples,
        drafters=drafters,
        warm_start_steps=warm_start_steps,
        warm_start_samples=warm_start_samples,
        seed=seed,
        max_length=64,
    )
    return policy_dir, draft_dirs, prompts


def cached_assets(
    root: Path,
    settings: dict,
    tokenizer,
    *,
    train_policy: Callable[[], PreTrainedModel],
    policy_samples: Callable[[PreTrainedModel], Dataset],
    drafters: tuple[str, ...],
    warm_start_steps: int,
    warm_start_samples: int,
    seed: int,
    max_length: int,
) -> tuple[Path, dict[str, Path]]:
    """An embedded task's policy (``train_policy``) and a warm-start draft of each of ``drafters``, trained on
    ``policy_samples`` of that policy in sequences of ``max_length`` tokens, each built once and cached under
    ``root`` with its ``settings`` (a policy built with other settings is rebuilt, and its drafts with it)."""
    draft_settings = {**settings, "warm_start_steps": warm_start_steps, "warm_start_samples": warm_start_samples}
    policy_dir, manifest = root / "policy", root / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()) == settings:
        print(f"[grpo] embedded policy from the cache: {root}")
        policy = None
    else:
        policy = train_policy()
        policy.save_pretrained(policy_dir)
        tokenizer.save_pretrained(policy_dir)
        manifest.write_text(json.dumps(settings))
        for stale in root.glob("draft-*.json"):  # drafts of another policy
            stale.unlink()
    draft_dirs = {}
    for drafter in drafters:
        draft_dir, draft_manifest = root / f"draft-{drafter}", root / f"draft-{drafter}.json"
        draft_dirs[drafter] = draft_dir
        if draft_manifest.exists() and json.loads(draft_manifest.read_text()) == draft_settings:
            continue
        if policy is None:
            policy = AutoModelForCausalLM.from_pretrained(policy_dir)
        samples = policy_samples(policy)  # the draft learns from what the policy actually writes
        draft_config = DraftTrainingConfig(
            output_dir=str(draft_dir),
            drafter=drafter,
            max_steps=warm_start_steps,
            batch_size=32,
            max_length=max_length,
            learning_rate=2e-3,
            warmup_steps=20,
            eval_steps=100,
            seed=seed,
            # the characters fill the vocabulary: DFlash's blocks are filled with <unk>, which no letter is
            dflash_mask_token_id=tokenizer.unk_token_id,
            **WARM_STARTS.get(drafter, {}),
        )
        result = train_draft(policy, tokenizer, samples, draft_config)
        print(f"[grpo] warm-start {drafter} draft: {result.steps} steps, held-out {result.history[-1]}")
        draft_manifest.write_text(json.dumps(draft_settings))
    return policy_dir, draft_dirs


def supervised_policy(tokenizer, texts: Callable[[torch.Generator], list[str]], steps: int, seed: int):
    """A tiny Llama trained on ``texts`` (a batch of 16 texts of one length in tokens per call), so that it writes
    what they do."""
    policy = build_tiny_target(
        "llama",
        num_layers=12,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=256,
        tokenizer=tokenizer,
        seed=seed,
    )
    generator = torch.Generator().manual_seed(seed + 1)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(1, steps + 1):
        batch = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts(generator)])
        loss = policy(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"[grpo] supervised step {step}: loss {loss.item():.3f}")
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    return policy.eval()


@torch.no_grad()
def generate_texts(
    policy, tokenizer, prompts: list[str], *, temperature: float, max_new_tokens: int = COMPLETION_LENGTH
) -> list[str]:
    """Each prompt followed by the policy's sampled continuation (its special tokens left out)."""
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completions = generate_ids(policy, tokenizer, ids, temperature=temperature, max_new_tokens=max_new_tokens)
    return [p + tokenizer.decode(c, skip_special_tokens=True) for p, c in zip(prompts, completions)]


@torch.no_grad()
def generate_ids(
    policy, tokenizer, prompts: list[list[int]], *, temperature: float, max_new_tokens: int
) -> list[list[int]]:
    """The policy's sampled continuation of each prompt (token ids), up to and with its EOS."""
    encoded = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    out = policy.generate(
        **encoded,
        do_sample=True,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    rows = out[:, encoded["input_ids"].shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]
