"""Shared by the pipeline tests and their torchrun script: tiny policies, drafts, GRPO batches, and the
single-process co-training step every pipelined step must reproduce."""

import torch

from hf_spec_cotrain import Eagle3DraftModel
from hf_spec_cotrain.draft import DFlashDraftModel, DraftTrainingBatch, count_tokens
from hf_spec_cotrain.losses import grpo_loss, grpo_per_token_logps
from hf_spec_cotrain.taps import TapRecorder
from hf_spec_cotrain.testing import build_tiny_target
from hf_spec_cotrain.training.pipeline_step import GRPOBatch


POLICY_KWARGS = dict(
    num_layers=8, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=96
)
# gpt-oss's window is shorter than the batches' rows, so its sliding layers' masks differ from the full ones.
FAMILY_KWARGS = {"gpt_oss": dict(sliding_window=4)}
MOE_FAMILIES = ("qwen3_moe", "gpt_oss")
AUX_LAYER_IDS = (2, 4, 5)
# DFlash's target layers 1, 3, 5 are taps 2, 4, 6: on stages 0 and 1 of 2, 1, 2 and 3 of 4. Its mask token is one of
# the batches' tokens; the first stage holds its embedding row.
DFLASH_TARGET_LAYER_IDS = (1, 3, 5)
DFLASH_MASK_TOKEN_ID = 7
DRAFT_SEED = 11  # the draft objective's random stream (DFlash's anchors)
DRAFT_VOCAB_SIZE = 40
TEMPERATURE = 0.9
BETA = 0.5


def build_policy(family: str = "llama", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The same policy on every process (seeded), in training mode."""
    policy = build_tiny_target(family, **POLICY_KWARGS, **FAMILY_KWARGS.get(family, {}), seed=0, dtype=dtype)
    if family in MOE_FAMILIES and dtype == torch.float64:
        policy.set_experts_implementation("eager")  # torch's grouped matmul takes no float64
    return policy.train()


def build_reference(family: str = "llama", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A reference policy near `build_policy`'s (its weights moved by seeded noise, the same on every process), so
    that the KL term and its gradient are not zero."""
    reference = build_policy(family, dtype)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, dtype=dtype))
    return reference.eval()


def build_draft(policy: torch.nn.Module, drafter: str = "eagle3") -> Eagle3DraftModel | DFlashDraftModel:
    """The same draft on every process, in the policy's dtype: EAGLE-3 with a reduced vocabulary (the teacher reads
    lm_head rows), or DFlash with the whole one (it reads the policy's lm_head, on the last stage)."""
    vocab_size = policy.config.vocab_size
    counts = count_tokens(
        [torch.randint(0, vocab_size, (2000,), generator=torch.Generator().manual_seed(5))], vocab_size
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if drafter == "dflash":
            draft = DFlashDraftModel.from_target(
                policy, mask_token_id=DFLASH_MASK_TOKEN_ID, target_layer_ids=DFLASH_TARGET_LAYER_IDS, block_size=4
            )
        else:
            draft = Eagle3DraftModel.from_target(
                policy, aux_layer_ids=AUX_LAYER_IDS, draft_vocab_size=DRAFT_VOCAB_SIZE, token_counts=counts
            )
    return draft.to(policy.dtype).train()


def draft_taps(drafter: str) -> tuple[int, ...]:
    """The tap ids of `build_draft`'s draft of family `drafter`."""
    return tuple(i + 1 for i in DFLASH_TARGET_LAYER_IDS) if drafter == "dflash" else AUX_LAYER_IDS


def make_batch(seed: int, *, rows: int = 8, prompt_length: int = 5, completion_length: int = 7, vocab_size: int = 100):
    """Left-padded prompts, right-padded completions of several lengths, old log-probs that clip both ways."""
    generator = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(rows, prompt_length, dtype=torch.long)
    completion_mask = torch.ones(rows, completion_length, dtype=torch.long)
    for row in range(rows):
        prompt_mask[row, : row % 3] = 0
        completion_mask[row, completion_length - row % 4 :] = 0
    return GRPOBatch(
        prompt_ids=torch.randint(4, vocab_size, (rows, prompt_length), generator=generator),
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(4, vocab_size, (rows, completion_length), generator=generator),
        completion_mask=completion_mask,
        advantages=torch.randn(rows, generator=generator),
        old_per_token_logps=-6 * torch.rand(rows, completion_length, generator=generator),
    )


def reference_step(policy, draft, batch: GRPOBatch, *, reference=None, generator=None):
    """One process, whole model: the policy's GRPO loss (with a KL term of weight `BETA` to `reference`, when given)
    and the draft's `DraftLossOutput` (its objective's randomness from `generator`), both backpropagated."""
    aux_layer_ids = AUX_LAYER_IDS if draft is None else draft.tap_layer_ids(policy.config.num_hidden_layers)
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    completion_length = batch.completion_ids.shape[1]
    ref_per_token_logps = None
    if reference is not None:
        with torch.no_grad():
            ref_logits = reference(input_ids=input_ids, attention_mask=attention_mask).logits
        ref_logits = ref_logits[:, -completion_length - 1 : -1]
        ref_per_token_logps = grpo_per_token_logps(ref_logits, batch.completion_ids, temperature=TEMPERATURE)
    with TapRecorder(policy, aux_layer_ids, record_embeddings=True, record_final_hidden=True) as recorder:
        with recorder.capture():
            logits = policy(input_ids=input_ids, attention_mask=attention_mask).logits
        taps = recorder.pop()
    loss = grpo_loss(
        logits[:, -completion_length - 1 : -1],
        batch.completion_ids,
        batch.completion_mask,
        batch.advantages,
        batch.old_per_token_logps,
        temperature=TEMPERATURE,
        ref_per_token_logps=ref_per_token_logps,
        beta=0.0 if reference is None else BETA,
    )
    loss.backward()
    if draft is None:
        return loss.detach(), None
    rows = policy.lm_head.weight.detach()[draft.draft_to_target_ids]
    training_batch = DraftTrainingBatch(
        aux_hidden_states=taps.aux_hidden_states,
        input_embeds=taps.embeddings,
        teacher_logits=taps.final_hidden @ rows.T,
        loss_mask=torch.cat([torch.zeros_like(batch.prompt_mask), batch.completion_mask], dim=1).bool(),
        attention_mask=attention_mask.bool(),
    )
    out = draft.training_loss(training_batch, draft.training_options(None), generator=generator)
    out.loss.backward()
    return loss.detach(), out


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
