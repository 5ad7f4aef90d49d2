"""MkDocs hook: the gallery page, built from ``examples/*.py`` each time the site is built.

Every example script is run (``python examples/NAME.py OUT_DIR``, in a fresh process, as a user
would run it); the page shows each script's docstring, the figures it wrote and its source, so
that no picture on the site is older than the code that makes it. A script that fails stops the
build with its error.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
_outputs = tempfile.TemporaryDirectory(prefix="explain-gallery-")


def run_example(script: Path, out: Path) -> list[Path]:
    """Run one example script writing into ``out``; the PNG files it wrote."""
    out.mkdir(parents=True, exist_ok=True)
    # the checkout's package first, whichever copy the environment has installed
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": python_path}
    finished = subprocess.run([sys.executable, str(script), str(out)], cwd=ROOT, env=environment,
                              capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"examples/{script.name} failed:\n{finished.stderr[-3000:]}")
    return sorted(out.glob("*.png"))


def section(script: Path, figures: list[str]) -> str:
    """The gallery's Markdown for one script: title, docstring, figures, source."""
    source = script.read_text(encoding="utf-8")
    docstring = ast.get_docstring(ast.parse(source)) or script.stem
    title, _, rest = docstring.partition("\n")
    # the docstring's command lines ("python examples/NAME.py [OUT_DIR]") as code, the rest as text
    text = "\n".join(f"```text\n{line.strip()}\n```" if line.strip().startswith("python ") else line
                     for line in rest.strip("\n").splitlines())
    pictures = "\n\n".join(f"![{script.stem}]({figure})" for figure in figures)
    return (f"## {script.stem}\n\n{title}\n\n{text}\n\n{pictures}\n\n"
            f"```python title=\"examples/{script.name}\"\n{source}```\n")


def on_files(files: Files, config) -> Files:  # noqa: ANN001 - MkDocs' hook signature
    parts = ["# Gallery\n\nEach example in `examples/` is run when the site is built; the figures below are "
             "what it wrote then. Run one yourself: `python examples/NAME.py OUT_DIR`.\n"]
    for script in sorted(EXAMPLES.glob("*.py")):
        figures = run_example(script, Path(_outputs.name) / script.stem)
        uris = []
        for figure in figures:
            uri = f"gallery/{script.stem}/{figure.name}"
            files.append(File.generated(config, uri, abs_src_path=str(figure)))
            uris.append(uri)
        parts.append(section(script, uris))
    files.append(File.generated(config, "gallery.md", content="\n".join(parts)))
    return files
