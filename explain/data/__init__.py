"""Synthetic data with ground truth, and the small demo model trained on it."""

from .demo import DemoNet, load_demo_model
from .demo_detector import load_demo_detector
from .demo_vit import DemoViT, load_demo_vit
from .demo_vit2 import DemoViT2, load_demo_vit2
from .detection_scenes import DETECTION_CLASS_NAMES, make_detection_scenes
from .synthetic import CLASS_NAMES, SyntheticData, make_dataset

__all__ = ["CLASS_NAMES", "DETECTION_CLASS_NAMES", "DemoNet", "DemoViT", "DemoViT2", "SyntheticData",
           "load_demo_detector", "load_demo_model", "load_demo_vit", "load_demo_vit2", "make_dataset",
           "make_detection_scenes"]
