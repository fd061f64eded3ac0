"""Offline warm start: train a draft for a frozen target on a text or chat dataset before RL begins.

The target's hidden states are computed on the fly by hooks on its own forward (no feature files), so a
warm start needs nothing but the target, its tokenizer and a `datasets.Dataset`. The draft (any family:
``drafter``) trains with the co-trainer's own micro-step and optimizer (`DraftCoTrainer.draft_micro_step`,
`build_draft_optimizer`).
"""

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, SchedulerType

from .draft import (
    DEFAULT_DRAFTER,
    DRAFTER_FAMILIES,
    DraftLossOutput,
    DraftModel,
    check_draft_family,
    count_tokens,
    drafter_family,
)
from .draft.card import WarmStartRecord, model_license, render_draft_card
from .draft.dflash_configuration import DEFAULT_BLOCK_SIZE
from .draft.dflash_objective import DEFAULT_ANCHORS_PER_ROW, DEFAULT_LOSS_DECAY_GAMMA
from .draft.eagle3_ttt import DEFAULT_STEP_WEIGHT_DECAY
from .policy_head import PolicyHead
from .taps import TapRecorder
from .training.draft_cotraining import (
    DraftCoTrainer,
    DraftStepSettings,
    RecordedTaps,
    build_draft_optimizer,
    seeded_generator,
)
from .validation import FloatRange, check_float_fields, check_int


# The range of every float option of `DraftTrainingConfig`, checked when it is built (`check_float_fields`).
TRAINING_FLOAT_RANGES = {
    "step_weight_decay": FloatRange(0, low_open=True, hint=" (TTT step d's loss weighs step_weight_decay**d)"),
    "dflash_loss_decay_gamma": FloatRange(0, low_open=True, hint=" (block position i weighs exp(-(i - 1) / gamma))"),
    "learning_rate": FloatRange(0, low_open=True),
    "weight_decay": FloatRange(0),
    "max_grad_norm": FloatRange(0, hint=" (0 turns gradient clipping off)"),
    "num_epochs": FloatRange(0, low_open=True),
    "max_time_s": FloatRange(0, low_open=True, hint=", or None for no limit"),
    "eval_fraction": FloatRange(0, 1, high_open=True, hint=" (the fraction of the dataset held out)"),
}


