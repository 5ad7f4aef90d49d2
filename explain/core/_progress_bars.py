"""tqdm's automatic progress bars, imported once without the notebook warning.

``tqdm.auto`` picks its notebook bars inside Jupyter; where ipywidgets is missing it warns "IProgress not found.
Please update jupyter and ipywidgets" on import and falls back to its text bars, which work in a notebook as well.
Every ``import explain`` in a notebook would print that warning, so the package imports ``tqdm.auto`` here first,
with that warning alone silenced; the package's modules then get the same (cached) module.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="IProgress not found")
    from tqdm.auto import tqdm

__all__ = ["tqdm"]
