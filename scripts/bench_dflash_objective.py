"""Cost of one draft training step: DFlash's objective (anchored blocks through `block_draft_attention`) against
EAGLE-3's training-time test (`ttt_loss`, K unrolled steps over every position), on the same batch.

Both drafts have one decoder layer as wide as the target, read the same taps of one target forward (TRL-like rows:
a prompt, then a completion that counts) and learn the same teacher; each measurement is forward + backward of the
family's `training_loss`, in process CPU seconds on one thread (the work done, whatever else loads the machine),
median of the repeats after one warm-up, the two families alternating so that load affects both alike. The printed
ratio is DFlash / EAGLE-3 (below 1: DFlash is cheaper).

    python scripts/bench_dflash_objective.py                     # rows 8 x L 256 and 1024, 8 and 32 anchors per row
    python scripts/bench_dflash_objective.py --lengths 2048 --anchors_per_row 16 --block_size 16
"""

import argparse
import statistics
import time

import torch

from hf_spec_cotrain.draft import DFlashDraftModel, DraftTrainingBatch, Eagle3DraftModel
from hf_spec_cotrain.draft.dflash_objective import DFlashTrainingOptions
from hf_spec_cotrain.draft.eagle3_ttt import Eagle3TrainingOptions
from hf_spec_cotrain.testing import build_tiny_target


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt_fraction", type=float, default=0.25, help="share of each row that does not count")
    parser.add_argument("--anchors_per_row", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--block_size", type=int, default=8)
    parser.add_argument("--ttt_steps", type=int, default=3)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_target_layers", type=int, default=8)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    return parser


def step_seconds(draft, batch, options) -> float:
    draft.zero_grad(set_to_none=True)
    start = time.process_time()
    draft.training_loss(batch, options, generator=torch.Generator().manual_seed(0)).loss.backward()
    return time.process_time() - start


def main(argv=None) -> None:
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    heads = args.hidden_size // 64
    target = build_tiny_target(
        "qwen3",
        num_layers=args.num_target_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        head_dim=64,
        intermediate_size=3 * args.hidden_size,
        vocab_size=args.vocab_size,
    )
    layers = args.num_target_layers
    dflash = DFlashDraftModel.from_target(
        target,
        mask_token_id=3,
        num_layers=1,
        target_layer_ids=[1, layers // 2, layers - 3],
        block_size=args.block_size,
    )
    eagle3 = Eagle3DraftModel.from_target(target, aux_layer_ids=dflash.tap_layer_ids(layers))
    print(f"target: {layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}; both drafts 1 layer, 3 taps")
    print(f"{'rows x L':>10} {'anchors':>8} {'DFlash s':>9} {'EAGLE-3 s':>10} {'ratio':>6}")
    for length in args.lengths:
        generator = torch.Generator().manual_seed(length)
        batch_size = args.rows
        aux = torch.randn(batch_size, length, 3 * args.hidden_size, generator=generator)
        embeds = torch.randn(batch_size, length, args.hidden_size, generator=generator)
        teacher = 3 * torch.randn(batch_size, length, args.vocab_size, generator=generator)
        loss_mask = torch.zeros(batch_size, length, dtype=torch.bool)
        loss_mask[:, int(args.prompt_fraction * length) :] = True
        batch = DraftTrainingBatch(aux, embeds, teacher, loss_mask)
        eagle3_options = Eagle3TrainingOptions(ttt_steps=args.ttt_steps, step_weight_decay=0.8)
        for anchors in args.anchors_per_row:
            dflash_options = DFlashTrainingOptions(anchors_per_row=anchors)
            times = {"dflash": [], "eagle3": []}
            for repeat in range(args.repeats + 1):
                seconds = (step_seconds(dflash, batch, dflash_options), step_seconds(eagle3, batch, eagle3_options))
                if repeat:  # the first is a warm-up
                    times["dflash"].append(seconds[0])
                    times["eagle3"].append(seconds[1])
            dflash_s, eagle3_s = (statistics.median(times[name]) for name in ("dflash", "eagle3"))
            label = f"{batch_size} x {length}"
            print(f"{label:>10} {anchors:>8} {dflash_s:>9.3f} {eagle3_s:>10.3f} {dflash_s / eagle3_s:>6.2f}")


if __name__ == "__main__":
    main()
