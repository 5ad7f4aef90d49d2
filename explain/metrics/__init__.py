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
| road, order="morf" (.area) | [0, 1] | lower |
| road, order="lerf" (.area) | [0, 1] | higher |
| confidence_change (.drop / .increase) | [0, 1] / {0, 1} | lower / higher |
| cascading_randomization (per stage) | [-1, 1] | lower after randomisation (the map follows the model) |
"""

from ._common import boxes_to_masks
from .axiomatic import Completeness, InputInvariance, completeness, input_invariance, non_sensitivity
from .complexity import complexity, effective_complexity, sparseness
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
from .randomisation import RandomLogit, random_logit
from .sanity import RandomizationStage, cascading_randomization, spearman, ssim

__all__ = [
    "boxes_to_masks",
    "Completeness",
    "ConfidenceChange",
    "Curve",
    "InputInvariance",
    "Mosaics",
    "RandomLogit",
    "RandomizationStage",
    "auc",
    "cascading_randomization",
    "completeness",
    "complexity",
    "confidence_change",
    "deletion",
    "effective_complexity",
    "energy_pointing_game",
    "focus",
    "input_invariance",
    "insertion",
    "make_mosaics",
    "noisy_linear_imputation",
    "non_sensitivity",
    "pointing_game",
    "random_logit",
    "relevance_mass_accuracy",
    "relevance_rank_accuracy",
    "road",
    "sparseness",
    "spearman",
    "ssim",
    "substrate_for",
    "top_k_intersection",
]
