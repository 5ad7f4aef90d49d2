"""explain: gradient-based explanations (Grad-CAM and friends) for PyTorch vision models.

    from explain import GradCAM
    e = GradCAM(model, "layer4").explain(img)   # img: path, PIL, ndarray or tensor
    e.show(); e.save("cam.png")

The package's layers, lowest first (each imports only the ones below it; ``tests/test_architecture.py`` checks):
``core`` (hooks, call-scoped rules, targets), ``io`` (images in; explanations, pixels and figures out),
``methods``, ``metrics``, ``dataset_tools`` (batch runs, labels, the report, strategies, evaluation), ``data``
(the demo models, their data and training scripts), ``models`` (loading any model), ``vlm``, ``cli``.
"""

from .core import _progress_bars  # noqa: F401, I001  # first: tqdm.auto imported without its notebook warning
from .core.attention import AttentionRecord, CapturedAttention, capture_attention
from .core.capture import (
    Call,
    Captured,
    LayerNotFoundError,
    LayerNotRunError,
    LayerRecord,
    ModelInputError,
    capture,
    find_layers,
)
from .core.edit import edit
from .core.layers import LayerInfo, format_layers, list_layers
from .core.targets import DetectionTarget, EmbeddingSimilarity, SegmentationTarget, select_output
from .core.units import Channel, Neuron
from .dataset_tools.batch import run
from .dataset_tools.evaluation import evaluate
from .dataset_tools.html_report import report
from .dataset_tools.spray import Strategies, strategies
from .io.explanation import Explanation
from .io.figures import figure
from .io.inputs import Normalize, load_image
from .io.loaded_model import LoadedModel
from .io.render import colorize, overlay
from .methods import (
    CAM,
    CRAFT,
    DRISE,
    FEM,
    ISCAM,
    LRP,
    REGISTRY,
    SESS,
    SSCAM,
    TCAV,
    XRAI,
    AblationCAM,
    AttentionRollout,
    AttnLRP,
    AttnLRPRollout,
    BlurIG,
    ClassActivationMapping,
    ConceptRelevance,
    Deconvnet,
    DeepFeatureFactorization,
    DeepLift,
    DeepLiftShap,
    EigenCAM,
    EigenGradCAM,
    Explainer,
    Factorization,
    Felzenszwalb,
    FinerCAM,
    FullGrad,
    GradCAM,
    GradCAMElementWise,
    GradCAMPlusPlus,
    GradientAttentionRollout,
    GradientShap,
    GuidedBackprop,
    GuidedGradCAM,
    GuidedIG,
    HiResCAM,
    InputXGradient,
    IntegratedGradients,
    KernelPCACAM,
    LayerCAM,
    LayerConductance,
    LayerIntegratedGradients,
    LeGrad,
    ODAM,
    RandomCAM,
    Saliency,
    ScoreCAM,
    SegEigenCAM,
    ShapleyCAM,
    SmoothGrad,
    SmoothGradCAMPlusPlus,
    SmoothGradSquared,
    TransformerAttribution,
    VarGrad,
    XGradCAM,
    get_method,
)
from .methods.compare import compare
from .models import load_model
from .vlm import GenerationExplainer
from ._moved_modules import keep_earlier_module_paths

__version__ = "0.1.0"

__all__ = [
    # class activation maps: a layer's feature maps weighted by gradients, scores or factorisations
    "CAM", "GradCAM", "GradCAMPlusPlus", "GradCAMElementWise", "XGradCAM", "HiResCAM", "LayerCAM", "EigenCAM",
    "EigenGradCAM", "KernelPCACAM", "SegEigenCAM", "ShapleyCAM", "FinerCAM", "FEM", "RandomCAM",
    "ClassActivationMapping", "ScoreCAM", "AblationCAM", "ISCAM", "SSCAM", "SmoothGradCAMPlusPlus", "SESS",
    "FullGrad", "DeepFeatureFactorization", "Factorization",
    # gradients and attributions at the input (or at a layer)
    "Saliency", "InputXGradient", "IntegratedGradients", "BlurIG", "GuidedIG", "XRAI", "Felzenszwalb",
    "SmoothGrad", "SmoothGradSquared", "VarGrad", "GradientShap", "DeepLift", "DeepLiftShap", "GuidedBackprop",
    "Deconvnet", "GuidedGradCAM", "LayerIntegratedGradients", "LayerConductance",
    # relevance propagation and transformers
    "LRP", "AttnLRP", "AttentionRollout", "GradientAttentionRollout", "TransformerAttribution", "AttnLRPRollout",
    "LeGrad", "GenerationExplainer",
    # concepts: what the model saw (CRP), named concepts (TCAV), discovered concepts (CRAFT)
    "ConceptRelevance", "TCAV", "CRAFT",
    # object detectors, one map per detected instance (every method takes explain(image, instances=...))
    "ODAM", "DRISE",
    # every method by name, and what they share
    "Explainer", "REGISTRY", "get_method",
    # what to explain: targets and hidden units
    "select_output", "SegmentationTarget", "DetectionTarget", "EmbeddingSimilarity", "Channel", "Neuron",
    # images and models in
    "load_image", "Normalize", "load_model", "LoadedModel",
    # results and drawing
    "Explanation", "figure", "compare", "colorize", "overlay",
    # the hook machinery, for your own methods
    "capture", "Captured", "Call", "LayerRecord", "find_layers", "list_layers", "format_layers", "LayerInfo",
    "edit", "capture_attention", "AttentionRecord", "CapturedAttention",
    "ModelInputError", "LayerNotFoundError", "LayerNotRunError",
    # datasets: batch runs, evaluation, the report and strategies
    "run", "evaluate", "report", "strategies", "Strategies",
]

keep_earlier_module_paths()
