"""Synthetic data with ground truth, and the small demo model trained on it."""

from .demo import DemoNet, load_demo_model
from .synthetic import CLASS_NAMES, SyntheticData, make_dataset

__all__ = ["CLASS_NAMES", "DemoNet", "SyntheticData", "load_demo_model", "make_dataset"]
