"""The methods. Importing this package registers every method by name."""

from .attention import AttentionExplainer, AttentionRollout, GradientAttentionRollout
from .base import REGISTRY, Attribution, Explainer, get_method, normalize_maps, register
from .cam import CAM, EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, XGradCAM
from .deeplift import DeepLift, DeepLiftShap
from .expected_gradients import GradientShap
from .gradients import GradientExplainer, InputXGradient, IntegratedGradients, Saliency
from .guided import Deconvnet, GuidedBackprop, GuidedGradCAM, relu_backward_rule
from .perturbation import AblationCAM, ScoreCAM
from .smoothing import SmoothGrad, SmoothGradSquared, VarGrad

__all__ = [
    "CAM",
    "REGISTRY",
    "AblationCAM",
    "AttentionExplainer",
    "AttentionRollout",
    "Attribution",
    "Deconvnet",
    "DeepLift",
    "DeepLiftShap",
    "EigenCAM",
    "Explainer",
    "GradCAM",
    "GradCAMPlusPlus",
    "GradientAttentionRollout",
    "GradientExplainer",
    "GradientShap",
    "GuidedBackprop",
    "GuidedGradCAM",
    "HiResCAM",
    "InputXGradient",
    "IntegratedGradients",
    "LayerCAM",
    "Saliency",
    "ScoreCAM",
    "SmoothGrad",
    "SmoothGradSquared",
    "VarGrad",
    "XGradCAM",
    "get_method",
    "normalize_maps",
    "register",
    "relu_backward_rule",
]
