"""The ``hf-spec-cotrain`` console command: ``hf-spec-cotrain <command> [--options] [--config file.yaml]``.

Each command is a ``make_parser`` over dataclasses (so every option has help text and can come from a YAML
file) plus a ``main`` that imports the heavy libraries lazily.
"""

import sys
from dataclasses import dataclass, field


@dataclass
class TrainDraftScriptArguments:
    r"""Where the target and the data come from, for ``hf-spec-cotrain train-draft``."""

    model_name_or_path: str = field(metadata={"help": "Target model: a Hub id or a local folder."})
    dataset_name: str = field(
        metadata={"help": "A Hub dataset id, a local folder saved with `save_to_disk`, or a builder ('json', 'text')."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train (and hold out) from."})
    data_files: list[str] | None = field(default=None, metadata={"help": "Files for a builder dataset_name."})
    text_column: str = field(default="text", metadata={"help": "Column with plain text."})
    messages_column: str = field(default="messages", metadata={"help": "Column with chat messages (preferred)."})
    dtype: str = field(default="float32", metadata={"help": "Target dtype: float32, bfloat16 or float16."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the Hub."})


def _load_dataset(args: TrainDraftScriptArguments):
    from pathlib import Path

    from datasets import load_dataset, load_from_disk

    path = Path(args.dataset_name)
    if path.is_dir() and any((path / name).exists() for name in ("dataset_info.json", "dataset_dict.json")):
        dataset = load_from_disk(str(path))
        return dataset[args.dataset_split] if hasattr(dataset, "keys") else dataset
    return load_dataset(args.dataset_name, args.dataset_config, data_files=args.data_files, split=args.dataset_split)


def train_draft_parser():
    from trl import TrlParser

    from .warmstart import DraftTrainingConfig

    description = "Warm-start an EAGLE-3 draft for a target on a dataset (taps computed on the fly)."
    return TrlParser(
        (TrainDraftScriptArguments, DraftTrainingConfig), prog="hf-spec-cotrain train-draft", description=description
    )


def train_draft_main(argv: list[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .warmstart import train_draft

    args, config = train_draft_parser().parse_args_and_config(argv)
    if not config.output_dir:
        raise ValueError("`--output_dir` is required: the trained draft is saved there.")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if args.dtype not in dtypes:
        raise ValueError(f"`--dtype {args.dtype}` is not allowed: choose one of {sorted(dtypes)}.")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    target = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, dtype=dtypes[args.dtype], trust_remote_code=args.trust_remote_code
    )
    result = train_draft(
        target,
        tokenizer,
        _load_dataset(args),
        config,
        text_column=args.text_column,
        messages_column=args.messages_column,
    )
    final = result.history[-1] if result.history else {}
    accuracies = ", ".join(f"{k}={v:.3f}" for k, v in final.items() if k.startswith("accuracy"))
    print(f"train-draft: {result.steps} steps in {result.train_seconds:.0f}s; held-out {accuracies or 'n/a'}")
    print(f"train-draft: draft saved to {config.output_dir}")


COMMANDS = {
    "train-draft": (train_draft_main, "Warm-start an EAGLE-3 draft for a target on a dataset."),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in COMMANDS:
        lines = [f"  {name:<14}{help_text}" for name, (_, help_text) in COMMANDS.items()]
        usage = "usage: hf-spec-cotrain <command> [--options] [--config file.yaml]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] not in {"-h", "--help"}:
            sys.exit(f"hf-spec-cotrain: unknown command {argv[0]!r}\n\n{usage}")
        print(usage)
        return
    command, _ = COMMANDS[argv[0]]
    command(argv[1:])


if __name__ == "__main__":
    main()
