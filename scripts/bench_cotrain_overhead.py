"""GRPO step time with draft co-training (EAGLE-3 and DFlash) versus plain TRL `GRPOTrainer`, on the same inputs.

Two measurements per policy, median over the timed steps of two interleaved runs of each trainer. Policies:
a tiny and a mid-size 8-layer one, and a deep one (32 layers, hidden 256) whose depth, against the 1-layer
draft, is that of real policies (28-80 layers): the draft's cost is a fixed number of layers, so its share
of the step is set by the policy's depth.

* full step: same prompts and seed, both trainers generate with plain `generate` (speculative rollouts off, so
  only the co-training cost differs), then score, forward, backward and step; the co-training trainer also
  taps the policy's forward and trains the draft. This is the ratio the goal (<= 1.10) is about.
* training only: generation is replaced by identical pre-sampled completions, so the ratio isolates the draft's
  training forward/backward against the policy's forward/backward (an upper bound on the overhead: real steps also
  generate).

Each co-training column is one drafter (``--drafters``, each the trainer's default draft of its family: EAGLE-3
1 layer with K = 3, DFlash 1 layer with blocks of 8 and 8 anchors per row) at one `draft_train_fraction`. Each
policy's row also gives the matmul FLOPs of each draft's training forward+backward over those of the policy's
forward+backward on one micro-batch of the benchmark's shape (`torch.utils.flop_counter`): the draft's share of
the training work, which no implementation of the same draft can lower (only `draft_train_fraction` can). And
each measurement prints the seconds per step in the draft's training micro-steps, over the plain step's seconds:
the overhead timed directly, without the spread of the rest of the step between runs.

    python scripts/bench_cotrain_overhead.py                     # every size
    python scripts/bench_cotrain_overhead.py --sizes deep --steps 6
    python scripts/bench_cotrain_overhead.py --quick             # tiny only, fewer steps
    python scripts/bench_cotrain_overhead.py --draft_train_fractions 1 0.5 0.25   # one column per fraction
    python scripts/bench_cotrain_overhead.py --drafters dflash   # one drafter (default: both)
    python scripts/bench_cotrain_overhead.py --bf16              # both trainers in bf16 mixed precision
    python scripts/bench_cotrain_overhead.py --draft_bf16        # float32 policies, the draft under bf16 autocast
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.draft import DRAFTER_FAMILIES, DraftTrainingBatch, drafter_family
from hf_spec_cotrain.testing import build_char_tokenizer, save_tiny_target


SIZES = {
    "tiny": dict(
        num_layers=8, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256
    ),
    "mid": dict(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1376,
    ),
    "deep": dict(
        num_layers=32,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=688,
    ),
}


VOCAB_SIZE = 128  # the character tokenizer's 100 tokens, padded


class StepTimer(TrainerCallback):
    """Step times, and (co-training) the seconds of each step spent in the draft's training micro-steps."""

    def __init__(self):
        self.times, self.draft_times, self._start, self._draft = [], [], None, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._draft = time.perf_counter(), 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)
        self.draft_times.append(self._draft)

    def time_draft_micro_steps(self, trainer) -> None:
        micro_step = trainer.draft_cotrainer.micro_step

        def timed(*args, **kwargs):
            started = time.perf_counter()
            micro_step(*args, **kwargs)
            self._draft += time.perf_counter() - started

        trainer.draft_cotrainer.micro_step = timed


PROMPTS = [f"prompt number {i}: " + "x" * 24 for i in range(64)]


