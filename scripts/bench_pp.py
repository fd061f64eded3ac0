"""Step time of pipeline-parallel GRPO: TapChannel taps vs relayed taps vs no co-training, 2 and 4 stages (CPU).

What runs: one `PipelineCoTrainStep.step` (the policy's pipelined forward and backward with the GRPO loss, and on
the last stage the draft's objective: EAGLE-3's training-time test, or with ``--drafter dflash`` a one-layer DFlash
draft tapping as many layers, DFlash's spread) on a tiny Llama, float32, gloo, one thread per rank. Modes:

* ``pp``: pipeline parallelism without co-training (no taps, no draft): the baseline.
* ``channel-taps`` / ``relay-taps``: the taps are delivered to the last stage (TapChannel, or riding the
  activations) and the teacher is computed, but the draft does not train: the transport's own cost.
* ``channel`` / ``relay``: full co-training, the draft's TTT included.

All modes run in the same processes, interleaved repeat by repeat (so that load drifts hit them alike), each
step timed from a barrier to a barrier (the slowest rank), after warm-up steps. The table reports medians, and
ratios to ``pp`` as the median over repeats of the ratio within one repeat, for the wall seconds of the step
and for its CPU seconds summed over the ranks (each process's CPU time, gloo's threads included), which a
loaded machine disturbs far less. It also counts the bytes of the tensors the stages send over the TapChannel in one
step (the taps, and DFlash's mask-token row; headers of 96 bytes each aside). With 4 ranks on a 2-core machine the ranks also wait for a core: every extra
CPU-second shows up in the step time, whichever rank spends it, so there the draft's compute is never hidden
in the pipeline's drain bubble, as it partly is with one core per stage.

Reproduce the table of docs/pipeline_parallel.md (about 8 minutes on 2 cores):

    python scripts/bench_pp.py --stages 2 4 --repeats 15
    python scripts/bench_pp.py --stages 2 --repeats 3     # a quick look
    python scripts/bench_pp.py --drafter dflash --stages 2 4 --repeats 15
"""

import argparse
import os
import statistics
import sys
import time


MODES = ("pp", "channel-taps", "relay-taps", "channel", "relay")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--drafter", default="eagle3", choices=["eagle3", "dflash"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--schedule", default="1F1B", choices=["1F1B", "GPipe"])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8, help="GRPO batch rows per step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--completion-length", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    return parser


def _policy(args):
    from hf_spec_cotrain.testing import build_tiny_target

    heads = args.hidden_size // 64
    return build_tiny_target(
        "llama",
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=64,
        intermediate_size=int(2.75 * args.hidden_size),
    ).train()


def _aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    from hf_spec_cotrain.taps import default_aux_layer_ids

    return default_aux_layer_ids(num_layers)


def _draft(args, policy):
    """EAGLE-3 on the default taps, or a one-layer DFlash draft on DFlash's spread of as many target layers."""
    from hf_spec_cotrain import Eagle3DraftModel
    from hf_spec_cotrain.draft import DFlashDraftModel, default_target_layer_ids

    if args.drafter == "eagle3":
        return Eagle3DraftModel.from_target(policy, aux_layer_ids=_aux_layer_ids(args.num_layers)).train()
    spread = default_target_layer_ids(args.num_layers, len(_aux_layer_ids(args.num_layers)))
    return DFlashDraftModel.from_target(policy, mask_token_id=3, target_layer_ids=spread).train()


