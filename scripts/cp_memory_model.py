"""Per-device memory of a whole co-training GRPO step under FSDP2 x context parallelism, from the shapes alone.

The model of docs/context_parallel.md ("The whole step"): a policy sharded with FSDP2 over every rank of the
(shard, cp) mesh (the ranks of a context-parallel group hold the same parameters, so the policy shards over the
flattened mesh, as torchtitan and accelerate do), full activation checkpointing per decoder block, one sequence of
``L`` tokens per context-parallel group split ``L / cp`` per rank, a frozen reference model for ``beta > 0``, and the
EAGLE-3 draft (one layer at the target's width) trained with TTT on the same rank, replicated or sharded.

    python scripts/cp_memory_model.py                        # the 100B-class, 256K-token, 64-device evaluation
    python scripts/cp_memory_model.py --devices 16 --length 131072 --draft sharded
"""

import argparse
from dataclasses import dataclass


GIB = 2**30


@dataclass(frozen=True)
class Shapes:
    """A dense decoder (GQA attention, gated MLP) and its EAGLE-3 draft."""

    layers: int = 116
    hidden: int = 8192
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 28672
    vocab: int = 128256
    draft_vocab: int = 32000
    ttt_steps: int = 3
    taps: int = 3

    @property
    def block_parameters(self) -> int:
        h, attention = self.hidden, self.heads * self.head_dim
        return h * attention * 2 + h * self.kv_heads * self.head_dim * 2 + 3 * h * self.intermediate

    @property
    def policy_parameters(self) -> int:
        return self.layers * self.block_parameters + 2 * self.vocab * self.hidden  # untied embedding and lm_head

    @property
    def draft_parameters(self) -> int:
        """Its layer reads [embedding, hidden] (2h wide), fc maps the taps (taps x h) to h, its own lm_head; the
        embedding is the target's."""
        h = self.hidden
        qkv = 2 * h * (self.heads + 2 * self.kv_heads) * self.head_dim
        return (
            qkv + self.heads * self.head_dim * h + 3 * h * self.intermediate + self.taps * h * h + self.draft_vocab * h
        )


@dataclass(frozen=True)
class Step:
    """What one step holds besides the shapes: bytes per element and options."""

    compute_bytes: int = 2  # bf16 parameters gathered for compute, activations
    state_bytes: int = 16  # fp32 master weights, fp32 gradients, Adam's two moments
    reference_model: bool = True  # beta > 0
    draft_sharded: bool = False
    ttt_gradient_checkpointing: bool = False  # the draft's layer recomputed per TTT step in the backward


def per_device_bytes(shapes: Shapes, step: Step, *, length: int, shard: int, cp: int) -> dict[str, float]:
    """Peak bytes per device, by term, of one training step (the policy's backward, the largest moment)."""
    s, b = shapes, step.compute_bytes
    ranks = shard * cp  # FSDP2 shards over the whole mesh
    n = length / cp  # positions per rank
    attention, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    terms = {
        "policy states (sharded)": step.state_bytes * s.policy_parameters / ranks,
        # FSDP2 holds the current block's gathered parameters and its gradient, and prefetches the next block.
        "gathered blocks": 3 * b * s.block_parameters,
        "reference model (sharded)": (b * s.policy_parameters / ranks) if step.reference_model else 0.0,
        "draft states": step.state_bytes * s.draft_parameters / (ranks if step.draft_sharded else 1),
        # Activation checkpointing keeps every block's input; one block is recomputed with its gradients.
        "checkpointed block inputs": s.layers * n * s.hidden * b,
        "one block recomputed": 2 * n * b * (2 * attention + 2 * kv + 3 * s.intermediate + 4 * s.hidden)
        + n * s.heads * 4
        + 2 * n * 2 * kv * b  # the ring's K/V shards in flight
        + 3 * n * 2 * kv * 4,  # and its float32 dK/dV shards
        # TRL's log-probs: bf16 logits, their float32 log-softmax and its gradient, over the whole vocabulary.
        "policy logits": n * s.vocab * (b + 4 + 4),
        # The draft's TTT (docs/context_parallel.md, memory model) and what feeds it, kept until its backward.
        "draft taps and teacher": n * s.hidden * b * (s.taps + 2) + n * s.draft_vocab * 4,
        "draft TTT activations": _ttt_activations(s, step, n),
    }
    terms["total"] = sum(terms.values())
    return terms


def _ttt_activations(s: Shapes, step: Step, n: float) -> float:
    """The draft's TTT: its layer's activations per step (or, checkpointed, the step's input and one step
    recomputed with its gradients), the branch K/V of the steps, and its logits over the draft vocabulary."""
    b, attention, kv, k = step.compute_bytes, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.ttt_steps
    layer = n * b * (2 * attention + 3 * s.intermediate + 2 * s.hidden) + n * s.heads * 4
    layers = k * n * 2 * s.hidden * b + 2 * layer if step.ttt_gradient_checkpointing else k * layer
    branch_kv = (k * (k + 1) // 2) * n * 2 * kv * b
    return layers + branch_kv + k * n * s.draft_vocab * (b + 4 + 4)


def layouts(devices: int) -> list[tuple[int, int]]:
    """Every (shard, cp) with shard x cp = devices and cp a power of two."""
    return [(devices // cp, cp) for cp in (2**i for i in range(devices.bit_length())) if devices % cp == 0]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--length", type=int, default=262144, help="tokens of the sequence")
    parser.add_argument("--budget_gb", type=float, default=80.0, help="memory per device, GB (1e9 bytes)")
    parser.add_argument("--draft", choices=("replicated", "sharded"), default="replicated")
    parser.add_argument("--no_reference_model", action="store_true", help="beta = 0: no reference model")
    parser.add_argument("--ttt_gradient_checkpointing", action="store_true", help="the draft's layer recomputed")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = make_parser().parse_args(argv)
    shapes = Shapes()
    step = Step(
        reference_model=not args.no_reference_model,
        draft_sharded=args.draft == "sharded",
        ttt_gradient_checkpointing=args.ttt_gradient_checkpointing,
    )
    print(
        f"policy {shapes.policy_parameters / 1e9:.1f}B parameters ({shapes.layers} layers x hidden {shapes.hidden}), "
        f"draft {shapes.draft_parameters / 1e9:.2f}B ({args.draft}); L = {args.length} tokens on {args.devices} "
        f"devices; GiB per device:\n"
    )
    rows = []
    for shard, cp in layouts(args.devices):
        terms = per_device_bytes(shapes, step, length=args.length, shard=shard, cp=cp)
        rows.append({"shard": shard, "cp": cp, **{name: value / GIB for name, value in terms.items()}})
    names = list(rows[0])[2:]
    print("| term | " + " | ".join(f"({r['shard']}, {r['cp']})" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{r[name]:.1f}" for r in rows) + " |")
    fits = [f"({r['shard']}, {r['cp']})" for r in rows if r["total"] * GIB <= args.budget_gb * 1e9]
    print(f"\nfits in {args.budget_gb:g} GB per device: {', '.join(fits) or 'none'}")
    return rows


if __name__ == "__main__":
    main()