@dataclass
class DraftTrainingConfig:
    r"""
    Configuration of [`train_draft`], the offline warm start of a draft.

    Parameters that control the draft:
        drafter, num_layers, aux_layer_ids, draft_vocab_size
    Parameters that control the objective:
        ttt_steps, step_weight_decay, max_length
    Parameters that control optimisation:
        learning_rate, weight_decay, max_grad_norm, warmup_steps, lr_scheduler_type, batch_size, max_steps,
        num_epochs, max_time_s, bf16, seed
    Parameters that control evaluation and output:
        eval_fraction, max_eval_samples, eval_steps, logging_steps, output_dir, hub_model_id
    """

    output_dir: str | None = field(
        default=None, metadata={"help": "Folder the draft checkpoint is saved to, with its model card (README.md)."}
    )
    hub_model_id: str | None = field(
        default=None,
        metadata={
            "help": "Hub repository the draft will be pushed to: its model card names it (default: the folder)."
        },
    )
    drafter: str = field(
        default=DEFAULT_DRAFTER, metadata={"help": "The drafter family.", "choices": list(DRAFTER_FAMILIES)}
    )
    num_layers: int = field(default=1, metadata={"help": "Decoder layers of a new draft."})
    aux_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Tapped target layers (inputs of these layers). Default: (2, L//2, L-3)."}
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "Draft vocabulary size: the most frequent tokens of the training data. Default: all."},
    )
    ttt_steps: int = field(default=3, metadata={"help": "Unrolled training-time-test steps K."})
    step_weight_decay: float = field(
        default=DEFAULT_STEP_WEIGHT_DECAY, metadata={"help": "Loss weight of step d is step_weight_decay**d."}
    )
    dflash_block_size: int = field(
        default=DEFAULT_BLOCK_SIZE, metadata={"help": "DFlash: the trained block (anchor + mask tokens)."}
    )
    dflash_anchors_per_row: int = field(
        default=DEFAULT_ANCHORS_PER_ROW, metadata={"help": "DFlash: blocks trained per sequence and step."}
    )
    dflash_loss_decay_gamma: float = field(
        default=DEFAULT_LOSS_DECAY_GAMMA, metadata={"help": "DFlash: block position i weighs exp(-(i-1)/gamma)."}
    )
    dflash_target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "DFlash: target layers whose outputs form the context; unset: spread."}
    )
    dflash_mask_token_id: int | None = field(
        default=None, metadata={"help": "DFlash: the token filling the block; unset: from the tokenizer."}
    )
    max_length: int = field(default=512, metadata={"help": "Tokens per training sequence (longer texts are cut)."})
    learning_rate: float = field(default=5e-4, metadata={"help": "Peak AdamW learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 disables)."})
    warmup_steps: int = field(default=20, metadata={"help": "Linear warm-up steps."})
    lr_scheduler_type: str = field(
        default="constant_with_warmup", metadata={"help": "A transformers scheduler name, e.g. 'cosine'."}
    )
    batch_size: int = field(default=8, metadata={"help": "Sequences per optimisation step."})
    max_steps: int = field(default=-1, metadata={"help": "Stop after this many steps (-1: use num_epochs)."})
    num_epochs: float = field(default=1.0, metadata={"help": "Passes over the training split when max_steps=-1."})
    max_time_s: float | None = field(default=None, metadata={"help": "Stop after this many seconds of training."})
    eval_fraction: float = field(default=0.05, metadata={"help": "Fraction of the dataset held out."})
    max_eval_samples: int = field(default=64, metadata={"help": "At most this many held-out sequences."})
    eval_steps: int = field(default=100, metadata={"help": "Evaluate every this many steps (and at the end)."})
    logging_steps: int = field(default=10, metadata={"help": "Refresh the progress bar's metrics this often."})
    bf16: bool = field(
        default=False,
        metadata={
            "help": "Train under bfloat16 autocast (the target's forward and the draft's; float32 weights, optimizer "
            "state, teacher and loss). About 1.7x the steps per second on a CPU with AVX512-BF16."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the split, the shuffling and the draft's init."})

    def __post_init__(self):
        check_float_fields(self, TRAINING_FLOAT_RANGES)
        drafter_family(self.drafter)
        for name in ("num_layers", "ttt_steps", "batch_size", "eval_steps", "logging_steps"):
            check_int(getattr(self, name), name)
        if self.max_length < 2:
            raise ValueError(f"`max_length`={self.max_length} is not allowed: a training sequence needs >= 2 tokens.")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"`max_steps`={self.max_steps} is not allowed: use an int >= 1, or -1 to use num_epochs.")
        for name in ("warmup_steps", "max_eval_samples"):
            check_int(getattr(self, name), name, minimum=0)
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(
                f"`draft_vocab_size`={self.draft_vocab_size} is not allowed: use an int >= 1 (at most the target's "
                "vocabulary size), or None for the full vocabulary."
            )
        schedulers = [scheduler.value for scheduler in SchedulerType]
        if self.lr_scheduler_type not in schedulers:
            raise ValueError(
                f"`lr_scheduler_type`={self.lr_scheduler_type!r} is not allowed: choose one of {', '.join(schedulers)}."
            )


@dataclass
class DraftTrainingResult:
    draft: DraftModel
    history: list[dict] = field(default_factory=list)  # one dict per evaluation
    steps: int = 0
    train_seconds: float = 0.0


def tokenize_for_draft(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    text_column: str = "text",
    messages_column: str = "messages",
) -> list[list[int]]:
    """Token ids of every example, cut into sequences of at most ``max_length`` (shorter than 2 dropped).

    A ``messages`` column goes through the tokenizer's chat template; otherwise ``text_column`` is used.
    """
    columns = dataset.column_names
    if messages_column in columns:
        encode = lambda example: tokenizer.apply_chat_template(  # noqa: E731
            example[messages_column], tokenize=True, return_dict=False
        )
    elif text_column in columns:
        encode = lambda example: tokenizer(example[text_column], add_special_tokens=True)["input_ids"]  # noqa: E731
    else:
        raise ValueError(
            f"The dataset has columns {columns}; expected a text column {text_column!r} or a chat column "
            f"{messages_column!r} (set `text_column` / `messages_column`)."
        )
    sequences = []
    for example in dataset:
        ids = list(encode(example))
        sequences.extend(ids[start : start + max_length] for start in range(0, len(ids), max_length))
    return [ids for ids in sequences if len(ids) >= 2]


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and the boolean ``attention_mask`` of token-id rows."""
    length = max(map(len, rows))
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = True
    return input_ids, attention_mask


def _batches(sequences: list[list[int]], batch_size: int, pad_id: int, generator: torch.Generator | None):
    order = torch.randperm(len(sequences), generator=generator) if generator is not None else range(len(sequences))
    for start in range(0, len(sequences), batch_size):
        yield pad_rows([sequences[int(i)] for i in order[start : start + batch_size]], pad_id)


def draft_tap_recorder(target: PreTrainedModel, draft: DraftModel) -> TapRecorder:
    """The recorder `draft_loss_on_batch` reads: the draft's taps, the embeddings and the final hidden state."""
    aux_ids = draft.validate_target(target.config)
    return TapRecorder(target, aux_ids, record_embeddings=True, record_final_hidden=True)


def draft_inputs_of_batch(
    target: PreTrainedModel,
    draft: DraftModel,
    recorder: TapRecorder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    bf16: bool = False,
) -> tuple[RecordedTaps, torch.Tensor]:
    """Run the frozen target once (taps and teacher by hooks): the draft's inputs on the batch, every real token
    counted, and the teacher's logits (in float32).

    ``bf16``: the target's forward under bf16 autocast.
    """
    device = target.get_input_embeddings().weight.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), torch.no_grad(), recorder.capture():
        recorder.decoder(input_ids=input_ids, attention_mask=attention_mask)  # no lm_head: the teacher needs Vd
    taps = recorder.pop()
    teacher_logits = PolicyHead(target).teacher_logits(
        taps.final_hidden, draft.draft_to_target_ids, dtype=torch.float32
    )
    return RecordedTaps(taps, attention_mask, loss_mask=attention_mask), teacher_logits


