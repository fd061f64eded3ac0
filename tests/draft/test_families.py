"""The registry of drafter families: names, checkpoints recognised by family, and drafts of another family refused."""

import json

import pytest

from hf_spec_cotrain.draft import (
    DEFAULT_DRAFTER,
    DRAFTER_FAMILIES,
    Eagle3DraftModel,
    check_draft_family,
    checkpoint_drafter,
    drafter_family,
    load_draft,
)
from hf_spec_cotrain.testing import build_tiny_target


class OtherDraft(Eagle3DraftModel):
    """A second family for the registry's checks (the EAGLE-3 head under another name and architecture)."""

    drafter_name = "other"
    checkpoint_architecture = "OtherDraftModel"


@pytest.fixture
def other_family(monkeypatch):
    monkeypatch.setitem(DRAFTER_FAMILIES, OtherDraft.drafter_name, OtherDraft)
    return OtherDraft


def _draft():
    return Eagle3DraftModel.from_target(build_tiny_target("llama", num_layers=6), aux_layer_ids=(1, 3, 5))


def test_every_family_is_registered_under_its_own_name():
    assert DEFAULT_DRAFTER in DRAFTER_FAMILIES
    for name, family in DRAFTER_FAMILIES.items():
        assert family.drafter_name == name and drafter_family(name) is family


def test_an_unknown_family_is_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match=r"`drafter`='medusa' is not a drafter family: use one of 'eagle3'"):
        drafter_family("medusa")


@pytest.mark.parametrize("format", ["eagle3", "speculators"])
def test_a_saved_draft_is_recognised_by_its_family(tmp_path, format, other_family):
    _draft().save_pretrained(tmp_path, format=format)
    assert checkpoint_drafter(tmp_path) == "eagle3"
    assert isinstance(load_draft(tmp_path, "eagle3"), Eagle3DraftModel)


def test_a_checkpoint_of_another_family_is_refused(tmp_path, other_family):
    draft = _draft()
    OtherDraft(draft.config).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["OtherDraftModel"]
    assert checkpoint_drafter(tmp_path) == "other"
    with pytest.raises(ValueError, match=r"is a 'other' draft, but `drafter`='eagle3': set `drafter`='other'"):
        load_draft(tmp_path, "eagle3")
    assert isinstance(load_draft(tmp_path, "other"), OtherDraft)


def test_a_checkpoint_no_family_names_is_left_to_the_familys_loader(tmp_path):
    _draft().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["SomeToolsEagle3"]}))
    assert checkpoint_drafter(tmp_path) is None
    assert isinstance(load_draft(tmp_path, "eagle3"), Eagle3DraftModel)


def test_a_draft_of_another_family_is_refused(other_family):
    draft = _draft()
    check_draft_family(draft, "eagle3")
    with pytest.raises(ValueError, match=r"is a 'eagle3' draft \(Eagle3DraftModel\), but `drafter`='other'"):
        check_draft_family(draft, "other")
