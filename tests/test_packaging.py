"""What ships: pyproject.toml lists every package folder (setuptools' `packages` is explicit, so a new folder that is
not listed would be left out of the wheel), the top-level model_cards/ folder ships as `hf_spec_cotrain.model_cards`
with its templates, and no file of the project cites a document that lives outside the repository."""

import fnmatch
import re
from importlib import resources
from pathlib import Path

import pytest

from hf_spec_cotrain import hub


tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_spec_cotrain"


@pytest.fixture(scope="module")
def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def test_every_package_folder_is_listed(setuptools_config):
    folders = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    listed = set(setuptools_config["packages"])
    assert "hf_spec_cotrain" in folders and "hf_spec_cotrain.parallel" in folders  # the walk found the packages
    missing = sorted(folders - listed)
    assert not missing, f"package folders missing from [tool.setuptools] packages in pyproject.toml: {missing}"
    # and every listed package is a folder with an __init__.py, where package-dir puts it
    package_dir = setuptools_config.get("package-dir", {})
    for name in listed:
        folder = ROOT / package_dir.get(name, name.replace(".", "/"))
        assert (folder / "__init__.py").is_file(), f"{name} is listed but {folder}/__init__.py does not exist"


def test_model_cards_ship_inside_the_package(setuptools_config):
    assert setuptools_config["package-dir"]["hf_spec_cotrain.model_cards"] == "model_cards"
    assert "hf_spec_cotrain.model_cards" in setuptools_config["packages"]
    assert (ROOT / "model_cards" / "__init__.py").is_file()
    assert not (PACKAGE / "model_cards").exists()  # one home for the templates

    patterns = setuptools_config["package-data"]["hf_spec_cotrain.model_cards"]
    templates = sorted(path.name for path in (ROOT / "model_cards").iterdir() if path.suffix == ".md")
    assert hub.CARD_TEMPLATE in templates
    not_shipped = [name for name in templates if not any(fnmatch.fnmatch(name, pattern) for pattern in patterns)]
    assert not not_shipped, f"templates not in [tool.setuptools.package-data]: {not_shipped}"
    # the installed package finds the template the draft card is rendered from
    assert resources.files("hf_spec_cotrain.model_cards").joinpath(hub.CARD_TEMPLATE).is_file()

    assert "py.typed" in setuptools_config["package-data"]["hf_spec_cotrain"]
    assert (PACKAGE / "py.typed").is_file()


# Documents that are not part of the repository: the design notes now live in docs/design.md.
OUTSIDE_DOCUMENTS = re.compile(r"DESIGN\.md|\.\./shared")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".ipynb", ".txt", ".toml", ".yaml", ".yml", ".json", ".cfg", ".csv"}


def _project_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("hf_spec_cotrain", "model_cards", "tests", "scripts", "examples", "docs", ".ci"):
        files += [
            path
            for path in (ROOT / folder).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and (path.suffix in TEXT_SUFFIXES or not path.suffix)
        ]
    return files


def test_no_file_cites_a_document_outside_the_repository():
    files = _project_files()
    assert ROOT / "hf_spec_cotrain" / "trainer.py" in files and ROOT / "docs" / "design.md" in files
    citations = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE_DOCUMENTS.search(line)
    ]
    assert not citations, "citations of documents outside the repository:\n" + "\n".join(citations)
