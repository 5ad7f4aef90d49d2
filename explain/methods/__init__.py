"""The methods. Importing this package registers every method by name."""

from .base import REGISTRY, Attribution, Explainer, get_method, normalize_maps, register
from .cam import CAM, EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, XGradCAM
from .gradients import GradientExplainer, InputXGradient, IntegratedGradients, Saliency
from .guided import Deconvnet, GuidedBackprop, GuidedGradCAM, relu_backward_rule
from .perturbation import AblationCAM, ScoreCAM
from .smoothing import SmoothGrad, VarGrad

__all__ = [
    "CAM",
    "REGISTRY",
    "AblationCAM",
    "Attribution",
    "Deconvnet",
    "EigenCAM",
    "Explainer",
    "GradCAM",
    "GradCAMPlusPlus",
    "GradientExplainer",
    "GuidedBackprop",
    "GuidedGradCAM",
    "HiResCAM",
    "InputXGradient",
    "IntegratedGradients",
    "LayerCAM",
    "Saliency",
    "ScoreCAM",
    "SmoothGrad",
    "VarGrad",
    "XGradCAM",
    "get_method",
    "normalize_maps",
    "register",
    "relu_backward_rule",
]
