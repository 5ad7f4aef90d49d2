"""The methods. Importing this package registers every method by name."""

from .attention import AttentionExplainer, AttentionRollout, GradientAttentionRollout
from .base import REGISTRY, Attribution, Explainer, get_method, normalize_maps, register
from .cam import (
    CAM,
    FEM,
    EigenCAM,
    EigenGradCAM,
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    HiResCAM,
    KernelPCACAM,
    LayerCAM,
    RandomCAM,
    ShapleyCAM,
    XGradCAM,
)
from .deeplift import DeepLift, DeepLiftShap
from .expected_gradients import GradientShap
from .factorization import DeepFeatureFactorization, Factorization
from .fullgrad import FullGrad
from .gradients import GradientExplainer, InputXGradient, IntegratedGradients, Saliency
from .guided import Deconvnet, GuidedBackprop, GuidedGradCAM, relu_backward_rule
from .layer_attribution import LayerConductance, LayerIntegratedGradients, LayerPathExplainer
from .lrp import LRP
from .path_methods import BlurIG, GuidedIG
from .perturbation import AblationCAM, ScoreCAM
from .smoothing import SmoothGrad, SmoothGradSquared, VarGrad
from .xrai import XRAI, Felzenszwalb

__all__ = [
    "XRAI",
    "LayerPathExplainer",
    "LayerIntegratedGradients",
    "LayerConductance",
    "LRP",
    "GuidedIG",
    "Felzenszwalb",
    "BlurIG",
    "CAM",
    "REGISTRY",
    "AblationCAM",
    "AttentionExplainer",
    "AttentionRollout",
    "Attribution",
    "Deconvnet",
    "DeepFeatureFactorization",
    "DeepLift",
    "DeepLiftShap",
    "EigenCAM",
    "EigenGradCAM",
    "Explainer",
    "FEM",
    "Factorization",
    "FullGrad",
    "GradCAM",
    "GradCAMElementWise",
    "GradCAMPlusPlus",
    "GradientAttentionRollout",
    "GradientExplainer",
    "GradientShap",
    "GuidedBackprop",
    "GuidedGradCAM",
    "HiResCAM",
    "InputXGradient",
    "IntegratedGradients",
    "KernelPCACAM",
    "LayerCAM",
    "RandomCAM",
    "Saliency",
    "ScoreCAM",
    "ShapleyCAM",
    "SmoothGrad",
    "SmoothGradSquared",
    "VarGrad",
    "XGradCAM",
    "get_method",
    "normalize_maps",
    "register",
    "relu_backward_rule",
]