def draft_loss_on_batch(
    target: PreTrainedModel,
    draft: DraftModel,
    recorder: TapRecorder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    options: Any,
    bf16: bool = False,
    generator: torch.Generator | None = None,
) -> DraftLossOutput:
    """The draft's training loss (its family's objective under ``options``, `DraftModel.training_options`) on the
    batch (`draft_inputs_of_batch`), without a backward.

    ``bf16``: the target's forward and the draft's objective under bf16 autocast; the teacher is computed in float32.
    ``generator``: the objective's random stream.
    """
    recorded, teacher_logits = draft_inputs_of_batch(target, draft, recorder, input_ids, attention_mask, bf16=bf16)
    settings = DraftStepSettings(options=options, bf16=bf16)
    return DraftCoTrainer.draft_forward(
        draft, recorded, teacher_logits=teacher_logits, settings=settings, generator=generator
    )


def evaluate_draft(
    target: PreTrainedModel,
    draft: DraftModel,
    sequences: list[list[int]],
    *,
    batch_size: int,
    pad_id: int,
    options: Any,
    seed: int = 0,
) -> dict[str, float]:
    """Held-out loss and top-1 agreement with the target per drafted position (count-weighted over all batches),
    under the objective ``options``; its random draws (if the family makes any) come from ``seed``, the same at
    every evaluation."""
    num_positions = draft.loss_positions(options)
    sums = torch.zeros(3, num_positions, dtype=torch.float64)  # loss*count, accuracy*count, count
    was_training = draft.training
    draft.eval()
    generator = seeded_generator(seed, device=target.get_input_embeddings().weight.device)
    with draft_tap_recorder(target, draft) as recorder:
        for input_ids, attention_mask in _batches(sequences, batch_size, pad_id, generator=None):
            with torch.no_grad():
                out = draft_loss_on_batch(
                    target, draft, recorder, input_ids, attention_mask, options=options, generator=generator
                )
            counts = out.step_counts.double().cpu()
            sums += torch.stack(
                [out.step_losses.double().cpu() * counts, out.step_accuracies.double().cpu() * counts, counts]
            )
    draft.train(was_training)
    counts = sums[2].clamp(min=1)
    metrics = {}
    for step in range(num_positions):
        metrics[f"loss_step_{step}"] = float(sums[0, step] / counts[step])
        metrics[f"accuracy_step_{step}"] = float(sums[1, step] / counts[step])
    return metrics


