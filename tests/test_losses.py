"""The objectives: the chunked, checkpointed head loss against the eager soft cross-entropy on materialised logits,
and the pipelined GRPO loss against TRL's own `_compute_loss`, with its loss-type check and completion loss mask."""

import pytest
import torch
from datasets import Dataset
from tiny_policy import save_tiny_policy
from torch import nn
from trl import GRPOConfig, GRPOTrainer

from hf_spec_cotrain.losses import (
    GRPO_LOSS_TYPES,
    check_grpo_loss_type,
    completion_loss_mask,
    draft_loss_mask,
    grpo_loss,
    grpo_loss_normalizer,
    grpo_per_token_logps,
    head_soft_cross_entropy,
    soft_cross_entropy,
)
from hf_spec_cotrain.testing import build_char_tokenizer


def _head(hidden_size, vocab, dtype, seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, vocab, bias=False)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_elements", [7 * 37, 10**9])  # many uneven chunks / one chunk
def test_head_loss_matches_eager_loss_and_gradients(dtype, chunk_elements):
    head = _head(24, 37, dtype, seed=0)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 11, 24, generator=g, dtype=dtype, requires_grad=True)
    teacher = 2 * torch.randn(3, 11, 37, generator=g, dtype=dtype)
    counted = torch.rand(3, 11, generator=g) < 0.6
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    want = soft_cross_entropy(head(hidden), teacher, counted)
    got = head_soft_cross_entropy(head, hidden, teacher, counted, chunk_elements=chunk_elements)
    for g_value, w_value in zip(got, want):
        torch.testing.assert_close(g_value.to(w_value.dtype), w_value, **tol)
    params = [hidden, *head.parameters()]
    for g_grad, w_grad in zip(torch.autograd.grad(got[0], params), torch.autograd.grad(want[0], params)):
        torch.testing.assert_close(g_grad, w_grad, **tol)


def test_global_count_and_nothing_counted():
    head = _head(8, 5, torch.float64, seed=2)
    hidden = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(1, 6, 5, dtype=torch.float64)
    counted = torch.tensor([[True, False, True, True, False, False]])
    share, _, count = head_soft_cross_entropy(head, hidden, teacher, counted, total_count=torch.tensor(6))
    full, _, _ = head_soft_cross_entropy(head, hidden, teacher, counted)
    assert count == 3
    torch.testing.assert_close(share, full * 3 / 6)
    none = head_soft_cross_entropy(head, hidden, teacher, torch.zeros_like(counted))
    assert none[0].item() == 0.0 and none[2].item() == 0
    none[0].backward()
    assert hidden.grad is None or torch.count_nonzero(hidden.grad) == 0


# --- The GRPO loss -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    # A smaller policy than the shared one: the old log-probs of `_inputs` are drawn so that this policy's ratios
    # fall outside the clipping range on both sides.
    return str(save_tiny_policy(tmp_path_factory.mktemp("policy"), family="qwen3", num_layers=2, intermediate_size=96))


def _trl_trainer(policy_dir, tmp_path, **overrides):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=9,
        **overrides,
    )
    trainer = GRPOTrainer(
        model=policy_dir,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}),
        processing_class=build_char_tokenizer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _inputs(vocab_size: int, *, with_old: bool, seed: int = 0):
    """A TRL-shaped micro-batch: left-padded prompts, right-padded completions, some old log-probs far off."""
    generator = torch.Generator().manual_seed(seed)
    rows, prompt_length, completion_length = 6, 5, 9
    prompt_mask = torch.ones(rows, prompt_length, dtype=torch.long)
    completion_mask = torch.ones(rows, completion_length, dtype=torch.long)
    for row in range(rows):
        prompt_mask[row, : row % 3] = 0
        completion_mask[row, completion_length - (2 * row) % 7 :] = 0
    inputs = {
        "prompt_ids": torch.randint(4, vocab_size, (rows, prompt_length), generator=generator),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, vocab_size, (rows, completion_length), generator=generator),
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=generator),
        "num_items_in_batch": completion_mask.sum(),
    }
    if with_old:
        inputs["old_per_token_logps"] = -5 * torch.rand(rows, completion_length, generator=generator)
    return inputs


