"""Per-rank memory and time of a whole GRPO training step with co-training, under FSDP2 x context parallelism.

What runs: `SpecCoTrainGRPOTrainer` on a tiny Llama (`--num_layers` layers of 128, GQA 4) (float32, CPU, gloo), each
rank holding 2 rows of one prompt and a fixed completion of L - prompt tokens (generation is replaced, so that only
the step's own work is measured), with `beta=0.04`: every step scores the rows with the reference model, runs the
policy's GRPO forward and backward and the draft's TTT (K = 3; with `--drafter dflash` DFlash's objective, blocks
of 8 at its default 8 anchors per row), then steps both optimizers. Configurations
(shard, cp): FSDP2 over `shard x cp` ranks (accelerate's `ParallelismConfig(dp_shard_size=shard, cp_size=cp)`; the
trainer shards the policy and the reference model itself on CPU) or plain data parallelism for shard = 1, and the
zigzag ring over groups of `cp` ranks. Each configuration and length runs in its own `torchrun`; the first step is a
warm-up at `--warmup_length` tokens (it creates the optimizers' states; only the measured steps pay for L), the
others are measured.

Memory, per rank, in three columns (each the maximum over the ranks):
* ``states``: the run-long parameters and optimizer states of the policy, the reference model and the draft
  (`storage_bytes` at the step's start: an FSDP2-sharded tensor counts as its local shard). Gradients are not
  among them: the Trainer and the draft's update set them to None after every step, so they are in ``step``. Not
  counted: DDP's gradient buckets (a copy of the policy's parameters; none under FSDP2) and the draft's last good
  copy (host memory on an accelerator).
* ``step``: the peak resident set over the step (VmHWM, reset at the step's start) minus the resident set then
  (scripts/bench_cp.py explains the method; children run with `MALLOC_MMAP_THRESHOLD_=65536`).
* ``whole``: states + step, a rank's peak of both.
Time: wall seconds of the step (the slowest rank) and CPU seconds of the busiest rank; with one thread per rank and
4 ranks on 2 cores, compare CPU seconds.

    python scripts/bench_cp_step.py --lengths 1024 2048               # a few minutes on 2 cores
    python scripts/bench_cp_step.py --json /tmp/cp_step.json          # L = 8K, 16K, 32K: hours on 2 cores
    python scripts/bench_cp_step.py --drafter dflash --configs 1x1 1x2 1x4 --lengths 8192 16384
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cp import _memory_status, _reset_peak  # noqa: E402


CONFIGS = ("1x1", "1x2", "1x4", "2x2")  # shard x cp
RATIOS = (("1x4", "1x1"), ("2x2", "1x2"), ("1x2", "1x1"))
MEMORY = ("states", "step", "whole")
PROMPT = "Q: count the letters. A:"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS, help="shard x cp")
    parser.add_argument("--steps", type=int, default=1, help="measured steps (after one warm-up step)")
    parser.add_argument(
        "--num_layers", type=int, default=3, help="decoder layers of the tiny policy (at least 3: the draft's taps)"
    )
    parser.add_argument(
        "--warmup_length", type=int, default=1024, help="tokens per row of the warm-up step (at most the least L)"
    )
    parser.add_argument("--drafter", choices=("eagle3", "dflash"), default="eagle3", help="the co-trained draft")
    parser.add_argument("--json", type=Path, help="write the results here (rewritten after every run)")
    parser.add_argument("--worker", nargs=4, metavar=("CONFIG", "LENGTH", "WARMUP", "DIR"), help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.num_layers < 3:
        parser.error(
            f"--num_layers {args.num_layers}: the draft taps 3 distinct layers (the first, the middle and the last); "
            "pass at least 3."
        )
    if not args.worker and args.warmup_length > min(args.lengths):
        parser.error(
            f"--warmup_length {args.warmup_length} exceeds the least of --lengths ({min(args.lengths)}): the warm-up "
            "step must not be the longer one; pass a --warmup_length up to it."
        )
    return args


def _sizes(config: str) -> tuple[int, int]:
    shard, cp = config.split("x")
    return int(shard), int(cp)


def worker(
    config: str, length: int, warmup_length: int, folder: Path, steps: int, num_layers: int, drafter: str
) -> None:
    """One rank of one configuration under torchrun: train 1 + `steps` steps (the first on rows of `warmup_length`
    tokens, the others of `length`), write this rank's measurements."""
    import torch
    import torch.distributed as dist
    from accelerate.parallelism_config import ParallelismConfig
    from datasets import Dataset
    from transformers import TrainerCallback

    from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
    from hf_spec_cotrain.testing import build_char_tokenizer, storage_bytes

    torch.set_num_threads(1)
    shard, cp = _sizes(config)
    tokenizer = build_char_tokenizer()
    prompt_length = len(tokenizer(PROMPT)["input_ids"])

    class FixedRollouts(SpecCoTrainGRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
            generator = torch.Generator().manual_seed(len(prompt_ids))
            total = warmup_length if self.state.global_step == 0 else length
            size = (len(prompt_ids), total - prompt_length)
            return torch.randint(4, 90, size, generator=generator).tolist(), None

    class StepMeter(TrainerCallback):
        def __init__(self):
            self.rows = []

        def on_step_begin(self, args, state, control, **kwargs):
            if dist.is_initialized():
                dist.barrier()
            states = storage_bytes(
                trainer.model, trainer.ref_model or (), trainer.draft, trainer.optimizer, trainer.draft_optimizer
            )
            _reset_peak()
            self.start = (states, _memory_status()["VmRSS"], time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kwargs):  # after the draft's update (added first)
            states, rss, wall, cpu = self.start
            step = _memory_status()["VmHWM"] - rss
            self.rows.append(
                {
                    "states": states,
                    "step": step,
                    "whole": states + step,
                    "wall": time.perf_counter() - wall,
                    "cpu": time.process_time() - cpu,
                }
            )

    taps = [0, num_layers // 2, num_layers - 1]  # the drafters' defaults need deeper policies
    draft = {"aux_layer_ids": taps}
    if drafter == "dflash":  # vLLM's numbering: the output of layer i is the input of layer i + 1
        draft = {"drafter": "dflash", "dflash_target_layer_ids": [i - 1 for i in taps[1:]], "dflash_mask_token_id": 3}
    parallel = {"context_parallel_size": cp}
    if shard > 1:
        parallel = {"parallelism_config": ParallelismConfig(dp_shard_size=shard, cp_size=cp)}
    args = SpecCoTrainConfig(
        output_dir=str(folder / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=length - prompt_length,
        max_steps=1 + steps,
        beta=0.04,
        logging_steps=1,
        save_strategy="no",
        save_draft=False,
        speculative_decoding=False,
        ttt_steps=3,
        ttt_gradient_checkpointing=True,
        disable_tqdm=True,
        **draft,
        **parallel,
    )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = FixedRollouts(
        model=str(folder.parent.parent / "policy"),
        reward_funcs=lambda completions, **kwargs: [float(len(set(text[:64]))) for text in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [PROMPT] * (world_size * (1 + steps))}),
        processing_class=tokenizer,
    )
    meter = StepMeter()
    trainer.add_callback(meter)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    (folder / f"rank{rank}.json").write_text(json.dumps(meter.rows[1:]))


def measure(
    config: str, length: int, warmup_length: int, root: Path, steps: int, num_layers: int, drafter: str
) -> dict[str, float]:
    """Run one configuration at one length; the maximum over ranks and measured steps of each column."""
    shard, cp = _sizes(config)
    folder = root / f"{config}-{length}"
    folder.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(shard * cp), "--master_port"]
    command += [
        str(29500 + (os.getpid() + len(list(root.iterdir()))) % 1000),
        __file__,
        "--steps",
        str(steps),
        "--num_layers",
    ]
    command += [
        str(num_layers),
        "--drafter",
        drafter,
        "--worker",
        config,
        str(length),
        str(warmup_length),
        str(folder),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false"}
    with (folder / "log.txt").open("w") as log:
        returncode = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if returncode:
        raise RuntimeError(f"{config} at L = {length} failed:\n" + (folder / "log.txt").read_text()[-6000:])
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(shard * cp)]
    return {key: max(row[key] for rows in ranks for row in rows) for key in (*MEMORY, "wall", "cpu")}


def main() -> None:
    args = parse_args()
    if args.worker:
        config, length, warmup_length, folder = args.worker
        worker(config, int(length), int(warmup_length), Path(folder), args.steps, args.num_layers, args.drafter)
        return
    from hf_spec_cotrain.testing import save_tiny_target

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save_tiny_target(
            root / "policy",
            num_layers=args.num_layers,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=256,
            max_position_embeddings=max(args.lengths),
        )
        runs = root / "runs"
        runs.mkdir()
        for n in args.lengths:
            for c in args.configs:
                results[c, n] = measure(c, n, args.warmup_length, runs, args.steps, args.num_layers, args.drafter)
                print(f"{c} at L = {n}: {results[c, n]}", flush=True)
                if args.json:
                    rows = [{"config": c, "length": n, **row} for (c, n), row in results.items()]
                    options = {key: getattr(args, key) for key in ("num_layers", "warmup_length", "steps", "drafter")}
                    args.json.write_text(json.dumps({**options, "results": rows}, indent=1))
    print_tables(results, args.lengths, args.configs)


def print_tables(results: dict, lengths: list[int], configs: list[str]) -> None:
    """Markdown tables: every configuration's memory (MiB) and CPU seconds, then the ratios of whole and step."""
    print("| L | (shard, cp) | states MiB | step MiB | whole MiB | CPU s | wall s |\n|---|---|---|---|---|---|---|")
    for (c, n), row in results.items():
        memory = " | ".join(f"{row[key] / 2**20:.1f}" for key in MEMORY)
        print(f"| {n} | ({', '.join(c.split('x'))}) | {memory} | {row['cpu']:.1f} | {row['wall']:.1f} |")
    ratios = [(a, b) for a, b in RATIOS if a in configs and b in configs]
    if not ratios:
        return
    print("\n| L | " + " | ".join(f"{a} / {b} whole | step" for a, b in ratios) + " |")
    print("|---|" + "---|---|" * len(ratios))
    for n in lengths:
        cells = [f"{results[a, n][key] / results[b, n][key]:.2f}" for a, b in ratios for key in ("whole", "step")]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
