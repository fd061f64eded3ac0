"""``hf-spec-cotrain vllm-serve`` and its client: rollouts, weight updates as transactions, and their failures.

One server for the whole module, started as a subprocess through the real console command on 127.0.0.1 (tiny
Llama target, reduced-vocabulary draft "a", an API key from the environment, small staging limits) and always
stopped at the end; one test restarts it. Every test that changes the server's weights puts the originals back, and
every refused update is followed by a check that the server still produces exactly the rollouts (tokens and
speculative counters) it produced when it started.
"""

import hashlib
import http.client
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch
from safetensors.torch import save as save_safetensors
from tiny_policy import save_tiny_policy_of_type
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_server_utils import (
    API_KEY,
    MAX_CHUNKS,
    MAX_STAGED_BYTES,
    TRANSACTION_TIMEOUT,
    ServerProcess,
    free_port,
)
from vllm_test_utils import hf_greedy, tiny_prompts

from hf_spec_cotrain.cli import VLLMServeScriptArguments, main, vllm_serve_engine_kwargs
from hf_spec_cotrain.generation.client import BadRolloutRequestError, VLLMServerClient, VLLMServerError, iter_chunks
from hf_spec_cotrain.generation.engine import EngineUnavailableError, RolloutOutput
from hf_spec_cotrain.generation.protocol import API_KEY_ENV, SHA256_HEADER
from hf_spec_cotrain.generation.speculative import speculative_generate
from hf_spec_cotrain.testing import build_pass_through_draft


# The rollout every check compares: a short prompt and one longer than a KV block (a prefix-cache hit), kept light
# because the module runs one on a loaded 2-core machine after every update.
ROLLOUT_TOKENS = 16


def _perturbed(state_dict: dict[str, torch.Tensor], *, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * tensor.std() * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        if tensor.is_floating_point()
        else tensor
        for name, tensor in state_dict.items()
    }


# ------------------------------------------------------------------------------------------- no server


def test_iter_chunks_groups_by_bytes_and_copies_shared_storage():
    embed = torch.randn(10, 4)
    tensors = [("a", torch.randn(3, 4)), ("b", torch.randn(5, 4).T), ("embed", embed), ("tied", embed)]
    tensors.append(("big", torch.randn(40)))
    chunks = list(iter_chunks(tensors, chunk_bytes=40 * 4, device=torch.device("cpu")))
    # 48 + 80 bytes fit in 160; the 160-byte embedding and its tied copy do not share a chunk with them.
    assert [[name for name, _ in chunk] for chunk in chunks] == [["a", "b"], ["embed"], ["tied"], ["big"]]
    for (name, tensor), (_, original) in zip([item for chunk in chunks for item in chunk], tensors):
        assert tensor.is_contiguous() and torch.equal(tensor, original), name
    together = list(iter_chunks(tensors[2:4], chunk_bytes=10**6, device=torch.device("cpu")))
    assert len(together) == 1
    (_, first), (_, second) = together[0]
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    save_safetensors(dict(together[0]))  # refuses tensors that share memory


def test_serve_refuses_an_open_api_beyond_loopback(monkeypatch):
    """Without a key, only a loopback bind or an explicit `allow_unauthenticated` gets as far as building the
    engine."""
    server_module = pytest.importorskip("hf_spec_cotrain.generation.server", reason="needs fastapi (vLLM extra)")

    class EngineReached(Exception):
        pass

    def reached(*args, **kwargs):
        raise EngineReached

    monkeypatch.setattr(server_module, "RolloutServer", reached)
    for host in ("0.0.0.0", "10.1.2.3", "::", "trainer.example.org"):
        with pytest.raises(ValueError, match=rf"--host {host} listens beyond this machine.*{API_KEY_ENV}"):
            server_module.serve(engine_kwargs={}, host=host)
    for kwargs in ({"host": "127.0.0.2"}, {"host": "::1"}, {"host": "0.0.0.0", "api_key": "k"}):
        with pytest.raises(EngineReached):
            server_module.serve(engine_kwargs={}, **kwargs)
    with pytest.raises(EngineReached):
        server_module.serve(engine_kwargs={}, host="0.0.0.0", allow_unauthenticated=True)
    # the console command reads the key from the environment
    monkeypatch.setenv(API_KEY_ENV, "from-the-environment")
    with pytest.raises(EngineReached):
        main(["vllm-serve", "--model", "unused", "--host", "0.0.0.0"])
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(ValueError, match="listens beyond this machine"):
        main(["vllm-serve", "--model", "unused", "--host", "0.0.0.0"])


def test_vllm_serve_options_become_engine_arguments():
    args = VLLMServeScriptArguments(model="policy", draft="draft", dtype="bfloat16", llm_kwargs='{"block_size": 32}')
    kwargs = vllm_serve_engine_kwargs(args)
    assert kwargs["model"] == "policy" and kwargs["draft_model"] == "draft"
    assert kwargs["dtype"] == "bfloat16" and kwargs["block_size"] == 32 and "max_model_len" not in kwargs
    for llm_kwargs, message in [
        ("{block_size: 32}", "not valid JSON"),
        ("[32]", "must be a JSON object"),
        ('{"dtype": "float16"}', "sets dtype, which this command sets itself"),
        ('{"speculative_config": {}}', "sets speculative_config"),
    ]:
        with pytest.raises(ValueError, match=message):
            vllm_serve_engine_kwargs(VLLMServeScriptArguments(model="p", dtype="float32", llm_kwargs=llm_kwargs))


