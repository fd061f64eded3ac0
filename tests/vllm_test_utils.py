"""Helpers shared by the vLLM tests and their fixtures (a module, not conftest: `tests/distributed` has a
conftest of its own, so `import conftest` would be ambiguous)."""

from pathlib import Path

import torch
from transformers import AutoTokenizer


PROMPT_TEXTS = (
    "def fibonacci(n):\n",
    "The quick brown fox",
    "import torch\nx = torch.",
    # Longer than one KV block.
    "A long prompt that fills more than one key-value cache block, so that the prefix cache can hit. " * 2,
)


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF greedy completions of exactly `max_tokens` tokens (no stop at EOS), one prompt at a time."""
    completions = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, eos_token_id=None
            )
            completions.append(out[0, len(prompt) :].tolist())
    return completions


def tiny_prompts(folder: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [[tokenizer.bos_token_id, *tokenizer(text).input_ids] for text in PROMPT_TEXTS]
