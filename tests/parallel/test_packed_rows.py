"""The policy under context parallelism, on one process: packing TRL's rows, the transformers attention adapter,
the log-probs against TRL's fused head, and the trainer's check of the world size. The config's checks are in
tests/test_config.py; the multi-rank parity is in tests/distributed/test_policy_cp.py and
tests/distributed/test_trainer_cp.py."""

import pytest
import torch
from tiny_policy import tiny_grpo_kwargs
from trl.trainer.utils import add_fused_lm_head

from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer
from hf_spec_cotrain.attention.hf_adapter import (
    ZIGZAG_RING_ATTENTION,
    zigzag_ring_attention,
    zigzag_ring_attention_forward,
)
from hf_spec_cotrain.parallel import pad_documents, zigzag_unshard
from hf_spec_cotrain.parallel.packed_rows import (
    IGNORE_INDEX,
    completion_values,
    pack_rows,
    policy_log_probs,
)
from hf_spec_cotrain.testing import build_char_tokenizer, build_tiny_target


PAD = 0


def random_rows(prompt_lengths, completion_lengths, *, prompt_width=7, completion_width=6, seed=0):
    """TRL's layout: left-padded prompts, right-padded completions, random token ids (never the pad id)."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(prompt_lengths)
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - torch.tensor(prompt_lengths)[:, None]).long()
    completion_mask = (torch.arange(completion_width) < torch.tensor(completion_lengths)[:, None]).long()
    prompt_ids = torch.randint(4, 60, (batch, prompt_width), generator=generator).masked_fill(prompt_mask == 0, PAD)
    completion_ids = torch.randint(4, 60, (batch, completion_width), generator=generator)
    return prompt_ids, prompt_mask, completion_ids.masked_fill(completion_mask == 0, PAD), completion_mask


def expected_packing(prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask):
    """The packed sequence, built token by token."""
    ids, labels, index, counted, positions, bounds = [], [], [], [], [], [0]
    width = completion_ids.shape[1]
    for b in range(prompt_ids.shape[0]):
        prompt = prompt_ids[b][prompt_mask[b].bool()].tolist()
        completion = completion_ids[b][completion_mask[b].bool()].tolist()
        tokens = prompt + completion
        for t in range(len(tokens)):
            ids.append(tokens[t])
            scores = t + 1 >= len(prompt) and t + 1 < len(tokens)
            labels.append(tokens[t + 1] if scores else IGNORE_INDEX)
            index.append(b * width + t + 1 - len(prompt) if scores else -1)
            counted.append(t >= len(prompt) and bool(loss_mask[b, t - len(prompt)]))
            positions.append(t)
        bounds.append(bounds[-1] + len(tokens))
    return {
        "input_ids": torch.tensor(ids),
        "shift_labels": torch.tensor(labels),
        "completion_index": torch.tensor(index),
        "loss_mask": torch.tensor(counted),
        "position_ids": torch.tensor(positions),
        "cu_seqlens": torch.tensor(bounds),
    }


def test_pack_rows_builds_documents_labels_and_completion_index():
    rows = random_rows([7, 2, 4], [6, 1, 3])
    loss_mask = torch.tensor([[1, 0, 1, 1, 0, 1], [1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]])
    packed = pack_rows(*rows, completion_loss_mask=loss_mask)
    expected = expected_packing(*rows, loss_mask)
    # one device: the documents are padded to even lengths (2W), padding at their ends
    padding = pad_documents(expected["cu_seqlens"], world_size=1)
    assert torch.equal(packed.cu_seqlens, padding.cu_seqlens)
    for name, fill in [("input_ids", PAD), ("shift_labels", IGNORE_INDEX), ("loss_mask", False)]:
        assert torch.equal(getattr(packed, name)[0], padding.pad(expected[name], dim=0, value=fill)), name
    assert torch.equal(packed.completion_index, padding.pad(expected["completion_index"], dim=0, value=-1))
    assert torch.equal(packed.position_ids[0][padding.index], expected["position_ids"])
    assert (packed.batch_size, packed.completion_length) == (3, 6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_shards_reassemble_to_the_padded_packing(world_size):
    rows = random_rows([3, 7, 1, 5], [6, 2, 4, 1], seed=1)
    shards = [pack_rows(*rows, rank=rank, world_size=world_size, pad_token_id=PAD) for rank in range(world_size)]
    expected = expected_packing(*rows, rows[3])
    padding = pad_documents(expected["cu_seqlens"], world_size=world_size)
    assert all(torch.equal(shard.cu_seqlens, padding.cu_seqlens) for shard in shards)
    assert all(shard.input_ids.shape[1] * world_size == padding.real_mask.numel() for shard in shards)

    def whole(name):
        return zigzag_unshard([getattr(shard, name).reshape(-1) for shard in shards], 0, padding.cu_seqlens)

    assert torch.equal(whole("input_ids"), padding.pad(expected["input_ids"], dim=0, value=PAD))
    assert torch.equal(whole("shift_labels"), padding.pad(expected["shift_labels"], dim=0, value=IGNORE_INDEX))
    assert torch.equal(whole("completion_index"), padding.pad(expected["completion_index"], dim=0, value=-1))
    assert torch.equal(whole("loss_mask"), padding.pad(expected["loss_mask"], dim=0, value=False))
    assert torch.equal(whole("position_ids")[padding.index], expected["position_ids"])


def test_completion_values_scatters_to_trl_layout_with_gradient():
    rows = random_rows([4, 2], [3, 5], completion_width=5)
    packed = pack_rows(*rows)
    values = torch.randn(packed.input_ids.shape, dtype=torch.float64, requires_grad=True)
    out = completion_values(values, packed)
    expected = torch.zeros(2, 5, dtype=torch.float64)
    scored = packed.completion_index >= 0
    expected.view(-1)[packed.completion_index[scored]] = values[0, scored].detach()
    assert torch.equal(out.detach(), expected)
    assert int(scored.sum()) == int(rows[3].sum())  # one score per real completion token
    weights = torch.randn(2, 5, dtype=torch.float64)
    (out * weights).sum().backward()
    expected_grad = torch.zeros_like(values[0])
    expected_grad[scored] = weights.view(-1)[packed.completion_index[scored]]
    assert torch.equal(values.grad[0], expected_grad)
    assert completion_values(None, packed) is None


def test_pack_rows_rejects_bad_rows():
    prompt_ids, prompt_mask, completion_ids, completion_mask = random_rows([3, 2], [2, 4])
    holed = completion_mask.clone()
    holed[1, 1] = 0
    with pytest.raises(ValueError, match="not contiguous"):
        pack_rows(prompt_ids, prompt_mask, completion_ids, holed)
    empty_prompt = prompt_mask.clone()
    empty_prompt[0] = 0
    with pytest.raises(ValueError, match=r"Rows \[0\] have no prompt token"):
        pack_rows(prompt_ids, empty_prompt, completion_ids, completion_mask)
    with pytest.raises(ValueError, match="same shapes"):
        pack_rows(prompt_ids, prompt_mask[:, 1:], completion_ids, completion_mask)
    with pytest.raises(ValueError, match="completion_loss_mask"):
        pack_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, completion_loss_mask=completion_mask[:1])
    with pytest.raises(ValueError, match="rank must be"):
        pack_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, rank=2, world_size=2)


def fused_policy(family: str, seed: int = 0, sliding_window: int | None = None):
    model = build_tiny_target(
        family,
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        seed=seed,
        dtype=torch.float64,
        sliding_window=sliding_window,
    )
    if family == "gpt_oss":
        model.set_experts_implementation("eager")  # torch's grouped matmul takes no float64
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model.train()


def trl_log_probs(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """What TRL's `_get_per_token_logps_and_entropies` computes, with the rows' real-token positions passed
    explicitly: RoPE is relative, but transformers builds its cos/sin tables in float32, so TRL's own left-pad
    offsets shift the result by ~1e-6 even in float64."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, : -completion_ids.shape[1]] = IGNORE_INDEX
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),
        labels=labels,
        fused_lm_head=True,
    )
    width = completion_ids.shape[1]
    return out.log_probs[:, -width:], out.entropy[:, -width:]