def test_client_names_the_server_it_cannot_reach():
    port = free_port()
    client = VLLMServerClient(f"http://127.0.0.1:{port}", connect_timeout=1.0, reconnect_timeout=1.0)
    with pytest.raises(TimeoutError, match=rf"http://127.0.0.1:{port} was not ready within 0.5 s"):
        client.wait_until_ready(timeout=0.5, poll_interval=0.1)
    # Retried with backoff within the budget, then a clear error.
    with pytest.raises(
        EngineUnavailableError,
        match=rf"GET /weights/version: the rollout server at http://127.0.0.1:{port} could not be reached in \d+ "
        r"attempts over 1 s \(last: ConnectionError",
    ):
        client.weights_version()
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        client.sync_weights("policy", [("x", torch.ones(1))], chunk_bytes=0)
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        client.init_nccl(device="cpu")


# ------------------------------------------------------------------------------------------- the server


@dataclass
class ServerHandle:
    process: ServerProcess
    target_dir: Path
    drafts: dict[str, dict[str, torch.Tensor]]
    prompts: list[list[int]]
    fresh_greedy: RolloutOutput = field(init=False)

    def __post_init__(self):
        self.client = self.process.new_client()
        self.fresh_greedy = self.greedy()

    def restart(self) -> None:
        """Stop the server and start it again on the same port; `client` then talks to the new instance."""
        self.process.stop()
        self.process.start()
        self.client = self.process.new_client()

    def greedy(self) -> RolloutOutput:
        return self.client.generate(self.prompts, max_tokens=ROLLOUT_TOKENS, temperature=0.0, ignore_eos=True)

    def hf_target(self):
        return AutoModelForCausalLM.from_pretrained(self.target_dir)

    def assert_unchanged(self, versions) -> None:
        """Same weights versions, no transaction left open, and exactly the rollouts of a fresh server."""
        assert self.client.weights_version() == versions
        assert self.client._request("GET", "/weights/transactions")["transactions"] == []
        again = self.greedy()
        assert again.completion_ids == self.fresh_greedy.completion_ids
        assert again.spec_decode == self.fresh_greedy.spec_decode


@contextmanager
def _serving(model_dir: Path, log_dir: Path) -> Iterator[VLLMServerClient]:
    """A server without a draft or key for one test; stopped at the end."""
    process = ServerProcess(model_dir, log_dir)
    try:
        process.start()
        yield process.new_client()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def server(vllm_engine_pool, tiny_llama_dir, tiny_llama_drafts, tmp_path_factory) -> Iterator[ServerHandle]:
    vllm_engine_pool.close()  # one vLLM engine at a time: the pool's in-process engine goes first
    log_dir = tmp_path_factory.mktemp("vllm-serve")
    process = ServerProcess(
        tiny_llama_dir, log_dir, draft_dir=tiny_llama_drafts.folders["reduced", "a"], api_key=API_KEY
    )
    try:
        process.start()
        drafts = {name: tiny_llama_drafts.state_dicts["reduced", name] for name in ("a", "b")}
        prompts = tiny_prompts(tiny_llama_dir)
        yield ServerHandle(
            process=process, target_dir=tiny_llama_dir, drafts=drafts, prompts=[prompts[0], prompts[-1]]
        )
    finally:
        process.stop()


@pytest.mark.vllm
def test_health_and_versions(server):
    health = server.client.health()
    assert health["status"] == "ok" and health["has_draft"] is True
    versions = server.client.weights_version()
    assert health["versions"] == {"policy": versions.policy, "draft": versions.draft}
    assert server.fresh_greedy.versions == versions


@pytest.mark.vllm
def test_speculative_greedy_equalshf_greedy(server):
    fresh = server.fresh_greedy
    assert fresh.completion_ids == hf_greedy(server.hf_target(), server.prompts, ROLLOUT_TOKENS)
    stats = fresh.spec_decode
    assert stats.num_drafts > 0 and stats.num_draft_tokens == 3 * stats.num_drafts
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens and len(stats.accepted_per_position) == 3
    assert stats.acceptance_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
    # The counters are those of one call: the same rollout again drafts and accepts the same tokens.
    again = server.greedy()
    assert again.completion_ids == fresh.completion_ids and again.spec_decode == fresh.spec_decode


@pytest.mark.vllm
def test_sampling_n_and_logprobs(server):
    prompts = server.prompts
    out = server.client.generate(prompts, max_tokens=8, temperature=1.0, n=2, seed=3, logprobs=True, ignore_eos=True)
    assert len(out.completion_ids) == 4 and all(len(ids) == 8 for ids in out.completion_ids)
    model = server.hf_target()
    for index, (completion, logprobs) in enumerate(zip(out.completion_ids, out.logprobs)):
        prompt = prompts[index // 2]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
        reference = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), reference, atol=1e-4, rtol=0)


