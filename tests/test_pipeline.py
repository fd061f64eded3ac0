"""The pipeline's GRPO loss against TRL's own `_compute_loss`, and the stage split (single process)."""

import re

import pytest
import torch
from datasets import Dataset
from safetensors import safe_open
from tiny_policy import save_tiny_policy
from transformers import AutoConfig, AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from hf_spec_cotrain.losses import grpo_loss, grpo_loss_normalizer, grpo_per_token_logps
from hf_spec_cotrain.parallel.pipeline import pipeline_stage_class, stage_layer_ranges
from hf_spec_cotrain.testing import build_char_tokenizer, recorded_checkpoint_reads, save_tiny_target


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


def test_stage_layer_ranges():
    assert stage_layer_ranges(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layer_ranges(6, 2, [2, 4]) == [range(0, 2), range(2, 6)]
    with pytest.raises(ValueError, match="at most one per layer"):
        stage_layer_ranges(3, 4)
    with pytest.raises(ValueError, match="sum to the model's 6"):
        stage_layer_ranges(6, 2, [3, 2])
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layer_ranges(6, 2, [6, 0])
    with pytest.raises(ValueError, match="num_stages"):
        stage_layer_ranges(6, 0)


def _stage_of(name: str, ranges: list[range]) -> int:
    """The stage of a checkpoint tensor: its decoder layer's, else the first (embedding) or the last (norm, head)."""
    match = re.search(r"\blayers\.(\d+)\.", name)
    if match:
        return next(stage for stage, layers in enumerate(ranges) if int(match.group(1)) in layers)
    return 0 if "embed_tokens" in name else len(ranges) - 1


# Dense, MoE (the checkpoint's per-expert tensors fuse into one parameter as they load) and gpt-oss (sinks, alternating
# sliding windows, fused experts).
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_a_stage_class_reads_only_its_stage_and_loads_it_as_the_whole_model_does(tmp_path, family):
    folder = save_tiny_target(
        tmp_path, family, num_layers=5, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32
    )
    whole = AutoModelForCausalLM.from_pretrained(folder)
    whole_state = whole.state_dict()
    with safe_open(folder / "model.safetensors", framework="pt") as checkpoint:
        checkpoint_names = list(checkpoint.keys())
    config = AutoConfig.from_pretrained(folder)
    ranges = stage_layer_ranges(5, 3)
    all_reads = []
    for stage in range(3):
        stage_class = pipeline_stage_class(config, stage, 3)
        with recorded_checkpoint_reads() as reads:
            part = stage_class.from_pretrained(folder)
        assert isinstance(part, type(whole)) and type(part).__name__ == type(whole).__name__
        assert {_stage_of(name, ranges) for name in reads} == {stage}  # nothing of another stage was read
        part_state = part.state_dict()
        assert set(part_state) == {name for name in whole_state if _stage_of(name, ranges) == stage}
        for name, tensor in part_state.items():
            assert torch.equal(tensor, whole_state[name]), name
        for (name, buffer), (_, whole_buffer) in zip(part.named_buffers(), whole.named_buffers(), strict=True):
            torch.testing.assert_close(buffer, whole_buffer, rtol=0, atol=0, msg=name)  # rotary frequencies
        all_reads += reads
    assert sorted(all_reads) == sorted(checkpoint_names)  # over the stages, every tensor read once


def test_a_stage_class_refuses_a_stage_outside_the_pipeline(tmp_path):
    config = AutoConfig.from_pretrained(save_tiny_target(tmp_path, num_layers=4))
    with pytest.raises(ValueError, match="`stage_index`=2 is not a stage of 2"):
        pipeline_stage_class(config, 2, 2)
