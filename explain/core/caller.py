"""Warnings attributed to the caller's line: the line outside this package that called into it.

A fixed ``stacklevel`` points at the right line only from one call path: the same warning raised through
``explain.compare`` (figures.py), ``explain.evaluate`` or a method that wraps another lands on a line of the package.
``warn_at_callers_line`` counts the frames instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from types import FrameType
from typing import Optional

PACKAGE_FOLDER = str(Path(__file__).resolve().parent.parent) + os.sep  # explain/, not explain/core/


def _inside_the_package(filename: str) -> bool:
    return filename.startswith(PACKAGE_FOLDER) or filename == contextlib.__file__


def callers_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the function that calls this one, point at the
    line that called into the package from outside it: one past the outermost frame on the stack whose code is the
    package's (a user's callback or model code running inside a call is passed over, not chosen). 2 (the caller's
    caller) when no frame of the package is found."""
    frame: Optional[FrameType] = sys._getframe(1)  # the function that will call warnings.warn: its stacklevel 1
    level, outermost = 1, 0
    while frame is not None:
        if _inside_the_package(frame.f_code.co_filename):
            outermost = level
        frame, level = frame.f_back, level + 1
    return outermost + 1 if outermost else 2


def warn_at_callers_line(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the line that called into the package (see
    ``callers_stacklevel``)."""
    warnings.warn(message, category, stacklevel=callers_stacklevel())