def _poisoned(handle: "ServerHandle", fault: str) -> tuple[str, dict[str, torch.Tensor]]:
    """A bad update with right names and shapes (they pass the checks made on arrival)."""
    target = "policy" if fault.startswith("policy") else "draft"
    source = handle.hf_target().state_dict() if target == "policy" else handle.drafts["b"]
    weights = {name: tensor.clone() for name, tensor in source.items()}
    if fault == "policy_nan":
        weights["model.layers.5.mlp.down_proj.weight"][3, 7] = float("nan")
    elif fault == "policy_float16":
        weights = {name: tensor.half() for name, tensor in weights.items()}
    elif fault == "draft_nan":
        weights["midlayer.mlp.down_proj.weight"][3, 7] = float("nan")
    elif fault == "draft_int32":
        weights = {
            name: tensor if name in ("d2t", "t2d") else tensor.to(torch.int32) for name, tensor in weights.items()
        }
    elif fault == "draft_d2t":
        weights["d2t"][-1] = 10**6  # the right length, one id far outside the target vocabulary
    elif fault == "draft_missing":
        del weights["fc.weight"]
    return target, weights


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("policy_nan", r"`model.layers.5.mlp.down_proj.weight` holds 1 non-finite values"),
        ("policy_float16", r"`model.norm.weight` is torch.float16, the engine holds it in torch.float32"),
        ("draft_nan", r"`midlayer.mlp.down_proj.weight` holds 1 non-finite values"),
        ("draft_int32", r"`fc.weight` is torch.int32, the engine holds it in torch.float32"),
        ("draft_d2t", r"`d2t` maps 1 draft ids outside the target vocabulary \[0, \d+\) \(e.g. to 1000\d+\)"),
        ("draft_missing", r"missing: fc.weight"),
    ],
)
def test_unusable_updates_are_refused_and_the_previous_weights_serve(server, fault, message):
    """Each bad update is refused at commit with a 4xx naming the tensor; the server stays healthy and serves exactly
    the weights it served before (the policy decides the tokens, the draft the counters)."""
    client = server.client
    versions = client.weights_version()
    target, weights = _poisoned(server, fault)
    with pytest.raises(VLLMServerError, match=message) as error:
        client.sync_weights(target, weights.items())
    assert error.value.status_code == 400
    assert client.health()["status"] == "ok"
    server.assert_unchanged(versions)


@pytest.mark.vllm
def test_policy_update_in_chunks_changes_greedy_like_hf(server):
    client = server.client
    model = server.hf_target()
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    perturbed = _perturbed(original, seed=11)
    model.load_state_dict(perturbed)
    perturbed_greedy = hf_greedy(model, server.prompts, ROLLOUT_TOKENS)
    assert perturbed_greedy != server.fresh_greedy.completion_ids
    before = client.weights_version()
    try:
        update = client.sync_weights("policy", perturbed.items(), chunk_bytes=200_000)
        assert update.num_chunks > 3 and update.num_tensors == len(perturbed)
        assert update.version == before.policy + 1 == client.weights_version().policy
        out = server.greedy()
        assert out.completion_ids == perturbed_greedy
        assert out.versions.policy == update.version
    finally:
        restored = client.sync_weights("policy", original.items(), version=before.policy)
    assert restored.num_chunks == 1
    server.assert_unchanged(before)


@pytest.mark.vllm
def test_draft_update_changes_counters_and_pushing_back_restores_them(server):
    client = server.client
    before = client.weights_version()
    try:
        update = client.sync_weights("draft", server.drafts["b"].items(), chunk_bytes=100_000)
        assert update.num_chunks > 1 and update.version == before.draft + 1
        with_b = server.greedy()
        # Speculation is lossless, and draft B accepts differently from A: the comparison below has teeth.
        assert with_b.completion_ids == server.fresh_greedy.completion_ids
        assert with_b.spec_decode != server.fresh_greedy.spec_decode
        assert with_b.versions.draft == update.version
    finally:
        client.sync_weights("draft", server.drafts["a"].items(), version=before.draft)
    # Draft A pushed over B accepts exactly as the server that loaded A from its folder.
    server.assert_unchanged(before)


