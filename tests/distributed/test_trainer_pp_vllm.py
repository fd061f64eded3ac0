"""Speculative vLLM rollouts under pipeline parallelism (`vllm_mode="server"`): two GRPO steps on 2 gloo processes
(torchrun, `pp_vllm_script.py`) whose rollouts come from one `hf-spec-cotrain vllm-serve`, into which every stage
pushes its own weights as one transaction per weight set, with an EAGLE-3 or a DFlash draft; step 1's push is refused
on purpose and falls back to rollouts through the stages. The config's refusals of vLLM under pipeline parallelism (colocated, or TRL's own) are
in tests/test_config.py."""

from pathlib import Path

import pytest
import torch
from cotrain_cases import PROMPTS, assert_same_tensors, run_parallel_and_single, snapshot
from pp_cotrain_script import DFLASH
from pp_cotrain_script import run as run_pp_cotrain  # its single process is the reference
from pp_vllm_script import FAILING_STEP, POISONED, SERVER_URL_ENV
from transformers import AutoModelForCausalLM
from vllm_server_utils import API_KEY, ServerProcess
from vllm_test_utils import hf_greedy

from hf_spec_cotrain.draft import DFlashDraftModel
from hf_spec_cotrain.generation.client import WeightsVersion
from hf_spec_cotrain.generation.protocol import API_KEY_ENV
from hf_spec_cotrain.testing import build_char_tokenizer, build_pass_through_draft


pytestmark = [pytest.mark.distributed, pytest.mark.vllm]
SCRIPT = Path(__file__).with_name("pp_vllm_script.py")
READBACK_TOKENS = 12


def server_draft(policy, drafter: str):
    """A draft of the trainer's family and shape, with another draft's weights."""
    if drafter == "eagle3":
        return build_pass_through_draft(policy, seed=3, noise=0.3, num_layers=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return DFlashDraftModel.from_target(
            policy,
            mask_token_id=DFLASH["dflash_mask_token_id"],
            target_layer_ids=DFLASH["dflash_target_layer_ids"],
            block_size=DFLASH["dflash_block_size"],
        )


@pytest.fixture
def server(tiny_policy_dir, tmp_path, vllm_engine_pool, drafter):
    """The package's server on the tiny policy, with a draft of the trainer's family and shape (another draft's
    weights)."""
    vllm_engine_pool.close()  # one vLLM engine at a time
    policy = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
    draft_dir = tmp_path / "server-draft"
    server_draft(policy, drafter).save_pretrained(draft_dir)
    process = ServerProcess(tiny_policy_dir, tmp_path, draft_dir=draft_dir, api_key=API_KEY)
    try:
        process.start()
        yield process
    finally:
        process.stop()


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_pipeline_stages_push_into_the_server_and_roll_out_from_it(tmp_path, tiny_policy_dir, server, drafter):
    """With either family the last stage pushes the draft it trains (DFlash: its block layers; the server's DFlash
    reads the policy's embedding and lm_head that the stages pushed), and the server drafts the rollouts with it."""
    env = {SERVER_URL_ENV: server.base_url, API_KEY_ENV: API_KEY}
    variant = None if drafter == "eagle3" else drafter
    pp, single = run_parallel_and_single(
        SCRIPT, run_pp_cotrain, tiny_policy_dir, tmp_path, "pp", variant=variant, env=env
    )
    start = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).eval()
    full_names = set(start.state_dict())

    # Every stage took part in every push, in the same order, and met the same outcome: step 0's two sets
    # committed, step 1's policy refused as a whole (the draft's push then not begun), the final weights committed.
    expected = [(0, "policy"), (0, "draft"), (FAILING_STEP, "policy"), (2, "policy"), (2, "draft")]
    for record in pp:
        assert [(push["step"], push["which"]) for push in record["pushes"]] == expected
    outcomes = [[(push.get("version"), push.get("error")) for push in record["pushes"]] for record in pp]
    assert outcomes[0] == outcomes[1]
    versions = [version for version, _ in outcomes[0]]
    assert versions == [1, 1, None, 2, 2]
    refused = outcomes[0][2][1]
    assert "VLLMServerError" in refused and "HTTP 400" in refused and POISONED in refused and "non-finite" in refused

    # Each stage pushed its own weights under the full model's names (no rank sent, or held, another's): together
    # exactly the policy; the draft came from the last stage alone. What went out is what the trainer held then.
    for index in (0, 3):
        stage_names = [set(record["pushes"][index]["tensors"]) for record in pp]
        assert not stage_names[0] & stage_names[1] and stage_names[0] | stage_names[1] == full_names
        assert "model.embed_tokens.weight" in stage_names[0] and POISONED in stage_names[1]
    assert not pp[0]["pushes"][1]["tensors"] and pp[1]["pushes"][1]["tensors"]
    for record in pp:
        pushes = record["pushes"]
        assert_same_tensors(
            pushes[0]["tensors"], record["policy_start"], "pushed policy, step 0", relative_to_max=False
        )
        assert_same_tensors(
            pushes[3]["tensors"], record["policy_params"], "pushed final policy", relative_to_max=False
        )
    last = pp[-1]
    for push, params in ((last["pushes"][1], last["draft_start"]), (last["pushes"][4], last["draft_params"])):
        assert_same_tensors({name: push["tensors"][name] for name in params}, params, "draft", relative_to_max=False)

    # Step 0's rollouts are the server's, from the weights pushed at that step; step 1's fell back to rollouts
    # through the stages (no request to the server), logged as a fallback on every rank.
    assert not pp[0]["served"]
    assert [(call["step"], call["versions"]) for call in last["served"]] == [(0, (1, 1))]
    assert last["served"][0]["num_drafts"] > 0  # drafted by the server's draft, the one the last stage pushed
    assert last["generated"][0] == last["served"][0]["completions"]
    assert len(last["generated"]) == 2 and len(last["generated"][1]) == len(last["generated"][0])
    for record in pp:
        first, second = record["step_logs"]
        assert "spec/fallback" not in first and second["spec/fallback"] == 1
        assert first["spec/acceptance_length"] >= 1 and first["time/weight_sync"] > 0

    # Training is that of one process on the same rows (rollouts are replaced by fixed completions), so neither the
    # pushes nor the refused one touched the policy or the draft.
    for record in pp:
        names = set(record["policy_params"])
        params = {name: single["policy_params"][name] for name in names}
        assert_same_tensors(record["policy_params"], params, f"rank {record['rank']} policy", relative_to_max=False)
    assert_same_tensors(last["draft_params"], single["draft_params"], "draft", relative_to_max=False)

    # The server holds the final push: its commit read every tensor back through vLLM's kernels, and its greedy
    # rollouts are those of the final policy (the drafts here accept no token of it, so their counters would not tell
    # one draft from another: what the last stage pushed is checked against its draft above).
    client = server.new_client()
    assert client.weights_version() == WeightsVersion(policy=2, draft=2)
    assert client._request("GET", "/weights/transactions")["transactions"] == []
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / ("pp" if variant is None else f"pp-{variant}") / "final")
    policy.eval()
    assert_same_tensors(snapshot(policy), single["policy_params"], "saved policy", relative_to_max=False)
    tokenizer = build_char_tokenizer()
    prompts = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in PROMPTS]
    served = client.generate(prompts, max_tokens=READBACK_TOKENS, temperature=0.0, ignore_eos=True)
    assert served.completion_ids == hf_greedy(policy, prompts, READBACK_TOKENS)
    assert served.completion_ids != hf_greedy(start, prompts, READBACK_TOKENS)  # the push changed what it serves
