"""The package is typed: mypy finds no error in it, and a user's script made of the README's examples
type-checks in strict mode, its main results typed without ``Any``.

Both runs start ``python -m mypy`` from the repository root with pyproject.toml's settings and mypy's
default cache (``.mypy_cache``, the one a plain ``mypy`` uses), so the second run reuses what the first
one analysed (torch above all) and takes seconds once the cache is warm.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

STRICT = """\
# mypy: disallow-any-generics, disallow-subclassing-any, disallow-untyped-calls, disallow-untyped-defs
# mypy: disallow-incomplete-defs, check-untyped-defs, disallow-untyped-decorators, warn-return-any
# mypy: no-implicit-reexport, strict-equality, extra-checks, warn-unused-ignores
"""
"""``mypy --strict`` for this file only: the per-module flags that --strict turns on (the global ones,
warn_unused_configs and warn_redundant_casts, do not concern one file; pyproject.toml sets the latter).
Given inline, they leave the options of every other module as in the package's run, so its cache is reused."""

PRELUDE = """\
import torch
import torchvision

import explain

# the names the examples use, typed as tests/test_readme.py makes them
model: explain.LoadedModel  # README: model = explain.load_model("demo"), taken by explainers as it is
module: torch.nn.Module
vit: torchvision.models.VisionTransformer
x: torch.Tensor
img: str
dataloader: torch.utils.data.DataLoader[torch.Tensor]
"""

RESULTS = """\
# the main results, as a user's editor sees them
from explain.metrics import deletion, pointing_game
from explain.models import load_model

object_masks: torch.Tensor
explanation = explain.GradCAM(model, "layer4").explain(img)
reveal_type(explanation)
reveal_type(explanation.maps)
reveal_type(explanation.targets)
reveal_type(explanation.scores)
reveal_type(explanation.diagnostics)
reveal_type(explain.IntegratedGradients(model, steps=8).explain(img, target=3))
with explain.capture(module, "layer3", inputs=True, grads=True) as records:
    module(x)[0, 281].backward()
reveal_type(records["layer3"].output)
reveal_type(records["layer3"].args)
with explain.capture_attention(vit, grads=True) as recorded:
    vit(x)
reveal_type(recorded.probabilities)
reveal_type(load_model("demo"))
reveal_type(explain.list_layers(module))
reveal_type(pointing_game(explanation, object_masks))
reveal_type(deletion(module, img, explanation))
reveal_type(explain.figure([explanation]))
reveal_type(explain.compare(model, [img]))
reveal_type(explain.run(explain.GradCAM(model, "layer4"), "images/", out="results/"))
"""

KNOWN_README_ERRORS: set[tuple[str, str]] = set()
"""Errors of the README's own lines, as (line, message): none. (A line reading
``attention.grads[-1].shape`` would need ``assert gradient is not None`` first: ``CapturedAttention.grads``
holds None until a backward pass has run.)"""


def run_mypy(*arguments: str) -> tuple[int, str]:
    result = subprocess.run([sys.executable, "-m", "mypy", *arguments], cwd=ROOT, capture_output=True, text=True,
                            timeout=1200)
    return result.returncode, result.stdout + result.stderr


def readme_script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    examples = "\n".join(f"# README.md, block {index}\n{block}" for index, block in enumerate(blocks))
    return "\n".join([STRICT, PRELUDE, examples, RESULTS])


def test_mypy_finds_no_error_in_the_package():
    status, output = run_mypy()
    assert status == 0 and "Success: no issues found" in output, output


def test_readme_examples_type_check_strictly_with_typed_results(tmp_path):
    script = tmp_path / "readme_examples.py"
    script.write_text(readme_script(), encoding="utf-8")
    lines = [line.split("#", 1)[0].strip() for line in script.read_text(encoding="utf-8").splitlines()]  # code
    _, output = run_mypy(str(script))
    # by file name: for a script unchanged since an earlier run, mypy repeats that run's path from its cache
    messages = re.findall(rf"^\S*{script.name}:(\d+): (error|note): (.*)$", output, flags=re.M)
    errors = {(lines[int(line) - 1], re.sub(r"\s+\[[\w-]+\]$", "", text))
              for line, kind, text in messages if kind == "error"}
    assert errors == KNOWN_README_ERRORS, output

    revealed = {lines[int(line) - 1]: text.removeprefix("Revealed type is ").strip('"')
                for line, kind, text in messages if kind == "note" and text.startswith("Revealed type is")}
    assert len(revealed) == RESULTS.count("reveal_type("), output
    assert not [(line, kind) for line, kind in revealed.items() if "Any" in kind], revealed
    assert revealed["reveal_type(explanation)"] == "explain.io.explanation.Explanation"
    assert revealed["reveal_type(explanation.maps)"] == "torch._tensor.Tensor"
    assert revealed['reveal_type(load_model("demo"))'] == "explain.io.loaded_model.LoadedModel"