@pytest.mark.vllm
def test_updates_with_wrong_names_or_shapes_are_refused(server):
    client = server.client
    versions = client.weights_version()
    policy = server.hf_target().state_dict()
    wrong_shape = {**policy, "model.layers.2.self_attn.k_proj.weight": torch.randn(32, 128)}
    with pytest.raises(
        VLLMServerError, match=r"k_proj.weight has shape \[32, 128\], vLLM expects \[64, 128\]"
    ) as error:
        client.sync_weights("policy", wrong_shape.items(), chunk_bytes=100_000)
    assert error.value.status_code == 400 and "/chunks/" in str(error.value)  # refused on arrival, not at commit
    missing = {name: tensor for name, tensor in policy.items() if name != "model.layers.4.mlp.up_proj.weight"}
    with pytest.raises(VLLMServerError, match=r"HTTP 400: .*missing: model.layers.4.mlp.up_proj.weight"):
        client.sync_weights("policy", missing.items())
    unknown = [*server.drafts["b"].items(), ("embed_tokens.weight", policy["model.embed_tokens.weight"])]
    with pytest.raises(VLLMServerError, match=r"HTTP 400: .*no draft parameter in vLLM for: embed_tokens.weight"):
        client.sync_weights("draft", unknown)
    with pytest.raises(VLLMServerError, match=r"HTTP 422: Invalid request: body.target"):
        client._request("POST", "/weights/transactions", json={"target": "lm_head"})
    # the same checks without sending data (what a trainer asks when it starts)
    client.check_weights("policy", [(name, tensor.shape) for name, tensor in policy.items()])
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \[32, 128\], vLLM expects \[64, 128\]"):
        client.check_weights("policy", [(name, tensor.shape) for name, tensor in wrong_shape.items()])
    with pytest.raises(ValueError, match=r"missing: model.layers.4.mlp.up_proj.weight"):
        client.check_weights("policy", [(name, tensor.shape) for name, tensor in missing.items()])
    server.assert_unchanged(versions)


@pytest.mark.vllm
def test_truncated_corrupt_and_incomplete_uploads_are_refused(server):
    client = server.client
    versions = client.weights_version()
    draft = server.drafts["b"]
    data = save_safetensors(dict(draft))
    transaction = client._request("POST", "/weights/transactions", json={"target": "draft"})["transaction_id"]
    chunk_url = f"{client.base_url}/weights/transactions/{transaction}/chunks"

    def put(index: int, body: bytes, **headers) -> requests.Response:
        return client.session.put(f"{chunk_url}/{index}", data=body, headers=headers, timeout=30)

    truncated = put(0, data[:-7], **{SHA256_HEADER: hashlib.sha256(data).hexdigest()})
    assert truncated.status_code == 400 and "SHA-256" in truncated.json()["error"]
    unchecked = put(0, data[:-7])
    assert unchecked.status_code == 400 and "is not a valid safetensors file" in unchecked.json()["error"]
    assert put(0, b"").status_code == 400
    # Half of the tensors in chunk 0, the rest in chunk 2: chunk 1 never arrives.
    names = sorted(draft)
    assert put(0, save_safetensors({name: draft[name] for name in names[:3]})).ok
    assert put(2, save_safetensors({name: draft[name] for name in names[3:]})).ok
    repeated = put(1, save_safetensors({names[0]: draft[names[0]]}))
    assert repeated.status_code == 400 and f"{names[0]} (chunk 0)" in repeated.json()["error"]
    with pytest.raises(VLLMServerError, match=r"HTTP 400: Transaction .* is incomplete: chunks \[1\] never arrived"):
        client._request("POST", f"/weights/transactions/{transaction}/commit", json={"num_chunks": 3})
    # The refused commit discarded the transaction.
    assert put(1, save_safetensors({names[0]: draft[names[0]]})).status_code == 404
    server.assert_unchanged(versions)


@pytest.mark.vllm
def test_abandoned_transaction_is_discarded(server):
    client = server.client
    versions = client.weights_version()
    transaction = client._request("POST", "/weights/transactions", json={"target": "policy"})["transaction_id"]
    embed = server.hf_target().state_dict()["model.embed_tokens.weight"]
    client._request(
        "PUT",
        f"/weights/transactions/{transaction}/chunks/0",
        data=save_safetensors({"model.embed_tokens.weight": embed}),
    )
    listed = client._request("GET", "/weights/transactions")["transactions"]
    assert [(entry["transaction_id"], entry["chunks"]) for entry in listed] == [(transaction, [0])]
    time.sleep(TRANSACTION_TIMEOUT + 1.0)
    with pytest.raises(VLLMServerError, match=r"HTTP 404: Transaction .* expired after 5 s"):
        client._request("POST", f"/weights/transactions/{transaction}/commit", json={"num_chunks": 1})
    server.assert_unchanged(versions)


@pytest.mark.vllm
def test_update_interrupted_on_the_trainer_side_is_aborted(server):
    client = server.client
    versions = client.weights_version()

    def tensors_then_crash():
        yield from list(server.drafts["b"].items())[:4]
        raise RuntimeError("trainer crashed while producing the draft weights")

    with pytest.raises(RuntimeError, match="trainer crashed"):
        client.sync_weights("draft", tensors_then_crash(), chunk_bytes=1)
    server.assert_unchanged(versions)


@pytest.mark.vllm
def test_bad_generate_requests_are_refused_clearly(server):
    client = server.client
    with pytest.raises(VLLMServerError, match=r"HTTP 400: Bad generate request: prompt_token_ids is empty"):
        client.generate([], max_tokens=4)
    with pytest.raises(VLLMServerError, match=r"HTTP 422: Invalid request: body.max_tokens"):
        client.generate(server.prompts[:1], max_tokens=0)
    with pytest.raises(VLLMServerError, match=r"HTTP 400: Bad generate request: .*no_such_option"):
        client.generate(server.prompts[:1], max_tokens=4, no_such_option=1)
    vocab_size = server.hf_target().config.vocab_size
    for ids, shown in (
        ([1, vocab_size], f"{vocab_size} \\(prompt 1, position 1"),
        ([-1], "-1"),
        ([5, 10**6], "1000000"),
    ):
        with pytest.raises(
            VLLMServerError,
            match=rf"HTTP 400: .*1 ids outside the policy's vocabulary \[0, {vocab_size}\), e.g. {shown}",
        ):
            client.generate([server.prompts[0], ids], max_tokens=4)
    assert client.health()["status"] == "ok"
    server.assert_unchanged(client.weights_version())


