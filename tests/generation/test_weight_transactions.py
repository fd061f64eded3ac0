"""Weight updates as transactions, without a web server: staging, limits and expiry (`WeightTransactions`), the
parsing and checks of a chunk and of a complete set (`parse_chunk`, `value_problems`), and a commit that fails after
the sync, rolled back by the `RolloutServer` on an engine that is just enough for it."""

import hashlib
import time

import pytest
import torch
from safetensors.torch import save as save_safetensors

from hf_spec_cotrain.generation.engine import RolloutOutput, SpecDecodeStats, SyncStats
from hf_spec_cotrain.generation.protocol import ServerError
from hf_spec_cotrain.generation.rollout_server import RolloutServer
from hf_spec_cotrain.generation.weight_transactions import (
    WeightTransactions,
    check_chunk_index,
    parse_chunk,
    value_problems,
)


def test_weight_transactions_stage_replace_and_expire():
    transactions = WeightTransactions(idle_timeout=0.2)
    transaction = transactions.begin("policy", 4)
    transactions.add_chunk(transaction.id, 0, {"x": torch.ones(2)}, 8)
    transactions.add_chunk(transaction.id, 0, {"y": torch.ones(2)}, 8)  # a retry replaces the chunk
    with pytest.raises(ServerError, match=r"Chunk 1 repeats tensors already staged: y \(chunk 0\)"):
        transactions.add_chunk(transaction.id, 1, {"y": torch.zeros(2), "z": torch.zeros(1)}, 12)
    transactions.add_chunk(transaction.id, 2, {"z": torch.zeros(1)}, 4)
    with pytest.raises(ServerError, match=r"chunks \[1\] never arrived") as error:
        transactions.get(transaction.id).merged(3)
    assert error.value.status_code == 400
    assert transactions.describe()[0]["chunks"] == [0, 2]
    time.sleep(0.3)
    assert transactions.describe() == []
    with pytest.raises(ServerError, match="expired after 0.2 s") as error:
        transactions.take(transaction.id, 1)
    assert error.value.status_code == 404
    with pytest.raises(ServerError, match="No open transaction nope"):
        transactions.abort("nope")


def test_weight_transactions_refuse_beyond_their_limits():
    """Open transactions, bytes (declared before a chunk is read) and chunks are bounded: 429 when others hold the
    room, 413 when one transaction alone is too large; nothing is staged by a refused chunk."""
    transactions = WeightTransactions(idle_timeout=60, max_open=2, max_staged_bytes=100, max_chunks=3)
    first, second = transactions.begin("policy", 1), transactions.begin("draft", 1)
    with pytest.raises(ServerError, match=r"2 weight updates are open.*max_open_transactions=2") as error:
        transactions.begin("policy", 2)
    assert error.value.status_code == 429
    with pytest.raises(ServerError, match=r"over this server's max_staged_bytes=100") as error:
        with transactions.reserving(first.id, 0, 101):
            pass
    assert error.value.status_code == 413
    with transactions.reserving(first.id, 0, 60):
        assert transactions.describe()[0]["bytes"] == 60  # counted while the body is being received
        transactions.add_chunk(first.id, 0, {"x": torch.ones(15)}, 60)
    with pytest.raises(ServerError, match=r"other open transactions hold 60") as error:
        with transactions.reserving(second.id, 0, 50):
            pass
    assert error.value.status_code == 429
    with pytest.raises(ServerError, match=r"Chunk index 3 is beyond this server's max_chunks=3") as error:
        with transactions.reserving(first.id, 3, 1):
            pass
    assert error.value.status_code == 413
    with pytest.raises(ServerError, match=r"num_chunks=10000000 is beyond .* stays open") as error:
        transactions.take(first.id, 10**7)
    assert error.value.status_code == 413
    assert [entry["bytes"] for entry in transactions.describe()] == [60, 0]
    with pytest.raises(ServerError, match=r"chunks \[1, 2\] never arrived"):
        transactions.take(first.id, 3).merged(3)
    transactions.begin("policy", 2)  # the taken transaction freed its place


