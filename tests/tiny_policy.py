"""The tiny policy of the trainer tests, one spec for all of them (a module, not conftest: see vllm_test_utils).

Tests take the folder from the session fixture `tiny_policy_dir` (tests/conftest.py); code that no fixture reaches
(a script run under torchrun or mp.spawn) calls `save_tiny_policy`. What the tests rely on: 8 layers (the default
taps of an 8-layer target are layers 2, 4 and 5; a 2-stage pipeline splits them 4 + 4), the Llama family (FSDP2
wraps `LlamaDecoderLayer`), and head_dim 32, the smallest vLLM-CPU's attention takes.
"""

from pathlib import Path

from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from hf_spec_cotrain.testing import build_char_tokenizer, fill_seeded, save_tiny_target


TINY_POLICY_SPEC = {
    "family": "llama",
    "num_layers": 8,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
}


def save_tiny_policy(folder: str | Path, **overrides) -> Path:
    """Save the tiny policy (`TINY_POLICY_SPEC`, updated with `overrides`) to `folder`; returns the folder."""
    spec = TINY_POLICY_SPEC | overrides
    return save_tiny_target(folder, spec.pop("family"), **spec)


def tiny_grpo_kwargs(tmp_path, **overrides) -> dict:
    """The `GRPOConfig` fields of the trainer tests' short GRPO run on the tiny policy (4 rows of 4 generations,
    12-token completions, 3 steps, no shuffling), updated with `overrides`."""
    return {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 12,
        "max_steps": 3,
        "logging_steps": 1,
        "save_strategy": "no",
        "learning_rate": 1e-3,
        "temperature": 1.0,
        "seed": 7,
        "shuffle_dataset": False,
    } | overrides


def save_tiny_policy_of_type(folder: str | Path, model_type: str, **config_overrides) -> Path:
    """Save a policy of any transformers ``model_type`` (its default config at `TINY_POLICY_SPEC`'s sizes, updated with
    `config_overrides`; seeded weights as `save_tiny_target`'s) with the character tokenizer, for families
    `save_tiny_target` does not build; returns the folder."""
    tokenizer = build_char_tokenizer()
    sizes = {key: value for key, value in TINY_POLICY_SPEC.items() if key not in ("family", "num_layers")}
    config = CONFIG_MAPPING[model_type](
        **{
            **sizes,
            "num_hidden_layers": TINY_POLICY_SPEC["num_layers"],
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **config_overrides,
        }
    )
    model = AutoModelForCausalLM.from_config(config)
    fill_seeded(model, seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