@pytest.mark.vllm
def test_requests_vllm_refuses_are_400s_naming_the_field(server):
    """A sampling value or a prompt that vLLM refuses is the caller's mistake: 400 naming the field and the value,
    checked before the request waits for the engine's thread (a 3,000,000-token prompt by its length alone), or
    mapped from vLLM's own error where only the engine finds it. The client raises `BadRolloutRequestError`, a
    ValueError, and the server logs no traceback."""
    client = server.client
    log_before = server.process.log_path.read_text()
    prompt = server.prompts[0]
    max_model_len = 256  # `ServerProcess`'s
    bad_requests = [
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_k": -2}, r"top_k must be 0 \(disable\), or at least 1, got -2"),
        ({"n": 2, "temperature": 0.0}, r"n must be 1 when using greedy sampling, got 2"),
        ({"min_tokens": 5}, r"min_tokens must be less than or equal to max_tokens=4, got 5"),
        ({"prompts": [prompt, []]}, r"prompt_token_ids\[1\] is empty: every prompt needs at least one token"),
        (
            {"prompts": [prompt, [1] * max_model_len]},
            rf"prompt_token_ids\[1\] holds {max_model_len} tokens, and this server's max_model_len={max_model_len} "
            rf"holds prompt and completion together \(at most {max_model_len - 1} prompt tokens\). Shorten the prompt, "
            "or start the server with a larger --max_model_len",
        ),
        ({"prompts": [[1] * 3_000_000]}, r"prompt_token_ids\[0\] holds 3000000 tokens"),
        # found by vLLM inside the engine's thread only
        ({"thinking_token_budget": 5}, r"vLLM refused the request: thinking_token_budget is set"),
    ]
    for fields, message in bad_requests:
        prompts = fields.pop("prompts", [prompt])
        with pytest.raises(BadRolloutRequestError, match=rf"HTTP 400: Bad generate request: {message}") as error:
            client.generate(prompts, max_tokens=4, **fields)
        assert error.value.status_code == 400 and isinstance(error.value, ValueError)
        assert "The request was bad, not the server" in str(error.value)
    with pytest.raises(BadRolloutRequestError, match=r"HTTP 422: Invalid request: body.max_tokens"):
        client.generate([prompt], max_tokens=0)
    log = server.process.log_path.read_text()[len(log_before) :]
    assert "Traceback" not in log, log
    assert client.health()["status"] == "ok"
    server.assert_unchanged(client.weights_version())


def _answer_to_headers(base_url: str, method: str, path: str, content_length: int, headers: dict) -> tuple[int, dict]:
    """Send a request's headers, declaring a body of `content_length` bytes, and no body: a server that read the
    body before answering would wait instead (and the socket time out)."""
    connection = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=60)
    try:
        connection.putrequest(method, path)
        for name, value in {**headers, "Content-Length": str(content_length)}.items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.vllm
def test_every_endpoint_but_health_needs_the_api_key(server):
    """No key, a wrong one or another scheme: 401 with `WWW-Authenticate: Bearer`, before the body is read, and the
    request does nothing. The key never reaches the server's log."""
    client = server.client
    versions = client.weights_version()
    url = client.base_url
    transaction = client._request("POST", "/weights/transactions", json={"target": "draft"})["transaction_id"]
    chunk = save_safetensors(dict(server.drafts["b"]))
    calls = [
        ("GET", "/weights/version", {}),
        ("GET", "/weights/transactions", {}),
        ("POST", "/weights/transactions", {"json": {"target": "policy"}}),
        ("POST", "/weights/check", {"json": {"target": "policy", "names": [], "shapes": []}}),
        ("POST", "/generate", {"json": {"prompt_token_ids": server.prompts, "max_tokens": 4}}),
        ("PUT", f"/weights/transactions/{transaction}/chunks/0", {"data": chunk}),
        ("POST", f"/weights/transactions/{transaction}/commit", {"json": {"num_chunks": 1}}),
        ("DELETE", f"/weights/transactions/{transaction}", {}),
        ("GET", "/docs", {}),
    ]
    try:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {API_KEY}"}):
            for method, path, kwargs in calls:
                answer = requests.request(method, url + path, headers=headers, timeout=60, **kwargs)
                assert answer.status_code == 401, (method, path, headers)
                assert answer.headers["WWW-Authenticate"] == "Bearer"
                assert "needs its API key: send `Authorization: Bearer <key>`" in answer.json()["error"]
        status, answer = _answer_to_headers(url, "PUT", f"/weights/transactions/{transaction}/chunks/0", 10**12, {})
        assert status == 401
        assert requests.get(url + "/health", timeout=60).json()["status"] == "ok"
        listed = client._request("GET", "/weights/transactions")["transactions"]
        assert [(entry["transaction_id"], entry["chunks"]) for entry in listed] == [(transaction, [])]
    finally:
        client._request("DELETE", f"/weights/transactions/{transaction}")
    assert API_KEY not in server.process.log_path.read_text()
    server.assert_unchanged(versions)


