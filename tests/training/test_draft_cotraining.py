"""The draft's one TTT micro-step (`DraftCoTrainer.draft_micro_step`) and optimizer builder, called without a trainer:
what the co-trainer, the pipeline's last stage and the warm start all run."""

import pytest
import torch

from hf_spec_cotrain import Eagle3DraftModel, ttt_loss
from hf_spec_cotrain.draft import Eagle3TrainingOptions
from hf_spec_cotrain.taps import Taps
from hf_spec_cotrain.testing import build_tiny_target
from hf_spec_cotrain.training.draft_cotraining import (
    DraftCoTrainer,
    DraftStepSettings,
    RecordedTaps,
    build_draft_optimizer,
)


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(
        "llama", num_layers=4, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, seed=0
    )


def _draft(target) -> Eagle3DraftModel:
    torch.manual_seed(1)
    return Eagle3DraftModel.from_target(target, aux_layer_ids=(0, 1, 2)).train()


def _recorded(draft, *, rows=3, length=9, seed=0) -> tuple[RecordedTaps, torch.Tensor]:
    """Padded rows of taps (the last row shorter), completions counted, and a teacher."""
    generator = torch.Generator().manual_seed(seed)
    config = draft.config
    width = config.target_hidden_size * config.num_aux_hidden_states
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    attention_mask[-1, -3:] = 0
    loss_mask = attention_mask.clone()
    loss_mask[:, :4] = 0  # the prompt
    taps = Taps(
        aux_hidden_states=torch.randn(rows, length, width, generator=generator),
        embeddings=torch.randn(rows, length, config.hidden_size, generator=generator),
    )
    teacher = 3 * torch.randn(rows, length, config.draft_vocab_size, generator=generator)
    return RecordedTaps(taps, attention_mask, loss_mask), teacher


def _grads(draft) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}


def test_micro_step_backpropagates_the_scaled_ttt_loss(target):
    settings = DraftStepSettings(Eagle3TrainingOptions(ttt_steps=3, step_weight_decay=0.7))
    draft = _draft(target)
    recorded, teacher = _recorded(draft)
    out, total_loss = DraftCoTrainer.draft_micro_step(
        draft, recorded, teacher_logits=teacher, settings=settings, loss_scale=0.25
    )
    grads = _grads(draft)
    assert grads and all(grad.abs().sum() > 0 for grad in grads.values())
    assert torch.equal(total_loss, out.loss.detach()) and out.step_losses.shape == (3,)

    draft.zero_grad(set_to_none=True)
    expected = ttt_loss(
        draft,
        aux_hidden_states=recorded.taps.aux_hidden_states,
        input_embeds=recorded.taps.embeddings,
        teacher_logits=teacher,
        loss_mask=recorded.loss_mask.bool(),
        attention_mask=recorded.attention_mask.bool(),
        ttt_steps=3,
        step_weight_decay=0.7,
    )
    (expected.loss * 0.25).backward()
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(grads, _grads(draft))


def test_micro_step_skips_the_backward_of_a_non_finite_loss(target):
    draft = _draft(target)
    recorded, teacher = _recorded(draft)
    teacher[0, 5] = float("nan")  # a counted position
    out, total_loss = DraftCoTrainer.draft_micro_step(
        draft, recorded, teacher_logits=teacher, settings=DraftStepSettings(Eagle3TrainingOptions())
    )
    assert not torch.isfinite(total_loss) and not torch.isfinite(out.loss)
    assert not _grads(draft)


@pytest.mark.parametrize("bf16", [False, True])
def test_micro_step_runs_in_the_precision_its_settings_ask_for(target, bf16):
    """bf16: the draft computes under bf16 autocast, its weights and gradients stay float32; the forward alone
    (`draft_forward`, what evaluation runs) gives the micro-step's loss."""
    draft = _draft(target)
    recorded, teacher = _recorded(draft)
    settings = DraftStepSettings(Eagle3TrainingOptions(ttt_steps=2), bf16=bf16)
    dtypes = set()
    draft.midlayer.mlp.down_proj.register_forward_hook(lambda module, args, output: dtypes.add(output.dtype))
    out, _ = DraftCoTrainer.draft_micro_step(draft, recorded, teacher_logits=teacher, settings=settings)
    assert dtypes == {torch.bfloat16 if bf16 else torch.float32}
    assert {grad.dtype for grad in _grads(draft).values()} == {torch.float32}
    assert {p.dtype for p in draft.parameters()} == {torch.float32}
    with torch.no_grad():
        forward = DraftCoTrainer.draft_forward(draft, recorded, teacher_logits=teacher, settings=settings)
    assert not forward.loss.requires_grad
    torch.testing.assert_close(forward.loss, out.loss.detach())


def test_draft_optimizer_steps_the_trainable_parameters_on_its_schedule(target):
    draft = _draft(target)
    optimizer, scheduler = build_draft_optimizer(
        draft, learning_rate=0.1, weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=2, total_steps=4
    )
    assert isinstance(optimizer, torch.optim.AdamW)
    trainable = {id(p) for p in draft.trainable_parameters()}
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == trainable
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    learning_rates = []
    for _ in range(4):
        learning_rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert learning_rates == pytest.approx([0.0, 0.05, 0.1, 0.05])