def _batch(args, seed: int):
    import torch

    from hf_spec_cotrain.training.pipeline_step import GRPOBatch

    generator = torch.Generator().manual_seed(seed)
    rows, prompt_length, completion_length = args.rows, args.prompt_length, args.completion_length
    completion_mask = torch.ones(rows, completion_length, dtype=torch.long)
    for row in range(rows):
        completion_mask[row, completion_length - (row * 7) % (completion_length // 2) :] = 0
    return GRPOBatch(
        prompt_ids=torch.randint(4, 100, (rows, prompt_length), generator=generator),
        prompt_mask=torch.ones(rows, prompt_length, dtype=torch.long),
        completion_ids=torch.randint(4, 100, (rows, completion_length), generator=generator),
        completion_mask=completion_mask,
        advantages=torch.randn(rows, generator=generator),
    )


def _build_step(args, mode: str, group):
    import torch.distributed as dist

    from hf_spec_cotrain.training.pipeline_step import PipelineCoTrainStep

    class TapsOnlyStep(PipelineCoTrainStep):
        """Delivers the taps and computes the teacher, without training the draft: the transport's cost."""

        def _draft_step(self, batch, attention_mask, scale):
            self._draft_inputs(batch, attention_mask)

    policy = _policy(args)
    is_last = dist.get_rank(group) == dist.get_world_size(group) - 1
    co_train = mode != "pp"
    draft = _draft(args, policy)  # on every rank: each needs its taps and the token ids it embeds itself
    step_class = TapsOnlyStep if mode.endswith("-taps") else PipelineCoTrainStep
    return step_class(
        policy,
        group=group,
        draft=draft if co_train and is_last else None,
        aux_layer_ids=draft.tap_layer_ids(args.num_layers) if co_train else None,
        embedded_token_ids=draft.embedded_token_ids(),
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        tap_transport="relay" if mode.startswith("relay") else "channel",
    )


def _worker(rank: int, world_size: int, init_file: str, args, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    steps = {mode: _build_step(args, mode, group) for mode in args.modes}
    sent = {mode: _count_sent_bytes(step) for mode, step in steps.items()}
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in args.modes}
    batch = _batch(args, seed=0)
    for repeat in range(args.warmup + args.repeats):
        for mode, step in steps.items():
            for param in step.parameters():
                param.grad = None
            if step.draft is not None:
                step.draft.zero_grad(set_to_none=True)
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            step.step(batch)
            cpu_seconds = time.process_time() - cpu_started  # this process, gloo's threads included
            dist.barrier()
            if repeat >= args.warmup:
                times[mode].append(time.perf_counter() - started)
                cpu[mode].append(cpu_seconds)
    per_rank_cpu = [None] * world_size
    dist.all_gather_object(per_rank_cpu, cpu)
    per_rank_sent = [None] * world_size
    dist.all_gather_object(per_rank_sent, {mode: counts[-1] for mode, counts in sent.items() if counts})
    if rank == 0:
        total_cpu = {mode: [sum(values) for values in zip(*(c[mode] for c in per_rank_cpu))] for mode in args.modes}
        channel_bytes = {mode: sum(s.get(mode, 0) for s in per_rank_sent) for mode in args.modes}
        results.put((times, total_cpu, channel_bytes))
    dist.barrier()
    dist.destroy_process_group()


def _count_sent_bytes(step) -> list[int]:
    """The bytes of the tensors this rank sends over the step's TapChannel, one count per step (filled in as it
    runs; empty on the receiver and without a channel)."""
    channel = step.channel
    counts: list[int] = []
    if channel is None or channel.is_receiver:
        return counts
    begin_step, send = channel.begin_step, channel.send

    def counting_begin_step():
        counts.append(0)
        begin_step()

    def counting_send(tensor, **kwargs):
        counts[-1] += tensor.numel() * tensor.element_size()
        send(tensor, **kwargs)

    channel.begin_step, channel.send = counting_begin_step, counting_send
    return counts


def _run(args, world_size: int) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, int]]:
    import tempfile

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        processes = mp.start_processes(
            _worker,
            args=(world_size, os.path.join(folder, "init"), args, results),
            nprocs=world_size,
            start_method="spawn",
            join=False,
        )
        outcome = results.get()
        processes.join()
    return outcome


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    tokens = args.rows * (args.prompt_length + args.completion_length)
    taps = _draft(args, _policy(args)).tap_layer_ids(args.num_layers)
    print(
        f"Llama {args.num_layers} layers x hidden {args.hidden_size}, {args.rows} rows x "
        f"{args.prompt_length + args.completion_length} tokens ({tokens} per step), {args.microbatches} micro-batches, "
        f"{args.schedule}, {args.drafter} taps {taps} + embeddings; median of {args.repeats} steps "
        f"after {args.warmup} warm-up: seconds (median over repeats of the ratio to pp in the same repeat)",
        flush=True,
    )
    header = f"{'stages':>6} {'':>4} | " + " | ".join(f"{mode:>19}" for mode in args.modes)
    print(header)
    print("-" * len(header))
    for world_size in args.stages:
        started = time.perf_counter()
        wall, cpu, channel_bytes = _run(args, world_size)
        for label, times in (("wall", wall), ("cpu", cpu)):
            cells = []
            for mode in args.modes:
                ratio = f" ({_paired_ratio(times, mode):.3f}x)" if "pp" in times else ""
                cells.append(f"{statistics.median(times[mode]):>10.3f}{ratio:>9}")
            print(f"{world_size:>6} {label:>4} | " + " | ".join(cells), flush=True)
        spread = ", ".join(f"{mode} {min(values):.3f}-{max(values):.3f}" for mode, values in wall.items())
        print(f"{'':>11}   wall range: {spread}   [{time.perf_counter() - started:.0f} s]", flush=True)
        sizes = ", ".join(f"{mode} {size / 2**10:.1f}" for mode, size in channel_bytes.items())
        print(f"{'':>11}   TapChannel KiB per step (all senders): {sizes}", flush=True)


def _paired_ratio(times: dict[str, list[float]], mode: str) -> float:
    """The median over repeats of mode / pp within the same repeat: load that drifts between repeats cancels."""
    return statistics.median(value / base for value, base in zip(times[mode], times["pp"]))


if __name__ == "__main__":
    sys.exit(main())