class _EngineThatFailsOnSomeWeights:
    """Just enough engine for `RolloutServer.commit`: one weight `w`, and generation fails while `w` holds 13, as
    vLLM did on weights that passed every check (an out-of-range `d2t`)."""

    has_draft, vocab_size = False, 8

    def __init__(self):
        self.weights = {"w": torch.zeros(2)}

    def check_weights(self, which, named_shapes, *, complete=True):
        pass

    def read_weights(self, which):
        return {name: tensor.clone() for name, tensor in self.weights.items()}

    def sync_weights(self, which, named_tensors):
        self.weights = {name: tensor.clone() for name, tensor in named_tensors}
        return SyncStats(num_tensors=len(self.weights), load_seconds=0.0, verify_seconds=None)

    def generate(self, prompt_token_ids, **kwargs):
        if (self.weights["w"] == 13).any():
            raise IndexError("index 13 is out of bounds")
        return RolloutOutput(completion_ids=[[1]], logprobs=None, spec_decode=SpecDecodeStats())

    def close(self):
        pass


def test_commit_whose_first_generation_fails_is_rolled_back():
    server = RolloutServer(_EngineThatFailsOnSomeWeights, transaction_timeout=60, max_chunk_bytes=2**20)
    try:
        good = server.transactions.begin("policy", 1)
        server.transactions.add_chunk(good.id, 0, {"w": torch.ones(2)}, 8)
        server.commit(server.transactions.take(good.id, 1), 1)
        bad = server.transactions.begin("policy", 2)
        server.transactions.add_chunk(bad.id, 0, {"w": torch.full((2,), 13.0)}, 8)
        with pytest.raises(ServerError, match=r"IndexError: index 13 .* restored the previous policy"):
            server.commit(server.transactions.take(bad.id, 1), 1)
        assert torch.equal(server.engine.weights["w"], torch.ones(2))
        assert server.health()["versions"]["policy"] == 1
    finally:
        server.close()


def test_a_chunk_is_read_as_safetensors_after_its_checksum():
    tensors = {"x": torch.arange(3.0), "y": torch.ones(2, dtype=torch.int64)}
    data = save_safetensors(tensors)
    digest = hashlib.sha256(data).hexdigest()
    for sha256 in (None, digest, f" {digest.upper()} "):
        parsed = parse_chunk(0, data, sha256)
        assert parsed.keys() == tensors.keys() and all(torch.equal(parsed[name], tensors[name]) for name in tensors)
    with pytest.raises(
        ServerError, match=r"Chunk 2: the SHA-256 of the .* differs from the X-Content-SHA256"
    ) as error:
        parse_chunk(2, data[:-7], digest)
    assert error.value.status_code == 400
    with pytest.raises(ServerError, match=r"Chunk 1 is not a valid safetensors file .*Nothing staged") as error:
        parse_chunk(1, data[:-7], None)
    assert error.value.status_code == 400


def test_a_negative_chunk_index_is_refused():
    check_chunk_index(0)
    with pytest.raises(ServerError, match="Chunk index -1 is negative") as error:
        check_chunk_index(-1)
    assert error.value.status_code == 400


def test_values_are_checked_in_the_engines_dtypes():
    engine_dtypes = {"w": torch.bfloat16, "ids": torch.int64}

    def problems(target, **weights):
        return value_problems(target, weights, engine_dtypes=engine_dtypes, vocab_size=8)

    assert problems("policy", w=torch.ones(2, dtype=torch.bfloat16), ids=torch.ones(2, dtype=torch.int64)) == []
    assert problems("policy", w=torch.ones(2)) == []  # float32 master weights, rounded by the engine
    assert problems("policy", w=torch.ones(2, dtype=torch.float16)) == [
        "`w` is torch.float16, the engine holds it in torch.bfloat16"
    ]
    assert problems("policy", ids=torch.ones(2)) == ["`ids` is torch.float32, the engine holds it in torch.int64"]
    assert problems("policy", w=torch.tensor([1.0, float("nan")])) == ["`w` holds 1 non-finite values (of 2)"]
    assert problems("draft", w=torch.ones(2), d2t=torch.tensor([0, 7])) == [
        "`d2t` maps 1 draft ids outside the target vocabulary [0, 8) (e.g. to 8)"
    ]