@pytest.mark.vllm
def test_staging_is_bounded_before_any_body_is_read(server):
    """Past the open-transaction, staged-bytes or chunk limits the server answers 429 or 413 from the declared sizes
    (the bodies are never sent here), and a huge `num_chunks` gets a short 413 at once."""
    client = server.client
    versions = client.weights_version()
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def begin() -> str:
        return client._request("POST", "/weights/transactions", json={"target": "policy"})["transaction_id"]

    first, second = begin(), begin()
    try:
        with pytest.raises(VLLMServerError, match=r"HTTP 429: 2 weight updates are open"):
            begin()
        status, answer = _answer_to_headers(
            client.base_url, "PUT", f"/weights/transactions/{first}/chunks/0", MAX_STAGED_BYTES + 1, auth
        )
        assert status == 413 and f"over this server's max_staged_bytes={MAX_STAGED_BYTES}" in answer["error"]
        embed = server.hf_target().state_dict()["model.embed_tokens.weight"]
        staged = save_safetensors({"model.embed_tokens.weight": embed})
        client._request("PUT", f"/weights/transactions/{first}/chunks/0", data=staged)
        status, answer = _answer_to_headers(
            client.base_url,
            "PUT",
            f"/weights/transactions/{second}/chunks/0",
            MAX_STAGED_BYTES - len(staged) + 1,
            auth,
        )
        assert status == 429 and f"other open transactions hold {len(staged)} " in answer["error"]
        status, answer = _answer_to_headers(
            client.base_url, "PUT", f"/weights/transactions/{first}/chunks/{MAX_CHUNKS}", 100, auth
        )
        assert status == 413 and f"max_chunks={MAX_CHUNKS}" in answer["error"]
        commit = client.session.post(
            f"{client.base_url}/weights/transactions/{first}/commit", json={"num_chunks": 10**7}, timeout=60
        )
        assert commit.status_code == 413 and len(commit.content) < 500
        listed = {
            entry["transaction_id"]: entry for entry in client._request("GET", "/weights/transactions")["transactions"]
        }
        assert listed[first]["bytes"] == len(staged) and listed[second]["bytes"] == 0
    finally:
        for transaction in (first, second):
            client._request("DELETE", f"/weights/transactions/{transaction}")
    server.assert_unchanged(versions)


