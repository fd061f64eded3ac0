"""Offline warm start (`train_draft`) and the `hf-spec-cotrain train-draft` command on a tiny 8-layer target."""

import dataclasses
import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from hf_spec_cotrain import cli
from hf_spec_cotrain.draft import (
    DFlashDraftModel,
    Eagle3DraftModel,
    Eagle3TrainingOptions,
    count_tokens,
    select_draft_vocab,
)
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target, save_tiny_target
from hf_spec_cotrain.validation import is_float_field
from hf_spec_cotrain.warmstart import (
    TRAINING_FLOAT_RANGES,
    DraftTrainingConfig,
    evaluate_draft,
    tokenize_for_draft,
    train_draft,
)


NUM_LAYERS = 8
WORDS = (
    "the a draft target model token layer step tree branch speculative decoding accepts rejects samples policy "
    "reward rollout verify propose hidden state attention"
).split()
# Small and fast: the whole file stays well under a minute of CPU.
FAST = {"batch_size": 4, "max_length": 64, "warmup_steps": 3, "logging_steps": 5}


def _sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))) + "." for _ in range(count)]


def _chats(count: int, seed: int) -> list[list[dict]]:
    questions, answers = _sentences(count, seed), _sentences(count, seed + 1)
    return [
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        for question, answer in zip(questions, answers)
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return build_tiny_target("llama", num_layers=NUM_LAYERS, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def held_out(tokenizer) -> list[list[int]]:
    return tokenize_for_draft(Dataset.from_dict({"text": _sentences(12, seed=99)}), tokenizer, max_length=64)


@pytest.fixture(scope="module")
def trained(target, tokenizer, tmp_path_factory):
    """One 30-step training run on text with a held-out split, saved to a folder: shared by several tests."""
    config = DraftTrainingConfig(
        output_dir=str(tmp_path_factory.mktemp("draft")),
        max_steps=30,
        learning_rate=3e-3,
        eval_fraction=0.25,
        eval_steps=15,
        **FAST,
    )
    return config, train_draft(target, tokenizer, Dataset.from_dict({"text": _sentences(48, seed=0)}), config)


def _evaluate(target, draft, sequences, tokenizer):
    return evaluate_draft(
        target,
        draft,
        sequences,
        batch_size=4,
        pad_id=tokenizer.pad_token_id,
        options=Eagle3TrainingOptions(ttt_steps=3),
    )


def test_training_lowers_held_out_loss_and_raises_agreement(target, tokenizer, held_out, trained):
    config, result = trained
    torch.manual_seed(config.seed)
    untrained = Eagle3DraftModel.from_target(target)
    before = _evaluate(target, untrained, held_out, tokenizer)
    after = _evaluate(target, result.draft, held_out, tokenizer)
    assert result.steps == 30
    for step in range(3):
        assert after[f"loss_step_{step}"] < before[f"loss_step_{step}"] - 1.0, (before, after)
    assert after["accuracy_step_0"] > before["accuracy_step_0"] + 0.1, (before, after)
    # The run's own held-out split: evaluated at step 15 and at the end, and the loss went down between them.
    assert [entry["step"] for entry in result.history] == [15, 30]
    assert result.history[-1]["loss_step_0"] < result.history[0]["loss_step_0"]
    assert set(result.history[-1]) == {"step"} | {
        f"{kind}_step_{d}" for kind in ("loss", "accuracy") for d in range(3)
    }


def test_bf16_autocast_trains_like_float32(target, tokenizer, held_out, trained):
    """`bf16=True` (autocast) keeps float32 weights and lands close to the same run in float32."""
    config, float32_result = trained
    bf16_config = DraftTrainingConfig(**{**vars(config), "output_dir": None, "bf16": True})
    bf16_result = train_draft(target, tokenizer, Dataset.from_dict({"text": _sentences(48, seed=0)}), bf16_config)
    assert {parameter.dtype for parameter in bf16_result.draft.parameters()} == {torch.float32}
    torch.manual_seed(config.seed)
    before = _evaluate(target, Eagle3DraftModel.from_target(target), held_out, tokenizer)
    after = _evaluate(target, bf16_result.draft, held_out, tokenizer)
    reference = _evaluate(target, float32_result.draft, held_out, tokenizer)
    for step in range(3):
        assert after[f"loss_step_{step}"] < before[f"loss_step_{step}"] - 1.0, (before, after)
        assert abs(after[f"loss_step_{step}"] - reference[f"loss_step_{step}"]) < 0.05, (reference, after)


def test_checkpoint_is_saved_and_loads_back(target, tokenizer, held_out, trained):
    config, result = trained
    folder = Path(config.output_dir)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"]
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, NUM_LAYERS // 2, NUM_LAYERS - 3]
    # Full vocabulary: vLLM 0.31 refuses a `d2t` then, so none is written.
    assert "d2t" not in load_file(folder / "model.safetensors")

    loaded = Eagle3DraftModel.from_pretrained(folder, target=target)
    trained_state = result.draft.state_dict()
    assert loaded.state_dict().keys() == trained_state.keys()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, trained_state[name], rtol=0, atol=0, msg=name)
    assert _evaluate(target, loaded, held_out, tokenizer) == _evaluate(target, result.draft, held_out, tokenizer)


def test_chat_dataset_goes_through_the_chat_template(target, tokenizer):
    chats = _chats(8, seed=3)
    dataset = Dataset.from_dict({"messages": chats, "text": ["ignored"] * len(chats)})
    sequences = tokenize_for_draft(dataset, tokenizer, max_length=1000)
    expected = [tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False) for chat in chats]
    assert sequences == expected
    assert all(ids[0] == tokenizer.bos_token_id for ids in sequences)

    config = DraftTrainingConfig(max_steps=2, eval_fraction=0.25, **FAST)
    result = train_draft(target, tokenizer, dataset, config, progress=False)
    assert result.steps == 2
    assert len(result.history) == 1
    assert all(torch.isfinite(torch.tensor(value)) for value in result.history[0].values())


