"""The ``hf-spec-cotrain`` console command: ``hf-spec-cotrain <command> [--options] [--config file.yaml]``.

Each command is a ``make_parser`` over dataclasses (so every option has help text and can come from a YAML
file) plus a ``main`` that imports the heavy libraries lazily.
"""

import os
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

    description = "Warm-start a draft of the `--drafter` family for a target on a dataset (taps computed on the fly)."
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
        dataset_name=args.dataset_name,
    )
    final = result.history[-1] if result.history else {}
    accuracies = ", ".join(f"{k}={v:.3f}" for k, v in final.items() if k.startswith("accuracy"))
    print(f"train-draft: {result.steps} steps in {result.train_seconds:.0f}s; held-out {accuracies or 'n/a'}")
    print(f"train-draft: draft saved to {config.output_dir}, with its model card (README.md)")


@dataclass
class ExportDraftScriptArguments:
    r"""A saved draft and the format to write it in, for ``hf-spec-cotrain export-draft``. Named options rather than
    positionals, like the other commands, so that they can come from a YAML file too."""

    source: str = field(metadata={"help": "The draft to convert: a folder or Hub id, in either format."})
    destination: str = field(metadata={"help": "Folder to write the converted draft to."})
    format: str = field(
        default="eagle3",
        metadata={
            "help": "'eagle3' (vLLM's EAGLE-3 layout, what the package writes) or 'speculators' (the "
            "vllm-project/speculators format, which vLLM also reads)."
        },
    )
    verifier: str | None = field(
        default=None,
        metadata={
            "help": "speculators only: the target (Hub id or folder) the draft serves; then `vllm serve DESTINATION` "
            "alone serves that target with the draft."
        },
    )
    num_speculative_tokens: int = field(
        default=3, metadata={"help": "speculators only: the K that `vllm serve DESTINATION` drafts."}
    )


def export_draft_parser():
    from trl import TrlParser

    description = "Convert a saved EAGLE-3 draft between vLLM's EAGLE-3 layout and the speculators format."
    return TrlParser((ExportDraftScriptArguments,), prog="hf-spec-cotrain export-draft", description=description)