@pytest.mark.vllm
def test_generation_during_commits_sees_the_old_or_the_new_policy_never_a_mix(server):
    """Two clients generate greedily without pause while the policy is committed four times, alternating two
    weight sets whose greedy completions differ for every prompt: each answer is exactly the completion of the
    weights of the version it reports (a prefix cache left from the other weights, or a half-applied update, would
    give another). Each commit waits until an answer reports it, so both sets are served."""
    client = server.client
    before = client.weights_version()
    model = server.hf_target()
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    perturbed = _perturbed(original, seed=11)
    model.load_state_dict(perturbed)
    completions = {
        "original": server.fresh_greedy.completion_ids,
        "perturbed": hf_greedy(model, server.prompts, ROLLOUT_TOKENS),
    }
    assert all(old != new for old, new in zip(completions["original"], completions["perturbed"]))
    weights = {"original": original, "perturbed": perturbed}
    schedule = [(before.policy + 1, "perturbed"), (before.policy + 2, "original"), (before.policy + 3, "perturbed")]
    schedule.append((before.policy, "original"))  # back to where the module's other tests expect the server
    weights_of_version = {before.policy: "original", **dict(schedule[:-1])}
    answers: list[tuple[int, list[list[int]]]] = []
    errors: list[BaseException] = []
    seen = threading.Condition()
    done = threading.Event()

    def generate_until_done() -> None:
        generator = server.process.new_client()
        try:
            while not done.is_set():
                out = generator.generate(server.prompts, max_tokens=ROLLOUT_TOKENS, temperature=0.0, ignore_eos=True)
                with seen:
                    answers.append((out.versions.policy, out.completion_ids))
                    seen.notify_all()
        except BaseException as error:
            errors.append(error)
            with seen:
                seen.notify_all()
        finally:
            generator.close()

    threads = [threading.Thread(target=generate_until_done) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for version, name in schedule:
            client.sync_weights("policy", weights[name].items(), version=version, chunk_bytes=200_000)
            with seen:
                start = len(answers)

                def served(version=version, start=start) -> bool:
                    return bool(errors) or any(served == version for served, _ in answers[start:])

                # Bounded only so that a broken server fails the test instead of hanging it.
                assert seen.wait_for(served, timeout=300)
            assert not errors, errors
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert not errors, errors
    assert {version for version, _ in answers} == set(weights_of_version)
    for version, completion_ids in answers:
        assert completion_ids == completions[weights_of_version[version]], version
    server.assert_unchanged(before)


@pytest.mark.vllm
def test_trainer_rolls_out_through_the_server_and_pushes_each_step(server, tiny_llama_drafts, tmp_path):

    before = server.client.weights_version()
    trainer = _server_trainer(server, tiny_llama_drafts.folders["reduced", "a"], tmp_path, max_steps=2)
    try:
        trainer.train()
        after = server.client.weights_version()
        assert after.policy == before.policy + 2 and after.draft == before.draft + 2  # one push per step
        logs = [entry for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
        assert len(logs) == 2 and not any("spec/fallback" in entry for entry in trainer.state.log_history)
        # The server holds what the trainer pushed for the last step's rollouts: push the current weights and
        # read them back through vLLM's kernels.
        trainer.rollouts.backend.sync()
        held = server.client.weights_version()
        assert held.policy == after.policy + 1
    finally:
        # Put the module's server back on its original weights for the other tests.
        server.client.sync_weights(
            "policy", AutoModelForCausalLM.from_pretrained(server.target_dir).state_dict().items()
        )
        server.client.sync_weights("draft", server.drafts["a"].items())


@pytest.mark.vllm
def test_a_dflash_trainer_pushes_its_draft_through_the_server_every_step(vllm_engine_pool, tiny_llama_dir, tmp_path):
    """A server of its own speculating with a DFlash draft: a `drafter="dflash"` run pushes its co-trained draft
    every step, each push read back through vLLM's kernels, and every step's rollouts speculate."""
    from hf_spec_cotrain.draft import DFlashDraftModel

    vllm_engine_pool.close()
    mask_token_id = AutoTokenizer.from_pretrained(tiny_llama_dir).unk_token_id
    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    draft_dir = tmp_path / "dflash"
    DFlashDraftModel.from_target(target, mask_token_id=mask_token_id, num_layers=1, block_size=4).save_pretrained(
        draft_dir
    )
    process = ServerProcess(tiny_llama_dir, tmp_path, draft_dir=draft_dir, api_key=API_KEY)
    try:
        process.start()
        handle = SimpleNamespace(client=process.new_client(), target_dir=tiny_llama_dir)
        before = handle.client.weights_version()
        trainer = _server_trainer(
            handle,
            draft_dir,
            tmp_path,
            max_steps=2,
            drafter="dflash",
            dflash_block_size=4,
            dflash_mask_token_id=mask_token_id,
            num_speculative_tokens=3,
        )
        trainer.train()
        after = handle.client.weights_version()
        assert after.draft == before.draft + 2  # one push per step, each verified by the server at commit
        logs = [entry for entry in trainer.state.log_history if "spec/acceptance_length" in entry]
        assert len(logs) == 2 and not any("spec/fallback" in entry for entry in trainer.state.log_history)
    finally:
        process.stop()


@pytest.mark.vllm
def test_a_transformers_backend_policy_is_served_by_a_server_of_its_own(vllm_engine_pool, tmp_path):
    """Olmo2, which vLLM runs through its Transformers backend (refused colocated: the backend rewrites the policy's
    transformers classes in the engine's process), is served by a server, whose process holds no policy of the
    trainer's: greedy rollouts are the policy's own and vLLM accepts what the HF-native generator accepts with the same
    EAGLE-3 draft (its default taps), before and after a policy update."""
    vllm_engine_pool.close()
    policy_dir = save_tiny_policy_of_type(tmp_path / "olmo2", "olmo2")
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    draft = build_pass_through_draft(policy, seed=1, noise=0.05, num_layers=1)
    draft.save_pretrained(tmp_path / "draft")
    prompts = tiny_prompts(policy_dir)
    prompts = [prompts[0], prompts[-1]]
    process = ServerProcess(policy_dir, tmp_path, draft_dir=tmp_path / "draft", api_key=API_KEY)

    def assert_served_as_hf(client: VLLMServerClient) -> None:
        served = client.generate(prompts, max_tokens=ROLLOUT_TOKENS, temperature=0.0, ignore_eos=True)
        assert served.completion_ids == hf_greedy(policy, prompts, ROLLOUT_TOKENS)
        drafts = accepted = 0
        for ids in prompts:
            out = speculative_generate(
                policy,
                draft,
                torch.tensor([ids]),
                max_new_tokens=ROLLOUT_TOKENS,
                num_speculative_tokens=3,
                eos_token_id=[],
                pad_token_id=policy.config.pad_token_id,
            )
            drafts, accepted = drafts + out.num_drafts, accepted + out.num_accepted_tokens
        assert (served.spec_decode.num_drafts, served.spec_decode.num_accepted_tokens) == (drafts, accepted)
        assert accepted > 0

    try:
        process.start()
        client = process.new_client()
        assert_served_as_hf(client)
        updated = _perturbed(policy.state_dict(), seed=5)
        client.sync_weights("policy", updated.items())
        policy.load_state_dict(updated)
        assert_served_as_hf(client)
    finally:
        process.stop()


@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_policy_updates_are_checked_rolled_back_and_followed(family, vllm_engine_pool, tiny_target_dir, tmp_path):
    """A Qwen3-MoE or gpt-oss server of its own (no draft): a poisoned expert is refused at commit, after the rollback
    point was read through the CPU kernel's expert packing, and the rollouts stay exactly the same; a good update in
    chunks then makes greedy rollouts follow the updated policy."""
    vllm_engine_pool.close()
    folder = tiny_target_dir(family)
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompts = tiny_prompts(folder)
    prompts = [prompts[0], prompts[-1]]
    perturbed = _perturbed(model.state_dict(), seed=11)
    poisoned = {name: tensor.clone() for name, tensor in perturbed.items()}
    poisoned["model.layers.1.mlp.experts.gate_up_proj"][2, 5, 7] = float("nan")
    with _serving(folder, tmp_path) as client:

        def greedy() -> list[list[int]]:
            return client.generate(prompts, max_tokens=ROLLOUT_TOKENS, temperature=0.0, ignore_eos=True).completion_ids

        fresh = greedy()
        assert fresh == hf_greedy(model, prompts, ROLLOUT_TOKENS)
        with pytest.raises(
            VLLMServerError, match=r"HTTP 400: .*`model.layers.1.mlp.experts.gate_up_proj` holds 1 non"
        ):
            client.sync_weights("policy", poisoned.items())
        assert greedy() == fresh
        update = client.sync_weights("policy", perturbed.items(), chunk_bytes=200_000)
        assert update.num_chunks > 3
        model.load_state_dict(perturbed)
        assert greedy() == hf_greedy(model, prompts, ROLLOUT_TOKENS) != fresh


@pytest.mark.vllm
def test_trainer_survives_a_server_restart_and_stops_clearly_once_it_is_gone(server, tiny_llama_drafts, tmp_path):
    """The server restarts between a step's push and its rollouts: the trainer pushes policy and draft again and the
    rollouts come from them (not from the weights the server started with), without falling back. Then the server
    is gone: after bounded retries the run stops with an error that says how to resume, and the checkpoints are
    complete. The API key and the Hub token appear in no file the run wrote."""

    from hf_spec_cotrain.generation.client import WeightsVersion

    hub_token = "hf_test_token_c81f2e"
    trainer = _server_trainer(
        server,
        tiny_llama_drafts.folders["reduced", "a"],
        tmp_path,
        save_strategy="steps",
        save_steps=1,
        vllm_server_timeout=3.0,
        hub_token=hub_token,
    )
    client = trainer.rollout_engine
    real_generate = client.generate
    served: list[tuple[int, WeightsVersion]] = []
    restarts: list[int] = []
    dead_url = f"http://127.0.0.1:{free_port()}"

    def generate(*args, **kwargs):
        step = trainer.state.global_step
        if step == 1 and not restarts:
            restarts.append(step)
            server.restart()
        elif step == 2:
            client.base_url = dead_url
        out = real_generate(*args, **kwargs)
        served.append((step, out.versions))
        return out

    client.generate = generate
    try:
        with pytest.raises(
            EngineUnavailableError,
            match=rf"could not be reached in \d+ attempts over 3 s .* Training stopped at step 2; the checkpoints "
            rf"in {tmp_path} are as saved\. Once the server is back, resume with resume_from_checkpoint=True",
        ):
            trainer.train()
        # Step 1's rollouts came from the weights pushed again into the restarted server (its versions start at 0).
        assert [step for step, _ in served] == [0, 1]
        assert served[1][1] == WeightsVersion(policy=1, draft=1)
        assert not any("spec/fallback" in entry for entry in trainer.state.log_history)
        checkpoint = tmp_path / "checkpoint-2"
        assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
        for name in ("model.safetensors", "optimizer.pt", "draft/model.safetensors", "draft_training_state.pt"):
            assert (checkpoint / name).is_file(), name
        written = [path for path in tmp_path.rglob("*") if path.is_file()]
        assert any(path.name == "training_args.bin" for path in written)
        for path in written:
            data = path.read_bytes()
            assert API_KEY.encode() not in data and hub_token.encode() not in data, path
    finally:
        server.client.sync_weights("policy", server.hf_target().state_dict().items(), version=0)
        server.client.sync_weights("draft", server.drafts["a"].items(), version=0)


def _server_trainer(server, draft_dir, tmp_path, **overrides):
    """A short GRPO run (3 steps, 8-token completions) whose rollouts go through the module's server."""
    from datasets import Dataset
    from tiny_policy import tiny_grpo_kwargs

    from hf_spec_cotrain import SpecCoTrainConfig, SpecCoTrainGRPOTrainer

    config = SpecCoTrainConfig(
        **tiny_grpo_kwargs(tmp_path)
        | {
            "max_completion_length": 8,
            "seed": 1,
            "draft_warmup_steps": 0,
            "use_vllm": True,
            "vllm_mode": "server",
            "vllm_server_base_url": server.client.base_url,
            "vllm_server_api_key": API_KEY,
            "draft_model_name_or_path": str(draft_dir),
        }
        | overrides
    )
    return SpecCoTrainGRPOTrainer(
        model=str(server.target_dir),
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["def f(x):", "The quick", "import", "x = "]}),
        processing_class=AutoTokenizer.from_pretrained(server.target_dir),
    )
