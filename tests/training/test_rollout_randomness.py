"""Each HF-native rollout call of a step draws fresh randomness (`HFNativeBackend.call_generator`): the turns of a
multi-turn rollout are sampled independently, as the policy's law requires, and reproducibly from the seed."""

from contextlib import nullcontext

import torch
from statistics_utils import exact_distribution, g_test

from hf_spec_cotrain.generation.adaptive import FixedSpeculation
from hf_spec_cotrain.testing import build_char_tokenizer, build_pass_through_draft, build_tiny_target
from hf_spec_cotrain.training.rollout_backends import HFNativeBackend, RolloutSampling


TOKENS_PER_TURN, TOP_K, NUM_ROLLOUTS = 2, 3, 2000
PROMPT, TOOL_RESULT = [1, 7, 12, 5], [9, 4]
P_VALUE_THRESHOLD = 1e-3


def _setup():
    target = build_tiny_target(
        "llama",
        tokenizer=build_char_tokenizer(alphabet="abcdefghijkl"),
        num_layers=3,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=96,
        seed=5,
        dtype=torch.float64,
    ).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)  # broad next-token laws: every one of the top-k tokens is drawn often
    draft = build_pass_through_draft(target, seed=1, noise=0.5, aux_layer_ids=(0, 1, 2)).to(torch.float64)
    return target, draft


def _backend(target, draft, seed: int = 0) -> HFNativeBackend:
    sampling = RolloutSampling(TOKENS_PER_TURN, 1.0, 1.0, TOP_K, [], 0, None)
    return HFNativeBackend(
        draft,
        sampling,
        policy=lambda: nullcontext(target),
        speculation=FixedSpeculation(2),
        seed=seed,
        draft_sampling=None,
        device=torch.device("cpu"),
        process_index=0,
    )


def _two_turns(backend, step: int = 3) -> list[tuple[int, ...]]:
    """Rollouts of two turns, the second after a fixed tool result, as TRL's tool loop calls them."""
    first = backend.generate([PROMPT] * NUM_ROLLOUTS, step=step, training=True).completions
    second_prompts = [PROMPT + completion + TOOL_RESULT for completion in first]
    second = backend.generate(second_prompts, step=step, training=True).completions
    return [(*a, *b) for a, b in zip(first, second)]


def test_each_call_of_a_step_samples_afresh_and_a_rerun_samples_the_same():
    target, draft = _setup()
    backend = _backend(target, draft)
    prompts = [PROMPT] * 64
    first = backend.generate(prompts, step=3, training=True).completions
    second = backend.generate(prompts, step=3, training=True).completions
    assert first != second  # the same prompts, the same step: a second call does not replay the first's draws
    rerun = _backend(target, draft)
    assert rerun.generate(prompts, step=3, training=True).completions == first
    assert rerun.generate(prompts, step=3, training=True).completions == second
    # an evaluation call in between takes its own stream and leaves the training calls' sequence as it was
    again = _backend(target, draft)
    again.generate(prompts, step=3, training=True)
    again.generate(prompts, step=3, training=False)
    assert again.generate(prompts, step=3, training=True).completions == second


def test_two_turn_rollouts_follow_the_policys_joint_law():
    """The joint law of both turns' tokens equals sampling each turn from the policy given the conversation so far
    (enumerated exactly); with the turns drawing the same random stream it fails."""
    target, draft = _setup()
    samples = _two_turns(_backend(target, draft))
    warp = dict(temperature=1.0, top_k=TOP_K, top_p=1.0, pad=0, eos=None)
    first_law = exact_distribution(target, torch.tensor([PROMPT]), TOKENS_PER_TURN, **warp)
    exact = {}
    for first, p_first in first_law.items():
        prompt = torch.tensor([PROMPT + list(first) + TOOL_RESULT])
        for second, p_second in exact_distribution(target, prompt, TOKENS_PER_TURN, **warp).items():
            exact[(*first, *second)] = p_first * p_second
    assert g_test(samples, exact) > P_VALUE_THRESHOLD