def training_flops(policy_dir: str, drafter: str, *, batch: int, completion_length: int) -> tuple[float, float]:
    """Matmul FLOPs of one micro-batch's policy forward+backward and of the draft's training forward+backward (the
    trainer's default draft of the family, the policy's vocabulary, loss on the completion tokens)."""
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    family = drafter_family(drafter)
    args = SpecCoTrainConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, drafter=drafter)
    draft = family.from_target(policy, **family.from_target_options(args, build_char_tokenizer()))
    prompt_length = len(build_char_tokenizer()(PROMPTS[0]).input_ids)
    length = prompt_length + completion_length
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, policy.config.vocab_size, (batch, length), generator=generator)
    loss_mask = torch.arange(length) >= prompt_length
    with FlopCounterMode(display=False) as policy_counter:
        policy(input_ids, logits_to_keep=completion_length + 1).logits.sum().backward()
    taps = len(draft.tap_layer_ids(policy.config.num_hidden_layers))
    hidden = policy.config.hidden_size
    training_batch = DraftTrainingBatch(
        aux_hidden_states=torch.randn(batch, length, taps * hidden, generator=generator),
        input_embeds=torch.randn(batch, length, hidden, generator=generator),
        teacher_logits=torch.randn(batch, length, draft.config.draft_vocab_size, generator=generator),
        loss_mask=loss_mask.expand(batch, -1),
    )
    with FlopCounterMode(display=False) as draft_counter:
        options = draft.training_options(args)
        draft.training_loss(training_batch, options, generator=generator).loss.backward()
    return policy_counter.get_total_flops(), draft_counter.get_total_flops()


def fixed_rollouts(trainer_cls):
    """A trainer subclass whose generation returns pre-sampled completions (identical for both trainers)."""

    class Fixed(trainer_cls):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            generator = torch.Generator().manual_seed(len(prompt_ids) * 7919 + sum(map(sum, prompt_ids)))
            vocab = self.processing_class.vocab_size
            completions = torch.randint(5, vocab, (len(prompt_ids), self.max_completion_length), generator=generator)
            return completions.tolist(), None

    return Fixed


