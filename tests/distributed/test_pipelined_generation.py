"""Generation through pipeline stages (`PipelinedTarget`), on gloo with 2 and 4 stages: the last stage drives
`speculative_generate`, the others serve its forwards with caches of their own layers.

Lossless as on one process: greedy decoding returns `generate`'s tokens of the uncut model, and with the same
generator the sampled tokens and every counter equal those of `speculative_generate` on the uncut model (whose law
tests/generation/test_speculative.py checks), for speculative and plain (K = 0) decoding; the law itself is checked once more
through the pipeline. Rows of different prompt lengths finish at different rounds (EOS) and random drafts are mostly
rejected, so the stages' row selection and the compaction of holes are exercised.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from process_pool import subgroup
from statistics_utils import exact_distribution, g_test

from hf_spec_cotrain import Eagle3DraftModel
from hf_spec_cotrain.generation.adaptive import PlainDecoding
from hf_spec_cotrain.generation.pipelined import PipelinedTarget
from hf_spec_cotrain.generation.speculative import speculative_generate
from hf_spec_cotrain.parallel.pipeline import cut_model_to_stage, stage_layer_ranges
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target


pytestmark = pytest.mark.distributed
NUM_LAYERS = 8
AUX_LAYER_IDS = (6, 1, 4)  # not in layer order: the draft's fc order must survive the relay
EOS = 2
NUM_SAMPLES = 3000
P_VALUE_THRESHOLD = 1e-3


def _target(family: str, window: int | None, dtype: torch.dtype) -> torch.nn.Module:
    """The same small-vocabulary target on every rank, with broad next-token laws (EOS among 20 ids)."""
    target = build_tiny_target(
        family,
        tokenizer=build_char_tokenizer("abcdefghijklmnop"),
        num_layers=NUM_LAYERS,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        sliding_window=window,
        seed=3,
        dtype=dtype,
    )
    if dtype == torch.float64 and family in ("gpt_oss", "qwen3_moe"):
        target.set_experts_implementation("eager")  # torch's grouped matmul takes no float64
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)
    return target.eval()


def _prompts(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight left-padded prompts of 2 to 7 tokens."""
    generator = torch.Generator().manual_seed(1)
    lengths = [7, 2, 5, 4, 6, 3, 7, 2]
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, -length:] = torch.randint(4, vocab_size, (length,), generator=generator)
        attention_mask[row, -length:] = 1
    return input_ids, attention_mask


