"""The documentation site (issue 18): it builds with warnings as errors, its gallery is regenerated
from examples/ by the build, every public name has an API entry with its signature and docstring,
parameter lists render as lists. The README and the guide pages (issue 26): every Python block runs,
in page order, each page in one session that starts empty (as a reader types them), offline; every
relative link points to a file of the repository, and none to a repository address that does not exist."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_readme import MISSING_REPOSITORY, README, broken_links, links, python_blocks, run_page

import explain
import explain.metrics

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GUIDE_PAGES = sorted(path for path in DOCS.glob("*.md"))
PAGES_WITH_CODE = [page for page in [README, *GUIDE_PAGES] if python_blocks(page)]
GENERATED_PAGES = ("gallery.md",)
"""Pages that the site's build makes (docs/hooks/gallery.py), linked to by the guide pages."""
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
    # nothing else speaks during the build (the API pages' inspection once ran `python -m explain`'s main)
    assert "explain: error" not in built.stdout + built.stderr, built.stderr[-4000:]
    assert "usage: explain" not in built.stdout + built.stderr, built.stderr[-4000:]
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


def docstrings_extension():
    """docs/hooks/docstrings.py, the Griffe extension the API pages are rendered with."""
    spec = importlib.util.spec_from_file_location("docs_hooks_docstrings", DOCS / "hooks" / "docstrings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_name_meaning_lines_of_a_docstring_become_a_markdown_list():
    pytest.importorskip("griffe")
    docstring = ("Integrated Gradients: a summary line with a colon: kept.\n\n"
                 "baseline: \"zeros\" or a tensor\n    broadcastable to the batch.\n"
                 "steps: integration points (≥ 1).\n"
                 "``Explanation.diagnostics``: \"completeness_error\" (N, K),\n\"steps\" the number used.\n\n"
                 "A paragraph after a blank line; KernelPCA: a capitalised word is prose.\n"
                 "Options shared with other methods:\n"
                 "model, layer: the model and its layer.\n\n"
                 "    code: an indented block after a blank line is left alone\n")
    assert docstrings_extension().parameter_lists(docstring) == (
        "Integrated Gradients: a summary line with a colon: kept.\n\n"
        "- ``baseline``: \"zeros\" or a tensor\n    broadcastable to the batch.\n"
        "- ``steps``: integration points (≥ 1).\n"
        "- ``Explanation.diagnostics``: \"completeness_error\" (N, K),\n    \"steps\" the number used.\n\n"
        "A paragraph after a blank line; KernelPCA: a capitalised word is prose.\n"
        "Options shared with other methods:\n\n"
        "- ``model``, ``layer``: the model and its layer.\n\n"
        "    code: an indented block after a blank line is left alone")


def test_parameters_of_the_api_pages_render_as_lists_not_run_together(site):
    """The docstrings write parameters and fields as ``name: meaning`` lines (docstring_style: null): on the
    API pages each is an item of a list, never a line run into a paragraph; an attribute shows the
    docstring written under it, not the one of its value's type (``str(object='') -> str``)."""
    entry = re.compile(r"^\s*(<code>[^<]+</code>|[a-z_][a-z0-9_]*)(, (<code>[^<]+</code>|[a-z_][a-z0-9_]*))*: ")
    for page in ("explainers", "results", "hooks", "metrics"):
        html = (site / "api" / page / "index.html").read_text(encoding="utf-8")
        run_together = [paragraph[:200] for paragraph in re.findall(r"<p>(.*?)</p>", html, flags=re.S)
                        if any(entry.match(line) for line in paragraph.split("\n")[1:])]
        assert run_together == [], page
        for type_docstring in ("str(object=&#39;&#39;) -&gt; str", "str(object='') -&gt; str", "bool(x) -&gt; bool",
                               "int([x]) -&gt; integer", "Built-in immutable sequence"):
            assert type_docstring not in html, (page, type_docstring)
    explainers = (site / "api" / "explainers" / "index.html").read_text(encoding="utf-8")
    assert re.search(r"<li><code>steps</code>: integration points", explainers)
    assert re.search(r"<li><code>per_image</code>: which of those inputs hold one row per image", explainers)
    assert "Registry name, as the command line" in explainers  # Explainer.name's own docstring, from the source


def test_the_api_pages_show_no_object_addresses(site):
    """Per-call state (PerThread descriptors) is private: no ``<... object at 0x...>`` on the API pages."""
    for page in ("explainers", "results", "hooks", "metrics"):
        text = re.sub(r"<[^>]+>", "", (site / "api" / page / "index.html").read_text(encoding="utf-8"))
        assert re.findall(r"\w+ = &lt;[\w.]+ object at 0x[0-9a-f]+&gt;", text) == [], page


def test_links_to_repository_files_outside_docs_reach_a_copy_in_the_site(site):
    """docs/hooks/repository_files.py: ../benchmarks/RESULTS.md works in the repository and in the site."""
    assert "../benchmarks/RESULTS.md" in (DOCS / "methods.md").read_text(encoding="utf-8")
    results = site / "repository" / "benchmarks" / "RESULTS" / "index.html"
    assert results.is_file() and "quality.png" in results.read_text(encoding="utf-8")
    assert (site / "repository" / "benchmarks" / "quality.png").is_file()
    methods = (site / "methods" / "index.html").read_text(encoding="utf-8")
    assert 'href="../repository/benchmarks/RESULTS/"' in methods


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[page.stem for page in PAGES_WITH_CODE])
def test_every_code_block_of_the_page_runs_in_page_order(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(page, monkeypatch)


def test_the_pages_have_code_blocks_to_run():
    """The runner sees every block: each page's ```python fences, as many as the page opens."""
    for page in PAGES_WITH_CODE:
        assert len(python_blocks(page)) == page.read_text(encoding="utf-8").count("```python\n"), page.name
    assert len(PAGES_WITH_CODE) >= 12


@pytest.mark.parametrize("page", [README, *GUIDE_PAGES], ids=[page.stem for page in [README, *GUIDE_PAGES]])
def test_every_relative_link_points_to_a_file_of_the_repository(page):
    assert broken_links(page, generated=GENERATED_PAGES) == []


def test_no_page_links_to_a_repository_address_that_does_not_exist():
    pages = [README, *GUIDE_PAGES, *(DOCS / "api").glob("*.md"), ROOT / "mkdocs.yml"]
    assert [page.name for page in pages if MISSING_REPOSITORY in page.read_text(encoding="utf-8")] == []
    web = [(page.name, target) for page in [README, *GUIDE_PAGES] for target in links(page)
           if "github.com" in target]
    assert web == []
