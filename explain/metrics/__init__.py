"""Measures of explanation quality: batched tensors (or an Explanation) in, one value per image out.

| function | range | better |
| --- | --- | --- |
| pointing_game | {0, 1} | higher |
| energy_pointing_game | [0, 1] | higher |
| relevance_mass_accuracy | [0, 1] | higher |
| relevance_rank_accuracy | [0, 1] | higher |
| deletion (.area) | [0, 1] with probabilities | lower |
| insertion (.area) | [0, 1] with probabilities | higher |
| road, order="morf" (.area) | [0, 1] | lower |
| road, order="lerf" (.area) | [0, 1] | higher |
| confidence_change (.drop / .increase) | [0, 1] / {0, 1} | lower / higher |
| cascading_randomization (per stage) | [-1, 1] | lower after randomisation (the map follows the model) |
"""

from ._common import boxes_to_masks
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
from .localization import energy_pointing_game, pointing_game, relevance_mass_accuracy, relevance_rank_accuracy
from .sanity import RandomizationStage, cascading_randomization, spearman, ssim

__all__ = [
    "boxes_to_masks",
    "ConfidenceChange",
    "Curve",
    "RandomizationStage",
    "cascading_randomization",
    "confidence_change",
    "deletion",
    "energy_pointing_game",
    "insertion",
    "noisy_linear_imputation",
    "pointing_game",
    "relevance_mass_accuracy",
    "relevance_rank_accuracy",
    "road",
    "spearman",
    "ssim",
    "substrate_for",
]