def _counters(out) -> dict:
    return {
        name: getattr(out, name)
        for name in ("sequences", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position")
    } | {"rounds": out.rounds, "per_row": out.num_accepted_per_row}


def run_pipelined(size: int, family: str, window: int | None, dtype: torch.dtype, cases: list[dict]):
    """Every case through a pipeline of `size` stages and on the uncut model; on the driver, per case, both
    outputs' tokens and counters (and `generate`'s greedy tokens); None elsewhere."""
    group = subgroup(size)
    stage = dist.get_rank(group)
    target = _target(family, window, dtype)
    whole = copy.deepcopy(target) if stage == size - 1 else None
    ranges = stage_layer_ranges(NUM_LAYERS, size)
    cut_model_to_stage(target, ranges[stage], is_first=stage == 0, is_last=stage == size - 1)
    pipeline = PipelinedTarget(target, layer_ranges=ranges, aux_layer_ids=AUX_LAYER_IDS, group=group)
    if not pipeline.is_driver:
        pipeline.serve()
        return None
    torch.manual_seed(0)
    draft = Eagle3DraftModel.from_target(whole, aux_layer_ids=AUX_LAYER_IDS).to(dtype).eval()
    results = []
    try:
        for case in cases:
            result = {
                "pipelined": _generate(target, draft, case, pipeline=pipeline),
                "whole": _generate(whole, draft, case),
            }
            if not case.get("do_sample"):
                input_ids, attention_mask = case["prompts"]
                result["generate"] = whole.generate(
                    input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=case["max_new_tokens"]
                )
            results.append(result)
    finally:
        pipeline.finish()
    return results


def _generate(model, draft, case: dict, **extra) -> dict:
    """`speculative_generate` of one case (its prompts, its generator's seed, its options); tokens and counters."""
    options = dict(case)
    input_ids, attention_mask = options.pop("prompts")
    seed = options.pop("seed", None)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = speculative_generate(
        model, draft, input_ids, attention_mask, pad_token_id=0, generator=generator, **options, **extra
    )
    return _counters(out)


def _cases(vocab_size: int) -> list[dict]:
    prompts = _prompts(vocab_size)
    return [
        dict(prompts=prompts, max_new_tokens=17, num_speculative_tokens=3, eos_token_id=EOS),
        dict(prompts=prompts, max_new_tokens=17, num_speculative_tokens=2, do_sample=True, seed=4, eos_token_id=EOS),
        dict(
            prompts=prompts,
            max_new_tokens=9,
            num_speculative_tokens=1,
            do_sample=True,
            temperature=0.7,
            top_k=6,
            draft_sampling="greedy",
            seed=5,
            eos_token_id=EOS,
        ),
        dict(prompts=prompts, max_new_tokens=11, num_speculative_tokens=PlainDecoding(), eos_token_id=EOS),
    ]


@pytest.mark.parametrize(
    "size, family, window, dtype",
    [
        (2, "llama", None, torch.float32),
        (4, "gpt_oss", 3, torch.float64),  # sliding layers (a window shorter than the rows) and attention sinks
        (2, "qwen3_moe", None, torch.float32),
    ],
)
def test_pipelined_generation_equals_the_whole_model(cp_pool, size, family, window, dtype):
    cases = _cases(vocab_size=20)
    results = cp_pool.run(run_pipelined, size, family, window, dtype, cases)[size - 1]
    for result in results:
        pipelined, whole = result["pipelined"], result["whole"]
        for name, expected in whole.items():
            same = torch.equal(pipelined[name], expected) if isinstance(expected, torch.Tensor) else None
            assert same if same is not None else pipelined[name] == expected, name
        if "generate" in result:
            generated = result["generate"]
            assert torch.equal(pipelined["sequences"], generated[:, : pipelined["sequences"].shape[1]])
    # Rows finished at different rounds, and drafts were both accepted and rejected.
    sampled = results[1]["pipelined"]
    assert len({live for live, _ in sampled["rounds"]}) > 2
    assert 0 < sampled["num_accepted_tokens"] < sampled["num_draft_tokens"]
    assert all(k == 0 for _, k in results[3]["pipelined"]["rounds"])


def run_pipelined_samples(size: int):
    """`NUM_SAMPLES` samples of 3 tokens after one prompt, through the pipeline (None off the driver)."""
    prompt = torch.tensor([[1, 7, 12, 5, 9]])
    case = dict(
        prompts=(prompt.expand(NUM_SAMPLES, -1), torch.ones(NUM_SAMPLES, 5, dtype=torch.long)),
        max_new_tokens=3,
        num_speculative_tokens=2,
        do_sample=True,
        seed=6,
        eos_token_id=EOS,
    )
    results = run_pipelined(size, "llama", None, torch.float64, [case])
    return None if results is None else results[0]["pipelined"]["sequences"][:, prompt.shape[1] :]


def test_pipelined_sampling_follows_the_target_distribution(cp_pool):
    generated = cp_pool.run(run_pipelined_samples, 2)[1]
    generated = torch.nn.functional.pad(generated, (0, 3 - generated.shape[1]), value=0)
    target = _target("llama", None, torch.float64)
    exact = exact_distribution(
        target, torch.tensor([[1, 7, 12, 5, 9]]), 3, temperature=1.0, top_k=0, top_p=1.0, pad=0, eos=EOS
    )
    samples = [tuple(row) for row in generated.tolist()]
    assert g_test(samples, exact) > P_VALUE_THRESHOLD
