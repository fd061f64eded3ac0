"""The colocated engine and the server client both satisfy `RolloutEngine`, so the trainer drives either one."""

import inspect
import json

import pytest

from hf_spec_cotrain.generation import RolloutEngine, SpecDecodeStats, VLLMRolloutEngine, VLLMServerClient


METHODS = sorted(
    name for name, value in vars(RolloutEngine).items() if inspect.isfunction(value) and not name.startswith("_")
)
ATTRIBUTES = sorted(RolloutEngine.__annotations__)


def test_the_protocol_is_what_the_trainer_calls():
    assert METHODS == ["check_weights", "close", "generate", "sync_weights"]
    assert ATTRIBUTES == ["shared_across_processes"]


@pytest.mark.parametrize(("engine_class", "shared"), [(VLLMRolloutEngine, False), (VLLMServerClient, True)])
def test_engine_provides_the_protocol_with_compatible_signatures(engine_class, shared):
    assert engine_class.shared_across_processes is shared
    for name in METHODS:
        wanted = list(inspect.signature(getattr(RolloutEngine, name)).parameters.values())
        given = list(inspect.signature(getattr(engine_class, name)).parameters.values())
        given_by_name = {parameter.name: parameter for parameter in given}
        for parameter in wanted:
            assert parameter.name in given_by_name, f"{engine_class.__name__}.{name} lacks {parameter.name}"
            match = given_by_name[parameter.name]
            assert (match.kind, match.default) == (parameter.kind, parameter.default), f"{name}: {match}"
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        assert [p.name for p in given if p.kind in positional] == [p.name for p in wanted if p.kind in positional]
        extras = [p for p in given if p.name not in {parameter.name for parameter in wanted}]
        assert all(p.default is not inspect.Parameter.empty for p in extras), f"{name}: {extras} need defaults"


def test_client_refuses_an_unknown_weight_set_before_any_request():
    client = VLLMServerClient("http://127.0.0.1:9", connect_timeout=0.1)
    with pytest.raises(ValueError, match=r"which='target' names no weight set: choose 'policy' or 'draft'"):
        client.sync_weights("target", [])


def test_spec_decode_counters_travel_as_json_and_back():
    stats = SpecDecodeStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6, accepted_per_position=[3, 2, 1])
    wire = json.loads(json.dumps(stats.to_json(), allow_nan=False))
    assert wire == {
        "num_drafts": 4,
        "num_draft_tokens": 12,
        "num_accepted_tokens": 6,
        "accepted_per_position": [3, 2, 1],
        "acceptance_length": 2.5,
    }
    assert SpecDecodeStats.from_json(wire) == stats
    # Nothing drafted: the acceptance length is NaN, which JSON cannot carry.
    assert json.loads(json.dumps(SpecDecodeStats().to_json(), allow_nan=False))["acceptance_length"] is None
    assert SpecDecodeStats.from_json(SpecDecodeStats().to_json()) == SpecDecodeStats()