def run(
    policy_dir: str,
    *,
    drafter: str | None,
    fixed: bool,
    steps: int,
    batch: int,
    completion_length: int,
    fraction: float = 1.0,
    bf16: bool = False,
    draft_bf16: bool | None = None,
    use_cpu: bool = True,
) -> tuple[list[float], list[float]]:
    """Seconds per timed step, and of those the seconds in the draft's training micro-steps; ``drafter`` None: plain
    GRPO (no draft seconds)."""
    common = dict(
        output_dir=tempfile.mkdtemp(),
        use_cpu=use_cpu,
        bf16=bf16,
        report_to="none",
        per_device_train_batch_size=batch,
        num_generations=4,
        max_completion_length=completion_length,
        max_steps=steps,
        logging_steps=10**6,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    prompts = Dataset.from_dict({"prompt": PROMPTS})
    reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    wrap = fixed_rollouts if fixed else (lambda cls: cls)
    if drafter is not None:
        trainer = wrap(SpecCoTrainGRPOTrainer)(
            model=policy_dir,
            reward_funcs=reward,
            args=SpecCoTrainConfig(
                **common,
                drafter=drafter,
                speculative_decoding=False,
                draft_train_fraction=fraction,
                draft_bf16=draft_bf16,
            ),
            train_dataset=prompts,
            processing_class=build_char_tokenizer(),
        )
    else:
        trainer = wrap(GRPOTrainer)(
            model=policy_dir,
            reward_funcs=reward,
            args=GRPOConfig(**common),
            train_dataset=prompts,
            processing_class=build_char_tokenizer(),
        )
    timer = StepTimer()
    trainer.add_callback(timer)
    if drafter is not None:
        timer.time_draft_micro_steps(trainer)
    trainer.train()
    return timer.times[2:], timer.draft_times[2:]  # the first steps include one-off allocation and dispatch warm-up


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument(
        "--draft_train_fractions",
        nargs="+",
        type=float,
        default=[1.0],
        help="`draft_train_fraction` values to measure side by side (each a co-training column)",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 mixed precision in both trainers (the draft's training follows it)"
    )
    parser.add_argument(
        "--draft_bf16",
        action="store_true",
        help="`draft_bf16=True`: the draft's training under bf16 autocast, the policies as they are",
    )
    parser.add_argument(
        "--drafters",
        nargs="+",
        choices=list(DRAFTER_FAMILIES),
        default=list(DRAFTER_FAMILIES),
        help="drafter families to measure side by side (each a co-training column per fraction)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = ["tiny"] if args.quick else args.sizes
    steps = args.steps or (6 if args.quick else 10)
    variants = [(drafter, fraction) for drafter in args.drafters for fraction in args.draft_train_fractions]
    columns = "".join(f"{f'{drafter} x{fraction:g} s (ratio)':>28}" for drafter, fraction in variants)
    header = f"{'policy':<8}{'measure':<15}{'plain GRPO s/step':>19}{columns}"
    rows, flop_shares = [], {}

    def show(size, kind, plain, cotrain):
        cells = "".join(f"{f'{seconds:.3f} ({seconds / plain:.3f})':>28}" for seconds in cotrain)
        print(f"{size:<8}{kind:<15}{plain:>19.3f}{cells}", flush=True)

    with tempfile.TemporaryDirectory() as root:
        for size in sizes:
            # A vocabulary padded past the tokenizer's, as real models have: DFlash fills its blocks with a spare row.
            policy_dir = str(save_tiny_target(Path(root, size), "llama", vocab_size=VOCAB_SIZE, **SIZES[size]))
            shapes = dict(batch=8, completion_length=64 if size == "tiny" else 128, bf16=args.bf16)
            for drafter in args.drafters:
                policy_flops, draft_flops = training_flops(
                    policy_dir, drafter, batch=shapes["batch"], completion_length=shapes["completion_length"]
                )
                flop_shares[size, drafter] = draft_flops / policy_flops
                print(
                    f"[bench] {size}: training matmul GFLOP per micro-batch, policy {policy_flops / 1e9:.1f}, "
                    f"{drafter} draft {draft_flops / 1e9:.1f} ({flop_shares[size, drafter]:.2f}x the policy's)",
                    flush=True,
                )
            for fixed in (False, True):
                # Interleave the runs so a change of machine load hits all alike.
                plain = []
                cotrain, draft = {variant: [] for variant in variants}, {variant: [] for variant in variants}
                for _ in range(2):
                    plain += run(policy_dir, drafter=None, fixed=fixed, steps=steps, **shapes)[0]
                    for drafter, fraction in variants:
                        step_times, draft_times = run(
                            policy_dir,
                            drafter=drafter,
                            fixed=fixed,
                            steps=steps,
                            fraction=fraction,
                            draft_bf16=args.draft_bf16 or None,
                            **shapes,
                        )
                        cotrain[drafter, fraction] += step_times
                        draft[drafter, fraction] += draft_times
                kind = "training only" if fixed else "full step"
                plain_seconds = statistics.median(plain)
                medians = [statistics.median(cotrain[variant]) for variant in variants]
                rows.append((size, kind, plain_seconds, medians))
                print(f"[bench] {header}", flush=True)  # each row as soon as it is measured
                show(*rows[-1])
                # The draft's seconds over the plain step: the overhead without the run-to-run spread of the rest
                # of the step (mostly generation time), which moves the step ratios by up to 0.1.
                in_draft = ", ".join(
                    f"{drafter} x{fraction:g} {seconds:.3f} (+{seconds / plain_seconds:.3f} of the plain step)"
                    for (drafter, fraction), seconds in ((v, statistics.median(draft[v])) for v in variants)
                )
                print(f"[bench] {size} {kind}: draft training micro-steps, s/step (median): {in_draft}", flush=True)
    print(f"\n{header}")
    for row in rows:
        show(*row)
    shares = ", ".join(f"{size} {drafter} {share:.2f}x" for (size, drafter), share in flop_shares.items())
    print(f"draft training / policy training matmul FLOPs (all rows): {shares}")
    for index, (drafter, fraction) in enumerate(variants):
        full = [cotrain[index] / plain for _, kind, plain, cotrain in rows if kind == "full step"]
        verdict = "met" if all(ratio <= 1.10 for ratio in full) else "NOT met"
        print(f"goal: full-step ratio <= 1.10 for {drafter} at draft_train_fraction={fraction:g} -> {verdict}")


if __name__ == "__main__":
    main()
