"""What ships: pyproject.toml lists every package folder (setuptools' `packages` is explicit, so a new folder that is
not listed would be left out of the wheel), the top-level model_cards/ and examples/accelerate_configs/ folders ship
inside the package, every distribution the package imports is declared, the built wheel and sdist hold the license
and what the package needs (and no half of the test suite), and no file of the project cites a document that lives
outside the repository."""

import ast
import fnmatch
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import resources
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from hf_spec_cotrain.draft import DRAFTER_FAMILIES


tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_spec_cotrain"


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def setuptools_config(pyproject) -> dict:
    return pyproject["tool"]["setuptools"]


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
    family_templates = [family.card_template for family in DRAFTER_FAMILIES.values()]
    assert set(family_templates) <= set(templates)
    not_shipped = [name for name in templates if not any(fnmatch.fnmatch(name, pattern) for pattern in patterns)]
    assert not not_shipped, f"templates not in [tool.setuptools.package-data]: {not_shipped}"
    # the installed package finds the template the draft card is rendered from
    assert all(resources.files("hf_spec_cotrain.model_cards").joinpath(name).is_file() for name in family_templates)

    assert "py.typed" in setuptools_config["package-data"]["hf_spec_cotrain"]
    assert (PACKAGE / "py.typed").is_file()


def test_accelerate_configs_ship_inside_the_package(setuptools_config):
    assert setuptools_config["package-dir"]["hf_spec_cotrain.accelerate_configs"] == "examples/accelerate_configs"
    assert "*.yaml" in setuptools_config["package-data"]["hf_spec_cotrain.accelerate_configs"]
    shipped = resources.files("hf_spec_cotrain.accelerate_configs")
    names = sorted(path.name for path in (ROOT / "examples" / "accelerate_configs").glob("*.yaml"))
    assert names and all(shipped.joinpath(name).is_file() for name in names)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Imported modules whose distribution has another name, for those that may not be installed here.
DISTRIBUTION_OF = {"yaml": "pyyaml", "flash_attn": "flash-attn"}


def _imported_top_level_modules() -> set[str]:
    modules = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"hf_spec_cotrain"}


def test_every_imported_distribution_is_declared(pyproject):
    project = pyproject["project"]
    requirements = [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]
    declared = {_normalized(Requirement(r).name) for r in requirements}
    installed = packages_distributions()
    modules = _imported_top_level_modules()
    assert {"torch", "transformers", "trl", "yaml"} <= modules  # the walk sees top-level and deferred imports
    undeclared = []
    for module in sorted(modules):
        candidates = {_normalized(d) for d in installed.get(module, [])} or {DISTRIBUTION_OF.get(module, module)}
        if not {_normalized(c) for c in candidates} & declared:
            undeclared.append(f"{module} (from {sorted(candidates)})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_the_wheel_and_the_sdist_ship_the_license_and_the_package(tmp_path):
    """Built from the files git holds or would hold (not what it ignores), as a release would be."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout: the distributions are built from its tracked files")
    source = tmp_path / "source"
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]  # what a commit would hold
    tracked = subprocess.run(listed, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(tmp_path / "dist")],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    wheel_files = zipfile.ZipFile(wheel).namelist()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in wheel_files)
    for name in ("hf_spec_cotrain/scripts/grpo.py", "hf_spec_cotrain/accelerate_configs/cpu_ddp.yaml"):
        assert name in wheel_files
    for family in DRAFTER_FAMILIES.values():
        assert f"hf_spec_cotrain/model_cards/{family.card_template}" in wheel_files
    assert not [name for name in wheel_files if name.startswith("tests/")]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in wheel_files if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    with tarfile.open(sdist) as archive:
        sdist_files = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
    assert "LICENSE" in sdist_files and "pyproject.toml" in sdist_files and "hf_spec_cotrain/cli.py" in sdist_files
    assert not [name for name in sdist_files if name.startswith("tests/")], "the sdist ships tests without helpers"


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
