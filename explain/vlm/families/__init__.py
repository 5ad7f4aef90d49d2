"""The model families whose image-token layouts explain knows; importing a module registers its layout function.
One line per family (kept apart so that families can be added line by line)."""
# ruff: noqa: F401, I001

from . import llava
from . import llava_next
from . import paligemma
from . import qwen2_vl
from . import idefics3