@pytest.mark.parametrize(
    "overrides, with_old",
    [
        ({}, False),
        ({"temperature": 0.7}, True),
        ({"epsilon": 0.1, "epsilon_high": 0.28, "temperature": 1.3}, True),
        *[({"loss_type": loss_type, "temperature": 0.7}, True) for loss_type in ("grpo", "bnpo", "dr_grpo")],
        # TRL's KL term to the reference model, with its importance-sampling correction (TRL's default) and without
        ({"beta": 0.3, "temperature": 0.7}, False),
        ({"beta": 0.3, "loss_type": "grpo"}, True),
        ({"beta": 0.3, "use_bias_correction_kl": False, "loss_type": "dr_grpo"}, True),
    ],
)
@pytest.mark.parametrize("accumulation", [1, 3])
def test_grpo_loss_equals_trl_compute_loss(policy_dir, tmp_path, overrides, with_old, accumulation):
    """The pipelined loss with its whole-batch normaliser equals TRL's `_compute_loss`, value and gradients, for
    every loss type the pipeline takes, with a KL term, inside an accumulation window too."""
    trainer = _trl_trainer(policy_dir, tmp_path, **overrides)
    trainer.current_gradient_accumulation_steps = accumulation
    model = trainer.model
    inputs = _inputs(model.config.vocab_size, with_old=with_old)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    completion_length = inputs["completion_ids"].shape[1]
    if trainer.beta != 0.0:  # a reference model near the policy: its log-probs moved by noise
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_length
            )
        noise = torch.randn(logps.shape, generator=torch.Generator().manual_seed(3))
        inputs["ref_per_token_logps"] = logps + 0.5 * noise
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -completion_length - 1 : -1]
    loss = grpo_loss(
        logits,
        inputs["completion_ids"],
        inputs["completion_mask"],
        inputs["advantages"],
        inputs.get("old_per_token_logps"),
        temperature=trainer.temperature,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        loss_type=trainer.loss_type,
        normalizer=grpo_loss_normalizer(
            trainer.loss_type,
            inputs["completion_mask"],
            max_completion_length=trainer.max_completion_length,
            num_items_in_batch=inputs["num_items_in_batch"],
            gradient_accumulation_steps=accumulation,
        ),
        ref_per_token_logps=inputs.get("ref_per_token_logps"),
        beta=trainer.beta,
        bias_correction_kl=trainer.args.use_bias_correction_kl,
    )
    loss.backward()
    assert loss.item() != 0.0
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        assert param.grad.abs().sum() > 0, name
        torch.testing.assert_close(param.grad, trl_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    if with_old:  # the inputs do exercise the clipping on both sides
        per_token = grpo_per_token_logps(logits, inputs["completion_ids"], temperature=trainer.temperature)
        ratio = torch.exp(per_token - inputs["old_per_token_logps"])[inputs["completion_mask"].bool()]
        assert (ratio < 1 - trainer.epsilon_low).any() and (ratio > 1 + trainer.epsilon_high).any()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_loss_of_microbatches_sums_to_the_batch_loss(loss_type):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 5, 11, generator=generator, dtype=torch.float64)
    ids = torch.randint(0, 11, (8, 5), generator=generator)
    mask = (torch.rand(8, 5, generator=generator) > 0.3).long()
    mask[3] = 0  # a row with no counted token counts as a row (grpo, dr_grpo), not as a token
    advantages = torch.randn(8, generator=generator, dtype=torch.float64)
    old = -3 * torch.rand(8, 5, generator=generator, dtype=torch.float64)
    whole = grpo_loss(logits, ids, mask, advantages, old, loss_type=loss_type)
    normalizer = grpo_loss_normalizer(loss_type, mask, max_completion_length=5)
    parts = sum(
        grpo_loss(
            logits[rows],
            ids[rows],
            mask[rows],
            advantages[rows],
            old[rows],
            loss_type=loss_type,
            normalizer=normalizer,
        )
        for rows in torch.arange(8).split(2)
    )
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


def test_unsupported_loss_types_are_refused():
    logits, ids, mask = torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(ValueError, match="`loss_type`='cispo' is not supported"):
        grpo_loss(logits, ids, mask, torch.zeros(1), loss_type="cispo")
    with pytest.raises(ValueError, match="`beta`=0.1 weighs a KL term to the reference model"):
        grpo_loss(logits, ids, mask, torch.zeros(1), beta=0.1)


def test_the_loss_type_check_names_the_supported_types():
    for loss_type in GRPO_LOSS_TYPES:
        check_grpo_loss_type(loss_type)
    with pytest.raises(
        ValueError, match="`loss_type`='sapo' is not supported; choose one of grpo, bnpo, dr_grpo, dapo"
    ):
        check_grpo_loss_type("sapo")
    with pytest.raises(ValueError, match="`loss_type`='cispo' is not supported"):
        grpo_loss_normalizer("cispo", torch.ones(1, 2), max_completion_length=2)


def test_completion_loss_mask_leaves_out_tool_results():
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    tool_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])  # the second token of row 0 came from a tool
    assert completion_loss_mask(completion_mask) is completion_mask
    assert completion_loss_mask(completion_mask, tool_mask).tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]


def test_draft_loss_mask_covers_generated_tokens_only():
    prompt_mask = torch.tensor([[0, 1], [1, 1]])  # left-padded prompts
    completion_mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    tool_mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    assert draft_loss_mask(prompt_mask, completion_mask).tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert draft_loss_mask(prompt_mask, completion_mask, tool_mask).tolist() == [[0, 0, 1, 0, 1], [0, 0, 1, 0, 0]]
