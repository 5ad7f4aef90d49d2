"""Measures of explanation quality: batched tensors (or an Explanation) in, one value per image out.

| function | range | better |
| --- | --- | --- |
| pointing_game | {0, 1} | higher |
| energy_pointing_game | [0, 1] | higher |
| relevance_mass_accuracy | [0, 1] | higher |
| relevance_rank_accuracy | [0, 1] | higher |
| top_k_intersection | [0, 1] | higher |
| auc | [0, 1], 0.5 at chance | higher |
| focus (mosaics from make_mosaics) | [0, 1] | higher |
| sparseness | [0, 1 − 1/P] (P pixels) | higher |
| complexity | [0, ln P] | lower |
| effective_complexity | [0, P] | lower |
| completeness (.error / .relative_error) | (−∞, ∞) / [0, ∞) | closer to 0 |
| non_sensitivity | [0, number of features] | lower |
| input_invariance (.invariant / .difference) | {0, 1} / [0, ∞) | higher / lower |
| random_logit (.similarity) | [-1, 1] | lower |
| deletion (.area) | [0, 1] with probabilities | lower |
| insertion (.area) | [0, 1] with probabilities | higher |
| instance_deletion / instance_insertion (.area, per detected instance) | [0, 1] | lower / higher |
| road, order="morf" (.area) | [0, 1] | lower |
| road, order="lerf" (.area) | [0, 1] | higher |
| confidence_change (.drop / .increase) | [0, 1] / {0, 1} | lower / higher |
| cascading_randomization (per stage) | [-1, 1] | lower after randomisation (the map follows the model) |
| faithfulness_correlation | [-1, 1] | higher |
| faithfulness_estimate | [-1, 1] | higher |
| monotonicity (.monotonic) | {0, 1} | higher |
| monotonicity_correlation | [-1, 1] | higher |
| region_perturbation (.aopc), "morf" / "lerf" | [-1, 1] with probabilities | higher / lower |
| selectivity (.area) | [0, 1] with probabilities | lower |
| sensitivity_n (.correlations, per n) | [-1, 1] | higher |
| irof (.area_over_curve) | [0, 1] when the score falls | higher |
| infidelity | [0, ∞) | lower |
| sufficiency | [0, 1] | higher |
| max_sensitivity, avg_sensitivity, local_lipschitz_estimate | [0, ∞) | lower |
| relative_input/output/representation_stability | [0, ∞) | lower |
| continuity | [0, ∞) | lower |
| consistency | [0, 1] | higher |
| efficient_mprt (.rise) | [0, ∞) | higher (complexity rises as the model is randomised) |
| smooth_mprt (per stage) | [-1, 1] | lower after randomisation |
"""

from ._common import boxes_to_masks, instance_boxes
from .axiomatic import Completeness, InputInvariance, completeness, input_invariance, non_sensitivity
from .complexity import complexity, effective_complexity, sparseness
from .detection import instance_deletion, instance_insertion
from .faithfulness import (
    ConfidenceChange,
    Curve,
    confidence_change,
    deletion,
    insertion,
    noisy_linear_imputation,
    road,
    substrate_for,
)
from .faithfulness_breadth import (
    Monotonicity,
    SensitivityN,
    faithfulness_correlation,
    faithfulness_estimate,
    infidelity,
    monotonicity,
    monotonicity_correlation,
    sensitivity_n,
    sufficiency,
)
from .gradcam_scores import ARCC, MaskedScoreChange, arcc, masked_score_change, road_combined
from .localization import (
    Mosaics,
    auc,
    energy_pointing_game,
    focus,
    make_mosaics,
    pointing_game,
    relevance_mass_accuracy,
    relevance_rank_accuracy,
    top_k_intersection,
)
from .randomisation import EfficientMPRT, RandomLogit, efficient_mprt, random_logit, smooth_mprt
from .regions import (
    Irof,
    RegionPerturbation,
    irof,
    patch_grid,
    region_perturbation,
    selectivity,
    slic_segments,
)
from .robustness import (
    avg_sensitivity,
    consistency,
    continuity,
    local_lipschitz_estimate,
    max_sensitivity,
    relative_input_stability,
    relative_output_stability,
    relative_representation_stability,
)
from .sanity import RandomizationStage, cascading_randomization, spearman, ssim

__all__ = [
    "ARCC",
    "MaskedScoreChange",
    "arcc",
    "masked_score_change",
    "road_combined",
    "EfficientMPRT",
    "efficient_mprt",
    "smooth_mprt",
    "avg_sensitivity",
    "consistency",
    "continuity",
    "local_lipschitz_estimate",
    "max_sensitivity",
    "relative_input_stability",
    "relative_output_stability",
    "relative_representation_stability",
    "boxes_to_masks",
    "instance_boxes",
    "instance_deletion",
    "instance_insertion",
    "Completeness",
    "ConfidenceChange",
    "Curve",
    "InputInvariance",
    "Irof",
    "Monotonicity",
    "Mosaics",
    "RandomLogit",
    "RandomizationStage",
    "RegionPerturbation",
    "SensitivityN",
    "auc",
    "cascading_randomization",
    "completeness",
    "complexity",
    "confidence_change",
    "deletion",
    "effective_complexity",
    "energy_pointing_game",
    "faithfulness_correlation",
    "faithfulness_estimate",
    "focus",
    "infidelity",
    "input_invariance",
    "insertion",
    "irof",
    "make_mosaics",
    "monotonicity",
    "monotonicity_correlation",
    "noisy_linear_imputation",
    "non_sensitivity",
    "patch_grid",
    "pointing_game",
    "random_logit",
    "region_perturbation",
    "relevance_mass_accuracy",
    "relevance_rank_accuracy",
    "road",
    "selectivity",
    "sensitivity_n",
    "slic_segments",
    "sparseness",
    "spearman",
    "ssim",
    "substrate_for",
    "sufficiency",
    "top_k_intersection",
]
