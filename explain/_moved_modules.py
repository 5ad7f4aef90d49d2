"""The module paths from before the package was laid out in subpackages, kept working.

``explain.batch`` is now ``explain.dataset_tools.batch``, ``explain.capture`` is ``explain.core.capture``, and so
on (``MOVED_MODULES``). Code that imports an earlier path (``from explain.batch import read_index``) gets the same
module object as the new path, so both see the same functions and settings. New code, and type checkers, use the
new paths.
"""

from __future__ import annotations

import importlib
import sys

MOVED_MODULES = {
    **{f"explain.{name}": f"explain.core.{name}" for name in (
        "attention", "caller", "capture", "checks", "edit", "layers", "layouts", "memory_format", "rules", "scope",
        "targets", "units", "windows")},
    **{f"explain.{name}": f"explain.io.{name}" for name in ("blur", "explanation", "figures", "inputs", "render")},
    **{f"explain.{name}": f"explain.dataset_tools.{name}" for name in (
        "batch", "evaluation", "html_report", "labels", "pipeline", "spray", "stored_maps")},
    "explain.debugging": "explain.data.debugging",
}
"""Earlier module path → the module's path now."""


def keep_earlier_module_paths() -> None:
    """Make every earlier module path import the module at its new path (``sys.modules`` entries; the package's
    attribute too, where the package has no attribute of that name already: ``explain.capture`` stays the
    function ``capture``, as before)."""
    package = sys.modules["explain"]
    for earlier, now in MOVED_MODULES.items():
        module = importlib.import_module(now)
        sys.modules.setdefault(earlier, module)
        attribute = earlier.rsplit(".", 1)[1]
        if not hasattr(package, attribute):
            setattr(package, attribute, module)