def test_tokenize_cuts_long_texts_and_drops_single_tokens(tokenizer):
    texts = ["x" * 25, "y", "hello world"]
    sequences = tokenize_for_draft(Dataset.from_dict({"text": texts}), tokenizer, max_length=10)
    first, _, last = (tokenizer(text)["input_ids"] for text in texts)
    assert sequences == [first[:10], first[10:20], first[20:], last[:10]]  # "y" and the 1-token tail "d" dropped
    assert [len(ids) for ids in sequences] == [10, 10, 5, 10]


def test_draft_vocabulary_follows_token_counts(target, tokenizer):
    # Characters with distinct frequencies, so that the 6 most frequent tokens are unambiguous.
    texts = ["".join(char * count for char, count in zip("etaoinshrd", range(20, 10, -1))) + "xyz"] * 3
    dataset = Dataset.from_dict({"text": texts})
    config = DraftTrainingConfig(draft_vocab_size=6, max_steps=1, eval_fraction=0.0, **{**FAST, "max_length": 512})
    draft = train_draft(target, tokenizer, dataset, config, progress=False).draft

    counts = count_tokens(tokenize_for_draft(dataset, tokenizer, max_length=512), target.config.vocab_size)
    expected = select_draft_vocab(target.config.vocab_size, 6, counts)
    assert sorted(expected.tolist()) == sorted(tokenizer.convert_tokens_to_ids(list("etaoin")))
    assert draft.config.draft_vocab_size == 6
    assert torch.equal(draft.draft_to_target_ids, expected)
    assert torch.equal(draft.t2d.nonzero().flatten(), expected)


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_layers", 0),
        ("ttt_steps", 0),
        ("batch_size", 0),
        ("eval_steps", 0),
        ("max_length", 1),
        ("eval_fraction", 1.0),
        ("eval_fraction", -0.1),
        ("learning_rate", 0.0),
        ("max_steps", 0),
        ("max_steps", -2),
        ("num_epochs", 0.0),
        ("max_time_s", 0.0),
        ("step_weight_decay", 0.0),
        ("warmup_steps", -1),
        ("max_eval_samples", -1),
        ("weight_decay", -0.1),
        ("max_grad_norm", -1.0),
        ("draft_vocab_size", 0),
        ("lr_scheduler_type", "cosine_typo"),
    ],
)
def test_bad_config_values_raise_clear_errors(field, value):
    with pytest.raises(ValueError, match=rf"`{field}`={value!r}|`{field}`={value}"):
        DraftTrainingConfig(**{field: value})


def test_every_float_option_has_a_range_and_refuses_nan_and_infinities():
    """As `SpecCoTrainConfig`'s (tests/test_config.py): a NaN `max_grad_norm` turned clipping off, an infinite
    `step_weight_decay` skipped every update. A float option added without a range fails here."""
    names = [option.name for option in dataclasses.fields(DraftTrainingConfig) if is_float_field(option)]
    assert "learning_rate" in names and set(names) == set(TRAINING_FLOAT_RANGES)
    for name in names:
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=rf"`{name}`={value!r} is not allowed: {name} must be .*, got"):
                DraftTrainingConfig(**{name: value})


def test_bad_inputs_raise_clear_errors(target, tokenizer):
    with pytest.raises(ValueError, match=r"columns \['prompt'\].*'text'.*'messages'"):
        train_draft(target, tokenizer, Dataset.from_dict({"prompt": ["a b c"]}), progress=False)
    with pytest.raises(ValueError, match="no sequence of 2 or more tokens"):
        train_draft(target, tokenizer, Dataset.from_dict({"text": ["a", ""]}), progress=False)
    with pytest.raises(ValueError, match=r"draft_vocab_size`=1000 is not allowed"):
        config = DraftTrainingConfig(draft_vocab_size=1000, max_steps=1, **FAST)
        train_draft(target, tokenizer, Dataset.from_dict({"text": _sentences(4, seed=5)}), config, progress=False)
    with pytest.raises(ValueError, match="Tap id 8"):
        config = DraftTrainingConfig(aux_layer_ids=[1, 8], max_steps=1, **FAST)
        train_draft(target, tokenizer, Dataset.from_dict({"text": _sentences(4, seed=5)}), config, progress=False)


