"""The documentation site (issue 18): it builds with warnings as errors, its gallery is regenerated
from examples/ by the build, every public name has an API entry with its signature and docstring,
and every code block of the guide pages runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_readme import example_namespace, python_blocks

import explain
import explain.metrics

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GUIDE_PAGES = sorted(path for path in DOCS.glob("*.md"))
GUIDE_BLOCKS = [(page, index, block) for page in GUIDE_PAGES for index, block in enumerate(python_blocks(page))]
README_FIGURES = {"compare_methods": "compare.png", "sanity_check": "sanity.png",
                  "vit_and_segmentation": "vit_segmentation.png"}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    folder = tmp_path_factory.mktemp("site")
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "MPLBACKEND": "Agg"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
                           cwd=ROOT, env=environment, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
    assert "WARNING" not in built.stderr, built.stderr[-4000:]
    return folder


def test_the_site_builds_with_every_page_and_the_gallery(site):
    for page in ("index.html", "getting-started/index.html", "methods/index.html", "gallery/index.html",
                 "api/explainers/index.html", "api/metrics/index.html", "search/search_index.json"):
        assert (site / page).is_file(), page
    gallery = (site / "gallery" / "index.html").read_text(encoding="utf-8")
    for script in sorted(path.stem for path in (ROOT / "examples").glob("*.py")):
        assert f'id="{script}"' in gallery and f"examples/{script}.py" in gallery, script
        assert re.search(rf'<img[^>]+src="[^"]*{script}/[^"]+\.png"', gallery), script


@pytest.mark.parametrize("script", sorted(README_FIGURES))
def test_the_readme_figures_are_what_the_examples_draw_today(site, script):
    """The build reran every example: the committed figures in docs/ (shown by the README) must be
    what the code draws now, within font and BLAS differences."""
    drawn = Image.open(site / "gallery" / script / README_FIGURES[script]).convert("RGB")
    regenerated = np.asarray(drawn).astype(float)
    committed = np.asarray(Image.open(DOCS / README_FIGURES[script]).convert("RGB")).astype(float)
    assert regenerated.shape == committed.shape
    for channel in range(3):
        assert abs(regenerated[..., channel].mean() - committed[..., channel].mean()) < 2.0
        assert abs(regenerated[..., channel].std() - committed[..., channel].std()) < 2.0


def api_entries() -> set[str]:
    entries = set()
    for page in (DOCS / "api").glob("*.md"):
        entries.update(re.findall(r"^::: (explain(?:\.metrics)?\.\w+)$", page.read_text(encoding="utf-8"), flags=re.M))
    return entries


def test_every_public_name_has_an_api_entry_and_a_docstring(site):
    public = {f"explain.{name}" for name in explain.__all__} | {
        f"explain.metrics.{name}" for name in explain.metrics.__all__}
    entries = api_entries()
    assert public - entries == set(), "public names missing from docs/api"
    assert entries - public == set(), "API entries for names that are not public"
    for qualified in sorted(public):
        module = explain.metrics if qualified.startswith("explain.metrics.") else explain
        value = getattr(module, qualified.rsplit(".", 1)[1])
        assert value.__doc__ and len(value.__doc__.strip()) > 20, f"{qualified} has no docstring"
    html = (site / "api" / "explainers" / "index.html").read_text(encoding="utf-8")
    assert "IntegratedGradients" in html and "steps" in html and "baseline" in html and "normalize" in html


@pytest.mark.parametrize("page, index, block", GUIDE_BLOCKS,
                         ids=[f"{page.stem}-{index}" for page, index, _ in GUIDE_BLOCKS])
def test_every_code_block_of_the_guide_runs(page, index, block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block, f"{page.name} block {index}", "exec"), example_namespace(tmp_path))
