"""Synthetic data with ground truth, and the small demo model trained on it."""

from .demo import DemoNet, load_demo_model
from .demo_vit import DemoViT, load_demo_vit
from .synthetic import CLASS_NAMES, SyntheticData, make_dataset

__all__ = ["CLASS_NAMES", "DemoNet", "DemoViT", "SyntheticData", "load_demo_model", "load_demo_vit", "make_dataset"]
