"""The methods. Importing this package registers every method by name."""

from .base import REGISTRY, Attribution, Explainer, get_method, normalize_maps, register
from .cam import CAM, EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, XGradCAM
from .perturbation import AblationCAM, ScoreCAM

__all__ = [
    "CAM",
    "REGISTRY",
    "AblationCAM",
    "Attribution",
    "EigenCAM",
    "Explainer",
    "GradCAM",
    "GradCAMPlusPlus",
    "HiResCAM",
    "LayerCAM",
    "ScoreCAM",
    "XGradCAM",
    "get_method",
    "normalize_maps",
    "register",
]
