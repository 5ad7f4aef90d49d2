"""The methods. Importing this package registers every method by name."""

from .attention import AttentionExplainer, AttentionMethod, AttentionRollout, GradientAttentionRollout
from .attnlrp import AttnLRP
from .base import Explainer
from .cam import (
    CAM,
    FEM,
    ClassActivationMapping,
    EigenCAM,
    EigenGradCAM,
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    HiResCAM,
    KernelPCACAM,
    LayerCAM,
    RandomCAM,
    SegEigenCAM,
    ShapleyCAM,
    XGradCAM,
)
from .cam_wrappers import SESS, FinerCAM
from .concepts import ConceptRelevance
from .craft import CRAFT
from .deeplift import DeepLift, DeepLiftShap
from .detection import DRISE, ODAM
from .expected_gradients import GradientShap
from .factorization import DeepFeatureFactorization, Factorization
from .fullgrad import FullGrad
from .gradients import GradientExplainer, InputXGradient, IntegratedGradients, Saliency
from .guided import Deconvnet, GuidedBackprop, GuidedGradCAM, relu_backward_rule
from .layer_attribution import LayerConductance, LayerIntegratedGradients, LayerPathExplainer
from .legrad import LeGrad
from .lrp import LRP
from .maps import Attribution, normalize_maps
from .path_methods import BlurIG, GuidedIG
from .perturbation import ISCAM, SSCAM, AblationCAM, ScoreCAM
from .registry import REGISTRY, get_method, register
from .smooth_cam import SmoothGradCAMPlusPlus
from .smoothing import SmoothGrad, SmoothGradSquared, VarGrad
from .tcav import TCAV
from .transformer_attribution import AttnLRPRollout, TransformerAttribution
from .xrai import XRAI, Felzenszwalb

__all__ = [
    "DRISE",
    "ODAM",
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
    "AttentionMethod",
    "AttentionRollout",
    "AttnLRP",
    "ConceptRelevance",
    "CRAFT",
    "TCAV",
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
    "LeGrad",
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
    "TransformerAttribution",
    "AttnLRPRollout",
    "SmoothGradSquared",
    "VarGrad",
    "XGradCAM",
    "ClassActivationMapping",
    "FinerCAM",
    "ISCAM",
    "SESS",
    "SSCAM",
    "SegEigenCAM",
    "SmoothGradCAMPlusPlus",
    "get_method",
    "normalize_maps",
    "register",
    "relu_backward_rule",
]
