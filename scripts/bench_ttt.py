"""TTT forward+backward time and peak memory against L: blockwise branch attention versus a dense-mask reference.

Both paths run the same `hf_spec_cotrain.draft.eagle3_ttt.ttt_loss` on the same draft and inputs (one packed row of three
documents, K = 3 steps); the dense path only swaps the attention for `branch_attention_reference` (one explicit
``[L, (1 + S) L]`` mask per head) inside its own process, without changing the library. Each (path, L) runs in a
fresh subprocess, so that its peak resident memory (``ru_maxrss``) is its own: the reported memory is the peak RSS
increase over the process baseline taken after imports, the draft and the inputs exist. Time is the median of a
few repeats after one warm-up (fewer when a configuration would exceed ``--budget_s``; a step that alone takes a
third of the budget is its own measurement), in CPU seconds of the process when it runs on one thread (the work
done, whatever else loads a shared machine) and in wall-clock seconds otherwise. The dense path is skipped ("n/a")
where its estimated peak exceeds ``--dense_limit_gb`` or the memory available now. Where the dense path runs, a
third process runs the same step with the attention replaced by the identity: the difference between a path's
peak and that one is the memory the attention itself holds.

The default draft is sized so that the dense path still fits at L = 8192 on a 24 GB machine (4 query heads): the
goal "at L = 8192 the blockwise peak memory is <= 0.1x the dense one" is then measured, not extrapolated.

    python scripts/bench_ttt.py            # L = 1K .. 16K; about 12 CPU minutes on 1 thread, ~15 GB at L = 8192
    python scripts/bench_ttt.py --quick    # L = 1K, 2K, 4K; about 4 CPU minutes
    python scripts/bench_ttt.py --lengths 8192 --gradient_checkpointing   # each TTT step recomputed in backward
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


PATHS = ("blockwise", "dense", "no_attention")
GOAL_LENGTH = 8192
GOAL_MEMORY_RATIO = 0.1
# Packed documents as fractions of L (B = 1, `cu_seqlens`): one long rollout and two shorter ones.
DOCUMENT_FRACTIONS = (0.5, 0.3, 0.2)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--quick", action="store_true", help="L = 1K, 2K, 4K and 2 repeats")
    parser.add_argument("--hidden_size", type=int, default=512)
    parser.add_argument("--intermediate_size", type=int, default=1376)
    parser.add_argument("--num_q_heads", type=int, default=4)
    parser.add_argument("--num_kv_heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--draft_vocab_size", type=int, default=4096)
    parser.add_argument("--ttt_steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up, at most")
    parser.add_argument("--budget_s", type=float, default=60.0, help="stop repeating a configuration after this")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 by default because a shared 2-core machine makes multi-threaded timings erratic",
    )
    parser.add_argument("--dense_limit_gb", type=float, default=16.0, help="skip the dense path above this estimate")
    parser.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="ttt_loss(gradient_checkpointing=True) on every path: each step's draft layer recomputed in backward",
    )
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return parser


def _max_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _document_lengths(length: int) -> list[int]:
    lengths = [int(length * fraction) for fraction in DOCUMENT_FRACTIONS[:-1]]
    return [*lengths, length - sum(lengths)]


def run_child(args: argparse.Namespace) -> None:
    """Measure one (path, L) in this fresh process and print the result as one JSON line."""
    import torch

    import hf_spec_cotrain.draft.eagle3_ttt as ttt
    from hf_spec_cotrain.attention import branch_attention_reference
    from hf_spec_cotrain.draft import Eagle3DraftModel, count_tokens
    from hf_spec_cotrain.testing import build_tiny_target

    torch.set_num_threads(args.threads)
    if args.child == "dense":

        def dense_branch_attention(q, k, v, branch_k=None, branch_v=None, *, cu_seqlens=None, cp_group=None):
            if cp_group is not None:
                raise ValueError("The dense reference runs on one device: `cp_group` must be None.")
            return branch_attention_reference(q, k, v, branch_k, branch_v, cu_seqlens=cu_seqlens)

        ttt.branch_attention = dense_branch_attention  # this process only
    elif args.child == "no_attention":
        # Attention replaced by the identity on q: the memory and time of everything else in the TTT step.
        ttt.branch_attention = lambda q, *args, **kwargs: q
    target = build_tiny_target(
        num_layers=8,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_q_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        vocab_size=2 * args.draft_vocab_size,
    )
    generator = torch.Generator().manual_seed(0)
    vocab_size = target.config.vocab_size
    counts = count_tokens([torch.randint(0, vocab_size, (4 * vocab_size,), generator=generator)], vocab_size)
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=args.draft_vocab_size, token_counts=counts)
    cfg = draft.config
    length = args.length
    aux = torch.randn(1, length, cfg.target_hidden_size * cfg.num_aux_hidden_states, generator=generator)
    embeds = torch.randn(1, length, cfg.hidden_size, generator=generator)
    teacher = 3 * torch.randn(1, length, cfg.draft_vocab_size, generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(_document_lengths(length)).cumsum(0).tolist()], dtype=torch.int32)

    def step() -> tuple[float, float]:
        start, cpu_start = time.perf_counter(), time.process_time()
        out = ttt.ttt_loss(
            draft,
            aux_hidden_states=aux,
            input_embeds=embeds,
            teacher_logits=teacher,
            cu_seqlens=cu_seqlens,
            ttt_steps=args.ttt_steps,
            gradient_checkpointing=args.gradient_checkpointing,
        )
        out.loss.backward()
        seconds = (time.perf_counter() - start, time.process_time() - cpu_start)
        if not torch.isfinite(out.loss):
            raise RuntimeError(f"{args.child} L={length}: the TTT loss is {out.loss.item()}")
        draft.zero_grad(set_to_none=True)
        return seconds

    baseline = _max_rss_bytes()
    warmup = step()
    # A step that takes a large share of the budget needs no warm-up: keep it as a measurement.
    times = [warmup] if warmup[0] > args.budget_s / 3 else []
    while len(times) < args.repeats and (not times or warmup[0] + sum(wall for wall, _ in times) < args.budget_s):
        times.append(step())
    result = {
        "seconds": statistics.median(wall for wall, _ in times),
        "cpu_seconds": statistics.median(cpu for _, cpu in times),
        "peak_bytes": _max_rss_bytes() - baseline,
    }
    print(json.dumps(result))


def dense_attention_estimate(args: argparse.Namespace, length: int) -> int:
    """Bytes of the dense path's score-sized float32 tensors: step ``d`` keeps ``[Hq, L, (1 + d) L]`` probabilities
    for backward, and the last step holds about two more such tensors while it runs (11.4 score-sized ``[Hq, L, L]``
    tensors were measured for K = 3 at L = 2048, against 12 estimated)."""
    score = args.num_q_heads * length * length * 4
    kept = sum(1 + step for step in range(args.ttt_steps))
    return (kept + 2 * args.ttt_steps) * score


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def measure(args: argparse.Namespace, path: str, length: int) -> dict | None:
    command = [sys.executable, __file__, "--child", path, "--length", str(length)]
    flags = (
        "hidden_size",
        "intermediate_size",
        "num_q_heads",
        "num_kv_heads",
        "head_dim",
        "draft_vocab_size",
        "ttt_steps",
        "repeats",
        "budget_s",
        "threads",
    )
    for flag in flags:
        command += [f"--{flag}", str(getattr(args, flag))]
    if args.gradient_checkpointing:
        command.append("--gradient_checkpointing")
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        print(f"{path} L={length} failed (exit {completed.returncode}):\n{completed.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _cell(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or denominator is None else numerator / denominator


def _get(result: dict | None, key: str) -> float | None:
    return None if result is None else result[key]


def _attention_share(result: dict | None, baseline: dict | None) -> float | None:
    """Peak MiB of a path minus that of the same step without attention: what the attention itself holds (RSS
    noise of some tens of MiB can make a small share negative)."""
    if result is None or baseline is None:
        return None
    return (result["peak_bytes"] - baseline["peak_bytes"]) / 2**20


def main() -> None:
    args = make_parser().parse_args()
    if args.child:
        run_child(args)
        return
    if args.quick:
        args.lengths, args.repeats = [1024, 2048, 4096], 2
    # One thread: CPU time is the work done, whatever else shares the machine; several threads: wall clock.
    clock = "cpu_seconds" if args.threads == 1 else "seconds"

    print(
        f"TTT loss forward+backward, float32, B=1 packed ({len(DOCUMENT_FRACTIONS)} documents), K={args.ttt_steps}; "
        f"draft: 1 layer, hidden {args.hidden_size}, Hq={args.num_q_heads}, Hkv={args.num_kv_heads}, "
        f"D={args.head_dim}, draft vocab {args.draft_vocab_size}; {args.threads} thread(s); gradient checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'}.\n"
        f"Time = {'CPU' if clock == 'cpu_seconds' else 'wall-clock'} seconds per step, median of <= {args.repeats} "
        f"(repeats stop after {args.budget_s:g} s); dense skipped above an estimated {args.dense_limit_gb:g} GB.\n"
        "Peak = peak RSS increase of a fresh process over its baseline (draft and inputs built). attn-only = peak "
        "minus the peak of the same step with attention replaced by the identity (run where dense runs)."
    )
    header = [
        "L",
        "blockwise s",
        "dense s",
        "block/dense time",
        "blockwise MiB",
        "dense MiB",
        "block/dense mem",
        "no-attn MiB",
        "attn-only block MiB",
        "attn-only dense MiB",
    ]
    widths = [max(len(title), 7) for title in header]
    print(" | ".join(title.rjust(width) for title, width in zip(header, widths)))
    print("-+-".join("-" * width for width in widths), flush=True)
    mib = 2**20
    memory_ratios = {}
    for length in args.lengths:
        blockwise = measure(args, "blockwise", length)
        dense = baseline = None
        dense_estimate = dense_attention_estimate(args, length) + (_get(blockwise, "peak_bytes") or 0)
        available = _available_bytes()
        if dense_estimate > args.dense_limit_gb * 2**30:
            pass
        elif available is not None and dense_estimate > available - 2**30:
            print(
                f"L={length}: dense skipped, it needs about {dense_estimate / 2**30:.1f} GB and "
                f"{available / 2**30:.1f} GB are available now",
                file=sys.stderr,
            )
        else:
            dense = measure(args, "dense", length)
            baseline = measure(args, "no_attention", length)
        memory_ratios[length] = _ratio(_get(blockwise, "peak_bytes"), _get(dense, "peak_bytes"))
        row = [
            str(length),
            _cell(_get(blockwise, clock), ".2f"),
            _cell(_get(dense, clock), ".2f"),
            _cell(_ratio(_get(blockwise, clock), _get(dense, clock)), ".2f"),
            _cell(blockwise and blockwise["peak_bytes"] / mib, ".0f"),
            _cell(dense and dense["peak_bytes"] / mib, ".0f"),
            _cell(memory_ratios[length], ".3f"),
            _cell(baseline and baseline["peak_bytes"] / mib, ".0f"),
            _cell(_attention_share(blockwise, baseline), ".0f"),
            _cell(_attention_share(dense, baseline), ".0f"),
        ]
        print(" | ".join(cell.rjust(width) for cell, width in zip(row, widths)), flush=True)

    memory_ratio = memory_ratios.get(GOAL_LENGTH)
    goal = f"goal: at L={GOAL_LENGTH} the blockwise TTT peak memory is <= {GOAL_MEMORY_RATIO}x the dense one"
    if memory_ratio is None:
        print(f"{goal}: NOT MEASURED (L={GOAL_LENGTH} not in the sweep, or the dense path was skipped or failed)")
    else:
        verdict = "MET" if memory_ratio <= GOAL_MEMORY_RATIO else "NOT MET"
        print(f"{goal}: {verdict} (measured {memory_ratio:.3f}x)")


if __name__ == "__main__":
    main()