@pytest.mark.parametrize(
    "family, window",
    # Windows of 3 and 4 in documents of up to 13 tokens: Mistral's every layer, Qwen3's and gpt-oss's (with its
    # sinks) every other one.
    [("llama", None), ("qwen2", None), ("qwen3", None), ("mistral", 3), ("qwen3", 3), ("gpt_oss", 4)],
)
def test_one_device_packed_log_probs_and_gradients_match_trls_fused_head(family, window):
    model = fused_policy(family, sliding_window=window)
    implementation = model.config._attn_implementation
    rows = random_rows([7, 2, 5], [6, 1, 4], seed=3)
    weights = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def loss_of(logps, entropies):  # nonlinear in both, like the GRPO loss
        return (weights[0] * logps.exp()).sum() + (weights[1] * entropies).sum()

    ref_logps, ref_entropies = trl_log_probs(model, *rows)
    loss_of(ref_logps, ref_entropies).backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    with zigzag_ring_attention(model):
        assert model.config._attn_implementation == ZIGZAG_RING_ATTENTION
        logps, entropies = policy_log_probs(model, pack_rows(*rows))
        loss_of(logps, entropies).backward()
    assert model.config._attn_implementation == implementation
    torch.testing.assert_close(logps, ref_logps, rtol=0, atol=1e-10)
    torch.testing.assert_close(entropies, ref_entropies, rtol=0, atol=1e-10)
    assert (ref_logps.detach() != 0).sum() == rows[3].sum()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, ref_grads[name], rtol=1e-9, atol=1e-10, msg=name)


def test_attention_adapter_needs_documents_and_rejects_unsupported_options():
    model = fused_policy("qwen3")
    rows = pack_rows(*random_rows([3, 2], [2, 2]))
    with zigzag_ring_attention(model), pytest.raises(ValueError, match="needs the packed documents"):
        model(input_ids=rows.input_ids, position_ids=rows.position_ids)
    assert model.config._attn_implementation == "sdpa"  # restored after the error
    q = k = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="no logit soft-cap; this layer asks for softcap=30.0"):
        zigzag_ring_attention_forward(None, q, k, k, None, cu_seqlens=torch.tensor([0, 4]), softcap=30.0)
    model.config.attention_dropout = 0.1
    model.model.layers[0].self_attn.attention_dropout = 0.1
    with zigzag_ring_attention(model), pytest.raises(ValueError, match="dropout=0.1"):
        policy_log_probs(model, rows)


def test_trainer_needs_a_world_size_divisible_by_the_context_parallel_size(tmp_path, tiny_policy_dir):
    from datasets import Dataset

    config = SpecCoTrainConfig(
        **tiny_grpo_kwargs(tmp_path / "out", per_device_train_batch_size=2, num_generations=2, context_parallel_size=2)
    )
    with pytest.raises(ValueError, match=r"must divide the world size \(1 processes\)"):
        SpecCoTrainGRPOTrainer(
            model=str(tiny_policy_dir),
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=config,
            train_dataset=Dataset.from_dict({"prompt": ["abc", "defg"]}),
            processing_class=build_char_tokenizer(),
        )
