"""explain: gradient-based explanations (Grad-CAM and friends) for PyTorch vision models.

    from explain import GradCAM
    e = GradCAM(model, "layer4").explain(img)   # img: path, PIL, ndarray or tensor
    e.show(); e.save("cam.png")
"""

from .attention import AttentionRecord, CapturedAttention, capture_attention
from .batch import run
from .capture import (
    Call,
    Captured,
    LayerNotFoundError,
    LayerNotRunError,
    LayerRecord,
    ModelInputError,
    capture,
    find_layers,
)
from .edit import edit
from .explanation import Explanation
from .figures import compare, figure
from .inputs import Normalize, load_image
from .layers import LayerInfo, format_layers, list_layers
from .methods import (
    CAM,
    FEM,
    REGISTRY,
    AblationCAM,
    AttentionRollout,
    Deconvnet,
    DeepFeatureFactorization,
    DeepLift,
    DeepLiftShap,
    EigenCAM,
    EigenGradCAM,
    Explainer,
    Factorization,
    FullGrad,
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    GradientAttentionRollout,
    GradientShap,
    GuidedBackprop,
    GuidedGradCAM,
    HiResCAM,
    InputXGradient,
    IntegratedGradients,
    KernelPCACAM,
    LayerCAM,
    RandomCAM,
    Saliency,
    ScoreCAM,
    ShapleyCAM,
    SmoothGrad,
    SmoothGradSquared,
    VarGrad,
    XGradCAM,
    get_method,
)
from .render import colorize, overlay
from .targets import DetectionTarget, EmbeddingSimilarity, SegmentationTarget, select_output
from .units import Channel, Neuron

__version__ = "0.1.0"

__all__ = [
    "AttentionRecord",
    "AttentionRollout",
    "CapturedAttention",
    "GradientAttentionRollout",
    "capture_attention",
    "DetectionTarget",
    "EmbeddingSimilarity",
    "compare",
    "figure",
    "SegmentationTarget",
    "select_output",
    "Deconvnet",
    "DeepLift",
    "DeepLiftShap",
    "GradientShap",
    "GuidedBackprop",
    "GuidedGradCAM",
    "InputXGradient",
    "IntegratedGradients",
    "Saliency",
    "SmoothGrad",
    "SmoothGradSquared",
    "VarGrad",
    "AblationCAM",
    "EigenCAM",
    "GradCAMPlusPlus",
    "HiResCAM",
    "LayerCAM",
    "ScoreCAM",
    "XGradCAM",
    "EigenGradCAM",
    "FEM",
    "FullGrad",
    "GradCAMElementWise",
    "KernelPCACAM",
    "RandomCAM",
    "ShapleyCAM",
    "DeepFeatureFactorization",
    "Factorization",
    "Channel",
    "Neuron",
    "CAM",
    "Call",
    "Captured",
    "LayerInfo",
    "LayerRecord",
    "capture",
    "run",
    "edit",
    "format_layers",
    "list_layers",
    "REGISTRY",
    "Explainer",
    "Explanation",
    "GradCAM",
    "LayerNotFoundError",
    "LayerNotRunError",
    "ModelInputError",
    "Normalize",
    "colorize",
    "find_layers",
    "get_method",
    "load_image",
    "overlay",
]
