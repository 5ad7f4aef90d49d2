"""The package's architecture as a specification: the import contracts of pyproject.toml ([tool.importlinter]) hold
on the package, and break when an import that crosses a layer upwards, or closes a circle, is added; the module
paths and names users imported before the subpackages keep working."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import explain
from explain._moved_modules import MOVED_MODULES

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")


def lint(folder: Path, package_folder: Path) -> subprocess.CompletedProcess[str]:
    """import-linter run with the contracts of ``folder``/pyproject.toml on the package found in ``package_folder``
    (first on the path, before the installed one)."""
    return subprocess.run([sys.executable, "-c", LINT], cwd=folder, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(package_folder), "PATH": "/usr/bin:/bin"})


def test_the_package_keeps_its_import_contracts():
    result = lint(ROOT, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package's source (no weights) with the repository's contracts, to add imports to."""
    folder = tmp_path_factory.mktemp("architecture")
    shutil.copytree(ROOT / "explain", folder / "explain",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pt", "report_assets"))
    shutil.copy(ROOT / "pyproject.toml", folder / "pyproject.toml")
    return folder


FORBIDDEN = {
    "a low layer importing a method": (
        "core/capture.py", "from ..methods.base import Explainer", ["Layers", "No import circles"]),
    "the drawing code importing a method": (
        "io/render.py", "from ..methods.maps import normalize_maps", ["Layers", "drawing code never imports a method"]),
    "render importing explanation back (the circle of the first version)": (
        "io/render.py", "if TYPE_CHECKING:\n    from .explanation import Explanation", ["No import circles"]),
    "a circle inside the methods": (
        "methods/maps.py", "from .base import Explainer", ["No import circles"]),
    "a metric imported by a method": (
        "methods/gradients.py", "from ..metrics import sanity", ["Layers", "No import circles"]),
    "the models module imported by the machinery": (
        "core/targets.py", "from .. import models", ["Layers", "No import circles"]),
}


@pytest.mark.parametrize("case", sorted(FORBIDDEN))
def test_an_added_forbidden_import_breaks_the_contracts_and_names_it(case, package_copy):
    module, added, broken = FORBIDDEN[case]
    path = package_copy / "explain" / module
    original = path.read_text()
    try:
        path.write_text(original + "\n" + added + "\n")
        result = lint(package_copy, package_copy)
    finally:
        path.write_text(original)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for contract in broken:
        assert any(contract in line and "BROKEN" in line for line in lines), (contract, result.stdout)
    importer = module.removesuffix(".py").split("/")[-1]
    assert importer in result.stdout  # the report names the module that imports


def test_unchanged_copy_keeps_the_contracts(package_copy):
    """The check above breaks because of the added import, not because of the copy."""
    result = lint(package_copy, package_copy)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("earlier", sorted(MOVED_MODULES))
def test_an_earlier_module_path_imports_the_module_at_its_new_path(earlier):
    assert importlib.import_module(earlier) is importlib.import_module(MOVED_MODULES[earlier])
    assert sys.modules[earlier] is sys.modules[MOVED_MODULES[earlier]]


def test_the_names_and_module_paths_users_import_keep_working():
    from explain.batch import MapReader, read_index, read_maps  # docs/datasets.md before the layout

    from explain.dataset_tools.index import MapReader as IndexMapReader
    from explain.dataset_tools.index import read_index as index_read_index

    assert (MapReader, read_index) == (IndexMapReader, index_read_index) and callable(read_maps)
    for name in explain.__all__:
        assert getattr(explain, name) is not None, name
    # the functions stay the package's attributes where a module of the same name moved
    assert explain.capture is importlib.import_module("explain.core.capture").capture
    assert explain.edit is importlib.import_module("explain.core.edit").edit
    from explain.capture import find_layers
    assert find_layers is explain.find_layers
    metrics, data = importlib.import_module("explain.metrics"), importlib.import_module("explain.data")
    assert callable(metrics.pointing_game) and callable(data.load_demo_model)
    assert sorted(set(explain.__all__)) == sorted(explain.__all__)  # grouped, and each name once