def train_draft(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: Dataset,
    config: DraftTrainingConfig | None = None,
    *,
    draft: DraftModel | None = None,
    text_column: str = "text",
    messages_column: str = "messages",
    progress: bool = True,
    dataset_name: str | None = None,
) -> DraftTrainingResult:
    """Warm-start ``draft`` (or a new one built from ``target``) on ``dataset``; save it to ``output_dir`` with its
    model card (``dataset_name``: the Hub id or folder the dataset came from, for the card).

    The target is frozen and only runs forward, once per batch; its taps, embeddings and final hidden state
    come from hooks on that forward.
    """
    config = config or DraftTrainingConfig()
    torch.manual_seed(config.seed)
    target.eval()
    target.requires_grad_(False)
    sequences = tokenize_for_draft(
        dataset, tokenizer, max_length=config.max_length, text_column=text_column, messages_column=messages_column
    )
    if not sequences:
        raise ValueError("The dataset gave no sequence of 2 or more tokens to train on.")
    split_gen = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(sequences), generator=split_gen).tolist()
    num_eval = min(config.max_eval_samples, int(len(sequences) * config.eval_fraction))
    eval_set = [sequences[i] for i in order[:num_eval]]
    train_set = [sequences[i] for i in order[num_eval:]]

    family = drafter_family(config.drafter)
    if draft is None:
        counts = count_tokens(train_set, target.config.get_text_config().vocab_size)
        draft = family.from_target(
            target,
            **family.from_target_options(config, tokenizer),
            draft_vocab_size=config.draft_vocab_size,
            token_counts=counts,
        )
    check_draft_family(draft, config.drafter)
    draft.bind_target(target)
    draft.train()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    steps_per_epoch = math.ceil(len(train_set) / config.batch_size)
    total_steps = config.max_steps if config.max_steps > 0 else max(1, math.ceil(config.num_epochs * steps_per_epoch))
    optimizer, scheduler = build_draft_optimizer(
        draft,
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        lr_scheduler_type=config.lr_scheduler_type,
        warmup_steps=config.warmup_steps,
        total_steps=total_steps,
    )
    settings = DraftStepSettings(options=draft.training_options(config), bf16=config.bf16)
    generator = seeded_generator(config.seed, device=target.get_input_embeddings().weight.device)
    result = DraftTrainingResult(draft=draft)
    eval_kwargs = dict(batch_size=config.batch_size, pad_id=pad_id, options=settings.options, seed=config.seed)

    def evaluate(step):
        if eval_set:
            metrics = {"step": step, **evaluate_draft(target, draft, eval_set, **eval_kwargs)}
            result.history.append(metrics)
            return metrics
        return {}

    started = time.perf_counter()
    # `disable=None`: no bar where the output is not a terminal (a log file would fill with cursor movements).
    bar = tqdm(total=total_steps, desc="train-draft", disable=None if progress else True, dynamic_ncols=True)
    step = 0
    with draft_tap_recorder(target, draft) as recorder:
        for input_ids, attention_mask in _epochs(train_set, config, pad_id):
            recorded, teacher_logits = draft_inputs_of_batch(
                target, draft, recorder, input_ids, attention_mask, bf16=config.bf16
            )
            out, _ = DraftCoTrainer.draft_micro_step(
                draft, recorded, teacher_logits=teacher_logits, settings=settings, generator=generator
            )
            if config.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(draft.trainable_parameters(), config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update()
            if step % config.logging_steps == 0:
                bar.set_postfix(loss=f"{out.loss.item():.3f}", acc0=f"{out.step_accuracies[0].item():.3f}")
            if step % config.eval_steps == 0 and step < total_steps:
                metrics = evaluate(step)
                if metrics:
                    bar.write(
                        f"step {step}: held-out "
                        + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.startswith("accuracy"))
                    )
            out_of_time = config.max_time_s is not None and time.perf_counter() - started > config.max_time_s
            if step >= total_steps or out_of_time:
                break
    bar.close()
    result.steps = step
    result.train_seconds = time.perf_counter() - started
    if not result.history or result.history[-1]["step"] != step:  # the time limit may stop right after an evaluation
        evaluate(step)
    if config.output_dir:
        folder = Path(config.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        draft.save_pretrained(folder)
        (folder / "README.md").write_text(_draft_card(target, config, result, dataset_name), encoding="utf-8")
    return result


def _draft_card(
    target: PreTrainedModel, config: DraftTrainingConfig, result: DraftTrainingResult, dataset_name: str | None
) -> str:
    """The warm-started draft's model card: its target, training settings and held-out agreement per drafted
    position."""
    target_name = target.config._name_or_path  # "" for a target built in memory
    final = result.history[-1] if result.history else {}
    options = result.draft.training_options(config)
    return render_draft_card(
        result.draft,
        target_model=target_name,
        repo_id=config.hub_model_id or Path(config.output_dir).resolve().name,
        training=WarmStartRecord(
            held_out_accuracy=[final[f"accuracy_step_{d}"] for d in range(result.draft.loss_positions(options))]
            if final
            else [],
            dataset=dataset_name,
        ),
        hyperparameters={
            "Training steps": result.steps,
            "Learning rate (warm-up steps, schedule)": (
                f"{config.learning_rate:g} ({config.warmup_steps}, {config.lr_scheduler_type})"
            ),
            "Batch size x max length": f"{config.batch_size} x {config.max_length} tokens",
            **result.draft.describe_options(options),
        },
        license_fields=model_license(target_name),
        num_target_layers=target.config.get_text_config().num_hidden_layers,
    )


def _epochs(train_set: list[list[int]], config: DraftTrainingConfig, pad_id: int) -> Iterator:
    generator = torch.Generator().manual_seed(config.seed + 1)
    while True:
        yield from _batches(train_set, config.batch_size, pad_id, generator)