def export_draft_main(argv: list[str]) -> None:
    from .draft import Eagle3DraftModel

    (args,) = export_draft_parser().parse_args_and_config(argv)
    draft = Eagle3DraftModel.from_pretrained(args.source)
    draft.save_pretrained(
        args.destination,
        format=args.format,
        verifier=args.verifier,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    print(f"export-draft: {args.source} written to {args.destination} in the {args.format} format")


@dataclass
class VLLMServeScriptArguments:
    r"""The policy, its EAGLE-3 draft and the listening address, for ``hf-spec-cotrain vllm-serve``."""

    model: str = field(metadata={"help": "Policy: a local folder or a Hub id that vLLM can load."})
    draft: str | None = field(
        default=None, metadata={"help": "Folder of the EAGLE-3 draft checkpoint; without it, no speculation."}
    )
    num_speculative_tokens: int = field(default=3, metadata={"help": "Tokens the draft proposes per step."})
    draft_sample_method: str | None = field(
        default=None,
        metadata={"help": "vLLM's draft_sample_method: 'greedy' (the draft's argmax) or 'probabilistic'."},
    )
    rejection_sample_method: str | None = field(
        default=None, metadata={"help": "vLLM's rejection_sample_method, e.g. 'standard'."}
    )
    host: str = field(
        default="127.0.0.1",
        metadata={
            "help": "Address to listen on; beyond loopback an API key (or --allow_unauthenticated) is required."
        },
    )
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    dtype: str | None = field(
        default=None, metadata={"help": "vLLM dtype (default: float32 on CPU, vLLM's 'auto' on GPU)."}
    )
    seed: int = field(default=0, metadata={"help": "Engine seed."})
    max_model_len: int | None = field(default=None, metadata={"help": "vLLM max_model_len (prompt + completion)."})
    gpu_memory_utilization: float | None = field(
        default=None, metadata={"help": "Fraction of GPU memory vLLM may use (GPU only)."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the Hub."})
    llm_kwargs: str | None = field(
        default=None,
        metadata={"help": "JSON object of further vllm.LLM arguments, e.g. '{\"block_size\": 32}'."},
    )
    verify_syncs: bool = field(
        default=True,
        metadata={"help": "Read every weight back after an update and roll back on any difference."},
    )
    transaction_timeout: float = field(
        default=600.0, metadata={"help": "Seconds without activity after which an open weight update is discarded."}
    )
    max_chunk_bytes: int = field(default=2**31, metadata={"help": "Largest weight-update chunk accepted (bytes)."})
    max_open_transactions: int = field(
        default=4, metadata={"help": "Weight updates open at once; more are refused (429)."}
    )
    max_staged_bytes: int | None = field(
        default=None,
        metadata={"help": "Bytes all open weight updates may stage (413/429 beyond); default: half of host memory."},
    )
    max_chunks: int = field(default=10_000, metadata={"help": "Chunks one weight update may have (413 beyond)."})
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "Key every endpoint but /health requires (Authorization: Bearer). Prefer the environment "
            "variable HF_SPEC_COTRAIN_API_KEY: a command-line argument is visible to other users of the machine."
        },
    )
    allow_unauthenticated: bool = field(
        default=False,
        metadata={
            "help": "Listen beyond loopback without an API key: anyone who reaches the port can update weights."
        },
    )
    log_level: str = field(default="info", metadata={"help": "Log level: critical, error, warning, info or debug."})


_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def vllm_serve_parser():
    from trl import TrlParser

    from .generation import VLLM_INSTALL_HINT

    description = (
        "Serve speculative rollouts of a policy and its EAGLE-3 draft, with transactional weight updates. Needs vLLM: "
        f"{VLLM_INSTALL_HINT}."
    )
    return TrlParser((VLLMServeScriptArguments,), prog="hf-spec-cotrain vllm-serve", description=description)


def vllm_serve_engine_kwargs(args: VLLMServeScriptArguments) -> dict:
    """`VLLMRolloutEngine` arguments for `args`; a ValueError names any bad or conflicting option."""
    import json

    llm_kwargs = args.llm_kwargs if args.llm_kwargs is not None else {}
    if isinstance(llm_kwargs, str):
        try:
            llm_kwargs = json.loads(llm_kwargs)
        except json.JSONDecodeError as error:
            raise ValueError(f"`--llm_kwargs {args.llm_kwargs}` is not valid JSON: {error}.") from error
    if not isinstance(llm_kwargs, dict):
        raise ValueError(f"`--llm_kwargs` must be a JSON object of vllm.LLM arguments, got {llm_kwargs!r}.")
    options = {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "trust_remote_code": args.trust_remote_code or None,
    }
    options = {key: value for key, value in options.items() if value is not None}
    reserved = {"model", "seed", "speculative_config", *options}
    clashes = sorted(reserved & llm_kwargs.keys())
    if clashes:
        raise ValueError(
            f"`--llm_kwargs` sets {', '.join(clashes)}, which this command sets itself: use the dedicated options "
            "(--dtype, --max_model_len, ...; the draft through --draft) instead."
        )
    return {
        "model": args.model,
        "draft_model": args.draft,
        "num_speculative_tokens": args.num_speculative_tokens,
        "draft_sample_method": args.draft_sample_method,
        "rejection_sample_method": args.rejection_sample_method,
        "seed": args.seed,
        "verify_syncs": args.verify_syncs,
        **options,
        **llm_kwargs,
    }


def vllm_serve_main(argv: list[str]) -> None:
    import importlib.util

    from .generation import VLLM_INSTALL_HINT

    (args,) = vllm_serve_parser().parse_args_and_config(argv)
    missing = [name for name in ("vllm", "requests") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"hf-spec-cotrain vllm-serve needs {' and '.join(missing)}, not installed here: {VLLM_INSTALL_HINT}.")
    from .generation.protocol import API_KEY_ENV
    from .generation.server import serve

    if args.log_level not in _LOG_LEVELS:
        raise ValueError(f"`--log_level {args.log_level}` is not allowed: choose one of {', '.join(_LOG_LEVELS)}.")
    if not 0 <= args.port < 65536:
        raise ValueError(f"`--port {args.port}` is not a TCP port (0-65535).")
    serve(
        engine_kwargs=vllm_serve_engine_kwargs(args),
        host=args.host,
        port=args.port,
        transaction_timeout=args.transaction_timeout,
        max_chunk_bytes=args.max_chunk_bytes,
        max_open_transactions=args.max_open_transactions,
        max_staged_bytes=args.max_staged_bytes,
        max_chunks=args.max_chunks,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        allow_unauthenticated=args.allow_unauthenticated,
        log_level=args.log_level,
    )


GRPO_MODULE = "hf_spec_cotrain.scripts.grpo"
DEFAULT_ACCELERATE_CONFIG = "single_device"


def grpo_main(argv: list[str]) -> None:
    """Launch the main job through ``accelerate launch``, as ``trl grpo`` does: the job's own options go to the job,
    the others to accelerate; ``--accelerate_config`` names a shipped config (``cpu_ddp``, ``fsdp2``, ...) or a file.

    Without a launch config (neither given nor made by ``accelerate config``), the shipped single-device one is used,
    so that accelerate has nothing to guess (and to warn about)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    from .scripts.grpo import make_parser

    if "--accelerate_config" in argv:
        at = argv.index("--accelerate_config")
        if at + 1 == len(argv):
            raise ValueError("`--accelerate_config` needs a value: a shipped config's name or a YAML file.")
        config_file = accelerate_config_path(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :] + ["--config_file", config_file]
    # Split without building the job's config (that happens in the launched processes, where the device is known);
    # `--config file.yaml` belongs to the job.
    job_config = argv[argv.index("--config") : argv.index("--config") + 2] if "--config" in argv else []
    _, unknown = make_parser(prog="hf-spec-cotrain grpo").parse_known_args(_without(argv, job_config))
    launch_args, script_args = unknown, _without(argv, unknown)
    if "--config_file" not in launch_args and not os.path.isfile(_accelerate_default_config_file()):
        launch_args += ["--config_file", accelerate_config_path(DEFAULT_ACCELERATE_CONFIG)]
    launch_command(launch_command_parser().parse_args([*launch_args, "--module", GRPO_MODULE, *script_args]))


def accelerate_config_path(name: str) -> str:
    """A YAML file, or the path of a shipped accelerate config (`hf_spec_cotrain.accelerate_configs`) by its name."""
    from importlib import resources

    if os.path.isfile(name):
        return name
    shipped = resources.files("hf_spec_cotrain.accelerate_configs")
    names = sorted(path.name.removesuffix(".yaml") for path in shipped.iterdir() if path.name.endswith(".yaml"))
    if name not in names:
        raise ValueError(f"`--accelerate_config {name}` is neither a file nor a shipped config ({', '.join(names)}).")
    return str(shipped.joinpath(f"{name}.yaml"))


def _accelerate_default_config_file() -> str:
    from accelerate.commands.config.config_args import default_config_file

    return default_config_file


def _without(argv: list[str], removed: list[str]) -> list[str]:
    """``argv`` less ``removed``, a subsequence of it (arguments in their order in ``argv``)."""
    kept, pending = [], list(removed)
    for arg in argv:
        if pending and arg == pending[0]:
            pending.pop(0)
        else:
            kept.append(arg)
    return kept


COMMANDS = {
    "grpo": (
        grpo_main,
        "Run GRPO with a co-trained draft against plain GRPO (the main job; launches with accelerate).",
    ),
    "train-draft": (train_draft_main, "Warm-start a draft (`--drafter`) for a target on a dataset."),
    "export-draft": (export_draft_main, "Convert a draft between vLLM's EAGLE-3 layout and the speculators format."),
    "vllm-serve": (vllm_serve_main, "Serve speculative rollouts (policy + EAGLE-3 draft) with weight updates."),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from . import __version__

        print(f"hf-spec-cotrain {__version__}")
        return
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in COMMANDS:
        lines = [f"  {name:<14}{help_text}" for name, (_, help_text) in COMMANDS.items()]
        usage = (
            "usage: hf-spec-cotrain [--version] <command> [--options] [--config file.yaml]\n\ncommands:\n"
            + "\n".join(lines)
        )
        if argv and argv[0] not in {"-h", "--help"}:
            sys.exit(f"hf-spec-cotrain: unknown command {argv[0]!r}\n\n{usage}")
        print(usage)
        return
    command, _ = COMMANDS[argv[0]]
    command(argv[1:])


if __name__ == "__main__":
    main()
