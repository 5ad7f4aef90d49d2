"""The methods. Importing this package registers every method by name."""

from .base import REGISTRY, Attribution, Explainer, get_method, normalize_maps, register
from .cam import CAM, GradCAM

__all__ = ["REGISTRY", "Attribution", "CAM", "Explainer", "GradCAM", "get_method", "normalize_maps", "register"]
