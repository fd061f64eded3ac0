"""What TRL's GRPO step itself needs of a policy, checked when the trainer is built: transformers and TRL raise these
only at the first `train()` step, after the draft and the rollout engine are built, with an error that says nothing
of the setting that works instead."""

from torch import nn


__all__ = ["check_trl_can_train"]


def check_trl_can_train(policy: nn.Module, *, gradient_checkpointing: bool, aux_loss: bool) -> None:
    """Raise a ValueError naming the family, the setting and what works instead for a ``policy`` (the unwrapped
    transformers model) that TRL's step would fail on: gradient checkpointing where the family has none (CTRL, XLNet,
    OpenAI-GPT), or MoE load-balancing (``aux_loss``: TRL's `aux_loss_enabled`) where the config has no
    ``num_experts``, which TRL reads (Granite-MoE and Phi-MoE call it ``num_local_experts``)."""
    text_config = policy.config.get_text_config()
    family = f"this {text_config.model_type} policy ({type(policy).__name__})"
    if gradient_checkpointing and not policy.supports_gradient_checkpointing:
        raise ValueError(
            f"`gradient_checkpointing`=True (GRPOConfig's default) but {family} does not support it. Set "
            "`gradient_checkpointing=False`."
        )
    if aux_loss and not hasattr(text_config, "num_experts"):
        raise ValueError(
            f"TRL adds the router's load-balancing loss for {family} (its config has `output_router_logits` and a "
            "non-zero `router_aux_loss_coef`) and reads the config's `num_experts`, which this family does not "
            "have: TRL's step would raise an AttributeError. Set `router_aux_loss_coef=0.0` in the SpecCoTrainConfig "
            "to train without that loss."
        )
