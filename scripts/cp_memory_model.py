"""Per-device memory of a whole co-training GRPO step under FSDP2 x context parallelism, from the shapes alone.

The model of docs/context_parallel.md ("The whole step"): the policy sharded with FSDP2 over every rank of the
(shard, cp) mesh (the ranks of a context-parallel group hold the same parameters), one sequence of ``L`` tokens per
micro-batch split ``n = L / cp`` per rank, bf16 activations, fp32 master weights with AdamW, every policy layer and
every TTT step checkpointed, a bf16 reference model (``beta > 0``), and the draft (one layer at the target's width:
EAGLE-3's, or with ``--drafter dflash`` DFlash's, whose one tap and full vocabulary are the trainer's defaults)
replicated or sharded. Peak = the terms that live all run + the larger of the policy's backward and the draft's
step.

    python scripts/cp_memory_model.py                        # 256K tokens of a 100B-class policy on 64 devices
    python scripts/cp_memory_model.py --drafter dflash
    python scripts/cp_memory_model.py --devices 16 --length 131072
"""

import argparse
from dataclasses import dataclass


GIB = 2**30
ACTIVATION_BYTES = 2  # bf16


@dataclass(frozen=True)
class Shapes:
    """A Llama-style decoder (GQA attention, gated MLP, untied embedding and head) and its draft (``drafter``)."""

    layers: int = 112
    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 28672
    vocab: int = 128256
    draft_vocab: int = 32000
    ttt_steps: int = 3
    drafter: str = "eagle3"
    dflash_layers: int = 1
    dflash_anchors: int = 8  # per sequence: the trainer's default
    dflash_block: int = 8

    @property
    def layer_parameters(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + 3 * h * self.intermediate

    @property
    def policy_parameters(self) -> int:
        return self.layers * self.layer_parameters + 2 * self.vocab * self.hidden

    @property
    def draft_parameters(self) -> int:
        """EAGLE-3: its layer reads [embedding, hidden] (2h wide); fc maps three taps to h; its own lm_head. DFlash:
        decoder layers like the target's, fc from one tap per layer; it reads the target's head (full vocabulary)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.drafter == "dflash":
            return self.dflash_layers * (self.layer_parameters + h * h)
        return 2 * h * (q + 2 * kv) + q * h + 3 * h * self.intermediate + 3 * h * h + self.draft_vocab * h

    @property
    def teacher_vocab(self) -> int:
        """The vocabulary of the teacher's logits: DFlash's default draft reads the whole one."""
        return self.vocab if self.drafter == "dflash" else self.draft_vocab

    def layer_activations(self, n: float) -> float:
        """One decoder layer's activations and their gradients over ``n`` positions (recomputed in the backward)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return n * (4 * self.hidden + 2 * q + 2 * kv + 3 * self.intermediate) * ACTIVATION_BYTES * 2

    def ring_buffers(self, n: float) -> float:
        """The ring's K/V shards in flight (current and next) and its three float32 dK/dV shards."""
        return n * 2 * self.kv_heads * self.head_dim * (2 * ACTIVATION_BYTES + 3 * 4)

    def ttt_attention(self, n: float) -> float:
        """The draft's TTT attention under the ring (the memory model's table): kept from forward to backward, plus
        one backward call's transients."""
        k, b, q, kv = self.ttt_steps, ACTIVATION_BYTES, self.heads * self.head_dim, 2 * self.kv_heads * self.head_dim
        kept = k * 2 * n * q * b + k * n * self.heads * 4 + n * kv * b + (k - 1 + k * (k - 1) // 2) * n * kv * b
        transient = n * self.heads * (4 * self.head_dim + 4) + n * kv * 4 + self.ring_buffers(n)
        return kept + transient

    def draft_step(self, n: float) -> float:
        """The draft's training step on ``n`` positions per rank, the taps and the teacher included."""
        b, kv = ACTIVATION_BYTES, 2 * self.kv_heads * self.head_dim
        teacher = 2 * n * self.teacher_vocab * 4 + self.vocab * self.hidden * 4  # its rows and a copy; the whole head
        if self.drafter == "dflash":
            taps = (self.dflash_layers + 2) * n * self.hidden * b  # the taps, the embedding, the final hidden
            blocks = self.dflash_anchors * self.dflash_block
            return (
                taps
                + teacher
                + 2 * n * self.hidden * b  # fc's output and the context states
                + self.dflash_layers * n * kv * b  # every layer's context K/V, kept for the backward
                + self.ring_buffers(n)
                + self.dflash_layers * self.layer_activations(blocks)  # the blocks themselves: no n
            )
        taps = 5 * n * self.hidden * b  # three tapped layers, the embedding, the final hidden
        return (
            taps
            + teacher
            + n * (self.ttt_steps + 3) * self.hidden * b  # checkpointed TTT step inputs and fc's input
            + self.layer_activations(n)
            + self.ttt_attention(n)
        )


def per_device_bytes(
    shapes: Shapes,
    *,
    length: int,
    shard: int,
    cp: int,
    reference_model: bool = True,
    draft_sharded: bool = False,
) -> dict[str, float]:
    """Bytes per device of one step: the run-long terms, the policy's backward, the draft's step and the peak."""
    s, b = shapes, ACTIVATION_BYTES
    ranks, n = shard * cp, length / cp
    run_long = 16 * s.policy_parameters / ranks + 16 * s.draft_parameters / (ranks if draft_sharded else 1)
    if reference_model:
        run_long += b * s.policy_parameters / ranks
    policy_backward = (
        8 * s.layer_parameters  # two gathered bf16 layers and one layer's fp32 gradient
        + 2 * s.vocab * s.hidden * b  # the gathered embedding and head
        + s.layers * n * s.hidden * b  # checkpointed layer inputs
        + s.layer_activations(n)
        + s.ring_buffers(n)
        + 5 * n * s.hidden * b  # the taps (EAGLE-3's five; DFlash's default three are fewer)
    )
    draft_step = s.draft_step(n)
    return {
        "run_long": run_long,
        "policy_backward": policy_backward,
        "draft_step": draft_step,
        "peak": run_long + max(policy_backward, draft_step),
    }


def layouts(devices: int) -> list[tuple[int, int]]:
    """Every (shard, cp) with shard x cp = devices, cp a power of two."""
    return [(devices // cp, cp) for cp in (2**i for i in range(devices.bit_length())) if devices % cp == 0]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--length", type=int, default=262144, help="tokens of the sequence")
    parser.add_argument("--budget_gib", type=float, default=80e9 / GIB, help="memory per device (default 80 GB)")
    parser.add_argument("--no_reference_model", action="store_true", help="beta = 0: no reference model")
    parser.add_argument("--drafter", choices=("eagle3", "dflash"), default="eagle3", help="the co-trained draft")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = make_parser().parse_args(argv)
    shapes = Shapes(drafter=args.drafter)
    print(
        f"policy {shapes.policy_parameters / 1e9:.1f}B parameters, draft {shapes.draft_parameters / 1e9:.2f}B; "
        f"L = {args.length} tokens on {args.devices} devices; GiB per device, budget {args.budget_gib:.1f}\n"
    )
    print(
        "| (shard, cp) | n = L / cp | run-long | policy backward | draft step | **peak** | peak with the draft sharded |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for shard, cp in layouts(args.devices):
        common = dict(length=args.length, shard=shard, cp=cp, reference_model=not args.no_reference_model)
        terms = per_device_bytes(shapes, **common)
        sharded = per_device_bytes(shapes, **common, draft_sharded=True)
        row = {
            "shard": shard,
            "cp": cp,
            **{k: v / GIB for k, v in terms.items()},
            "peak_sharded": sharded["peak"] / GIB,
        }
        rows.append(row)
        print(
            f"| ({shard}, {cp}) | {args.length // cp} | {row['run_long']:.1f} | {row['policy_backward']:.1f} | "
            f"{row['draft_step']:.1f} | {row['peak']:.1f} | {row['peak_sharded']:.1f} |"
        )
    fits = [f"({r['shard']}, {r['cp']})" for r in rows if r["peak"] <= args.budget_gib]
    print(f"\nfits: {', '.join(fits) or 'none'}")
    return rows


if __name__ == "__main__":
    main()
