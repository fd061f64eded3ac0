"""The main job's probe of drift: how the co-trained draft and a frozen copy of its warm start keep up with a moving
policy, measured apart from the GRPO steps (same prompts, same sampling seed, timed separately)."""

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers import TrainerCallback
from trl.trainer.utils import pad

from ..draft import DraftModel
from ..generation.speculative import speculative_generate


if TYPE_CHECKING:
    from ..trainer import SpecCoTrainGRPOTrainer


class DriftProbe(TrainerCallback):
    """Every ``interval`` steps: acceptance of the co-trained and of the frozen warm-start draft on the same prompts
    and seed, KL of the policy from its initial self on those rollouts, and how varied the rollouts are. With a
    ``reward_func``, the same prompts are also sampled without speculation and both sets of completions rewarded:
    at one policy, speculative and plain sampling must give the same reward law (``rollout_rewards``). Its own time
    is kept in ``seconds``, so that the GRPO steps can be timed without it; each probe's line goes to ``log``."""

    def __init__(
        self,
        trainer: "SpecCoTrainGRPOTrainer",
        prompts: list[str],
        num_speculative_tokens: int,
        interval: int,
        reward_func=None,
        log: Callable[[str], None] = print,
    ):
        self.trainer = trainer
        self.interval = interval
        self.reward_func = reward_func
        self.log = log
        self.rollout_rewards: list[tuple[list[float], list[float]]] = []  # (speculative, plain) per probe
        self.seconds = 0.0
        self.frozen_draft = _copy_draft(trainer.draft, trainer.accelerator.unwrap_model(trainer.model))
        self.initial_policy = _copy_policy(trainer)
        tokenizer = trainer.processing_class
        ids = [torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        self.input_ids = pad(ids, padding_value=tokenizer.pad_token_id, padding_side="left")
        self.attention_mask = pad([torch.ones_like(t) for t in ids], padding_value=0, padding_side="left")
        self.k = num_speculative_tokens
        self.rows: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self._probe(0)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.interval == 0 or state.global_step == state.max_steps:
            self._probe(state.global_step)

    def _probe(self, step: int) -> None:
        started = time.perf_counter()
        if self.trainer.accelerator.is_main_process:
            self._measure(step)
        self.seconds += time.perf_counter() - started

    @torch.no_grad()
    def _measure(self, step: int) -> None:
        policy = self.trainer.accelerator.unwrap_model(self.trainer.model)
        device = next(policy.parameters()).device
        args = self.trainer.args
        row = {"step": step}
        for name, draft in (("cotrained", self.trainer.draft), ("frozen", self.frozen_draft)):
            out = speculative_generate(
                policy,
                draft,
                self.input_ids.to(device),
                self.attention_mask.to(device),
                max_new_tokens=args.max_completion_length,
                num_speculative_tokens=self.k,
                do_sample=True,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k or 0,
                draft_sampling=args.draft_sampling,
                generator=torch.Generator(device).manual_seed(1000 + step),
            )
            row[f"acceptance_{name}"] = out.acceptance_length
            if name == "cotrained":
                sequences = out.sequences
        row.update(self._drift(policy, sequences))
        if self.reward_func is not None:
            self.rollout_rewards.append((self._rewards(sequences), self._rewards(self._plain_sample(policy, step))))
        self.rows.append(row)
        self.log(
            f"probe at step {step}: acceptance co-trained {row['acceptance_cotrained']:.2f} / frozen "
            f"{row['acceptance_frozen']:.2f}, KL from initial {row['kl_from_initial']:.3f}"
        )

    def _plain_sample(self, policy, step: int) -> torch.Tensor:
        args, device = self.trainer.args, next(policy.parameters()).device
        tokenizer = self.trainer.processing_class
        torch.manual_seed(2000 + step)
        was_training = policy.training
        policy.eval()
        sequences = policy.generate(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            do_sample=True,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            max_new_tokens=args.max_completion_length,
            pad_token_id=tokenizer.pad_token_id,
        )
        policy.train(was_training)
        return sequences

    def _rewards(self, sequences: torch.Tensor) -> list[float]:
        tokenizer = self.trainer.processing_class
        texts = tokenizer.batch_decode(sequences[:, self.input_ids.shape[1] :], skip_special_tokens=True)
        return [float(r) for r in self.reward_func(completions=texts)]

    def _drift(self, policy, sequences: torch.Tensor) -> dict:
        prompt_length = self.input_ids.shape[1]
        tokenizer = self.trainer.processing_class
        completion = sequences[:, prompt_length:]
        real = completion != tokenizer.pad_token_id
        mask = torch.cat([self.attention_mask.to(sequences.device), real.long()], 1)
        was_training = policy.training
        policy.eval()
        logits_now = policy(input_ids=sequences, attention_mask=mask).logits[:, prompt_length - 1 : -1]
        logits_then = self.initial_policy(input_ids=sequences, attention_mask=mask).logits[:, prompt_length - 1 : -1]
        policy.train(was_training)
        log_now, log_then = logits_now.float().log_softmax(-1), logits_then.float().log_softmax(-1)
        kl = (log_now.exp() * (log_now - log_then)).sum(-1)
        texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
        grams = [text[i : i + 4] for text in texts for i in range(len(text) - 3)]
        return {
            "kl_from_initial": float(kl[real].mean()),
            "distinct_4grams": len(set(grams)) / max(len(grams), 1),
        }


def _copy_draft(draft: DraftModel, policy) -> DraftModel:
    """A frozen copy bound to the live policy: it reads the policy's current embedding (and head, where the family
    shares it), as vLLM shares them."""
    frozen = type(draft)(draft.config).to(draft.device)
    frozen.load_state_dict(draft.state_dict())
    return frozen.bind_target(policy).eval().requires_grad_(False)


def _copy_policy(trainer):
    policy = trainer.accelerator.unwrap_model(trainer.model)
    initial = type(policy)(policy.config).to(next(policy.parameters()).device)
    initial.load_state_dict(policy.state_dict())
    return initial.eval().requires_grad_(False)