def test_max_time_stops_training_early(target, tokenizer):
    config = DraftTrainingConfig(max_steps=50, max_time_s=1e-6, eval_fraction=0.25, eval_steps=1, **FAST)
    result = train_draft(
        target, tokenizer, Dataset.from_dict({"text": _sentences(16, seed=7)}), config, progress=False
    )
    assert result.steps == 1
    assert [entry["step"] for entry in result.history] == [1]  # evaluated once, not again for the same step


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-llama-8"), "llama", num_layers=NUM_LAYERS)


def test_cli_train_draft_on_json_and_saved_datasets(target_dir, tmp_path, capsys):
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("".join(json.dumps({"text": text}) + "\n" for text in _sentences(12, seed=11)))
    out = tmp_path / "draft-json"
    common = ["--max_steps", "2", "--batch_size", "4", "--max_length", "48", "--eval_fraction", "0.25"]
    cli.main(
        ["train-draft", "--model_name_or_path", str(target_dir), "--dataset_name", "json"]
        + ["--data_files", str(data_file), "--output_dir", str(out), "--draft_vocab_size", "40", *common]
    )
    printed = capsys.readouterr().out
    assert "train-draft: 2 steps" in printed and "accuracy_step_0=" in printed
    draft = Eagle3DraftModel.from_pretrained(out)
    assert draft.config.draft_vocab_size == 40
    assert "d2t" in load_file(out / "model.safetensors")

    # A chat dataset saved with `save_to_disk`, options from a YAML file.
    saved = tmp_path / "chats"
    Dataset.from_dict({"messages": _chats(8, seed=13)}).save_to_disk(str(saved))
    out_chat = tmp_path / "draft-chat"
    yaml_file = tmp_path / "train_draft.yaml"
    yaml_file.write_text(f"model_name_or_path: {target_dir}\ndataset_name: {saved}\noutput_dir: {out_chat}\n")
    cli.main(["train-draft", "--config", str(yaml_file), *common])
    assert "train-draft: 2 steps" in capsys.readouterr().out
    assert Eagle3DraftModel.from_pretrained(out_chat).config.draft_vocab_size == len(build_char_tokenizer())


def test_cli_train_draft_warm_starts_a_dflash_draft(target_dir, tmp_path, capsys):
    """`--drafter dflash`: the same command trains a DFlash block draft with its own options and saves it as vLLM
    loads it, with its card; the character tokenizer leaves no unused row for the mask token, so one is asked for."""
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("".join(json.dumps({"text": text}) + "\n" for text in _sentences(12, seed=12)))
    base = ["train-draft", "--model_name_or_path", str(target_dir), "--dataset_name", "json", "--drafter", "dflash"]
    base += ["--data_files", str(data_file), "--max_steps", "2", "--batch_size", "4", "--max_length", "48"]
    with pytest.raises(ValueError, match="`dflash_mask_token_id`"):
        cli.main([*base, "--output_dir", str(tmp_path / "refused")])
    out = tmp_path / "dflash"
    mask = build_char_tokenizer().unk_token_id
    cli.main([*base, "--output_dir", str(out), "--dflash_block_size", "5", "--dflash_mask_token_id", str(mask)])
    assert "train-draft: 2 steps" in capsys.readouterr().out
    draft = DFlashDraftModel.from_pretrained(out)
    assert draft.config.block_size == 5 and draft.config.dflash_config["mask_token_id"] == mask
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert "DFlash" in (out / "README.md").read_text()


def test_cli_train_draft_rejects_bad_options(target_dir, tmp_path):
    data_file = tmp_path / "train.jsonl"
    data_file.write_text(json.dumps({"text": "a b c d"}) + "\n")
    base = ["train-draft", "--model_name_or_path", str(target_dir), "--dataset_name", "json"]
    base += ["--data_files", str(data_file)]
    with pytest.raises(ValueError, match="--output_dir"):
        cli.main(base)
    with pytest.raises(ValueError, match="--dtype float8.*bfloat16"):
        cli.main([*base, "--output_dir", str(tmp_path / "out"), "--dtype", "float8"])
    with pytest.raises(ValueError, match="`ttt_steps`=0"):
        cli.main([*base, "--output_dir", str(tmp_path / "out"), "--ttt_steps", "0"])
    with pytest.raises(SystemExit, match="unknown command 'train-drafts'"):
        cli.main(["train-drafts"])


def test_console_script_help():
    script = shutil.which("hf-spec-cotrain", path=str(Path(sys.executable).parent))
    assert script is not None, "the `hf-spec-cotrain` console script is not installed next to this Python"
    completed = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr
    assert "usage: hf-spec-cotrain [--version] <command>" in completed.stdout
    assert "train-draft" in completed.stdout
