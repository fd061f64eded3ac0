"""Whether vLLM can serve a policy with a draft's taps, asked of vLLM's own model registry before an engine starts, so
that what vLLM cannot serve is refused in the package's words rather than by a crash at start or after the first
rollouts.

What the registry's class of the policy's architecture tells:
* whether vLLM has a class of its own for it: an architecture it has none for runs through vLLM's Transformers
  backend (``TransformersForCausalLM`` & co.), which rewrites the policy's transformers classes in place (its
  torch.compile decorator adds a base class to the decoder class and replaces its ``__init__`` and ``__call__``).
  In the trainer's process the trainer's own policy then fails at its next forward; a rollout server runs the engine
  in a process of its own, where nothing else uses those classes.
* whether the class gives the draft its taps: vLLM's model runner asks the target for its intermediate hidden states
  through the ``SupportsEagle3`` interface, for EAGLE-3 and DFlash drafts alike
  (``_setup_eagle3_aux_hidden_state_outputs``), and a class without it fails at start.
* the Transformers backend records tap ``a`` (the input of layer ``a``) as the output of layer ``a - 1``
  (``set_aux_hidden_state_layers``): it has no tap 0, the embeddings.
"""

from collections.abc import Sequence

import torch
from torch import nn
from transformers import AutoConfig

from ..draft import DraftModel, checkpoint_family
from .vllm_engine import import_vllm


__all__ = ["check_colocated_vllm_can_serve", "check_vllm_can_serve", "check_vllm_server_can_serve"]

TRANSFORMERS_BACKEND_MODULE = "vllm.model_executor.models.transformers"
TRANSFORMERS_BACKEND_CAUSAL_LM = "TransformersForCausalLM"


def check_colocated_vllm_can_serve(policy: nn.Module, draft: DraftModel | None) -> None:
    """Refuse a policy (a transformers causal LM) and draft that a vLLM engine in this very process cannot serve: see
    `check_vllm_can_serve`. vLLM reads the architecture from the policy's config, else it is the class's name (which
    ``save_pretrained`` writes there)."""
    text_config = policy.config.get_text_config()
    check_vllm_can_serve(
        text_config.model_type,
        policy.config.architectures or [type(policy).__name__],
        drafter=None if draft is None else draft.drafter_name,
        tap_layer_ids=() if draft is None else draft.tap_layer_ids(text_config.num_hidden_layers),
        colocated=True,
    )


def check_vllm_server_can_serve(model: str, draft_model: str | None, *, trust_remote_code: bool = False) -> None:
    """Refuse a policy checkpoint and draft checkpoint (folders or Hub ids, as ``hf-spec-cotrain vllm-serve`` takes
    them) that the server's engine cannot serve: see `check_vllm_can_serve`. The draft is built from its config on the
    meta device, for its taps: no weight is read."""
    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    text_config = config.get_text_config()
    drafter, tap_layer_ids = None, ()
    if draft_model is not None:
        family = checkpoint_family(draft_model)
        with torch.device("meta"):
            draft = family(family.config_class.from_pretrained(draft_model))
        drafter, tap_layer_ids = draft.drafter_name, draft.tap_layer_ids(text_config.num_hidden_layers)
    check_vllm_can_serve(
        text_config.model_type,
        config.architectures or [],
        drafter=drafter,
        tap_layer_ids=tap_layer_ids,
        colocated=False,
    )


def check_vllm_can_serve(
    family: str,
    architectures: Sequence[str],
    *,
    drafter: str | None,
    tap_layer_ids: Sequence[int] = (),
    colocated: bool,
) -> None:
    """Raise a ValueError naming the policy's family and architecture, the reason, the vLLM version and what works
    instead when vLLM cannot serve this policy with a ``drafter`` draft (None: no draft) reading ``tap_layer_ids``:
    its class lacks the interface that gives the taps, the Transformers backend would run it in the trainer's process
    (``colocated``), or that backend would be asked for tap 0."""
    vllm = import_vllm()
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    # vLLM takes the first of the architectures it registers; with none registered it tries the Transformers backend.
    architecture = next((name for name in architectures if name in ModelRegistry.get_supported_archs()), None)
    policy = f"this {family} policy ({', '.join(architectures) or 'no architecture in its config'})"
    on_vllm = f"on vLLM {vllm.__version__}"
    hf_native = "use_vllm=False (the HF-native generator serves it)"
    try:  # with no class of its own for it, vLLM runs the Transformers backend's causal LM
        model_class = ModelRegistry.models[architecture or TRANSFORMERS_BACKEND_CAUSAL_LM].load_model_cls()
    except Exception as error:  # whatever it is, vLLM's engine would meet it at start
        raise ValueError(
            f"vLLM cannot load its class for {policy} {on_vllm} ({type(error).__name__}: {error}), so no engine "
            f"could start. Instead, {hf_native}."
        ) from error
    # The backend's classes live in its module (a package since vLLM 0.11): no import of its internals needed.
    transformers_backend = model_class.__module__.startswith(TRANSFORMERS_BACKEND_MODULE)
    if architecture is None:
        in_words = "vLLM's Transformers backend, as it has no class of its own for it"
    elif transformers_backend:
        in_words = f"vLLM's Transformers backend ({model_class.__name__})"
    else:
        in_words = f"vLLM's {model_class.__name__}"
    if drafter is not None and not supports_eagle3(model_class):
        raise ValueError(
            f"vLLM cannot serve {policy} with its {drafter} draft {on_vllm}: {in_words} does not implement SupportsEagle3, "
            "the interface through which vLLM reads the target's hidden states that EAGLE-3 and DFlash drafts take, "
            f"so the engine would fail at start. Instead, {hf_native}."
        )
    if drafter is not None and transformers_backend and 0 in tap_layer_ids:
        raise ValueError(
            f"vLLM cannot serve {policy} with this {drafter} draft {on_vllm}: it runs through {in_words}, which records "
            "each tap as the output of the layer before it and so has no tap 0 (the embeddings), one of the draft's "
            f"taps {tuple(tap_layer_ids)}. Instead, give the draft taps from layer 1 on, or {hf_native}."
        )
    if colocated and transformers_backend:
        raise ValueError(
            f"vLLM cannot serve {policy} in the trainer's process {on_vllm}: it would run it through {in_words}, "
            "which rewrites the policy's own transformers classes in this process (its torch.compile decorator), so "
            f"the trainer's policy would fail after the first rollouts. Instead, {hf_native}, or "
            "vllm_mode='server' (`hf-spec-cotrain vllm-serve` runs the engine in a process of its own)."
        )
