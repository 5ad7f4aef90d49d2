"""Which method beats which, and by how much: every comparative claim of README.md, docs/ and RESULTS.md's prose,
with a paired bootstrap interval.

    python benchmarks/claims.py --threads 1                        # every part; see --help for the image counts
    python benchmarks/claims.py --threads 1 --parts transformers   # one part: the others' last results are kept

For each claim ("A localises better than B on model M by metric X") the metric is computed per image for both
methods on two image sets of the shipped synthetic data, the held-out seed (``EVALUATION_SEED``, the one the
tables of RESULTS.md use) and a fresh seed that no table or setting was chosen on, with the metrics' code of
benchmarks/quality.py (its settings: 4 px pointing tolerance, ROAD at 10–90 %, Chefer et al.'s segmentation and
perturbation tests) and ``explain.metrics``. The difference A − B is then resampled: 2,000 (``--resamples``) draws
of the images with replacement, within each seed (stratified), the same draw for A and B (paired), from a fixed
seed; the 95 % interval is the draws' 2.5th and 97.5th percentiles. A metric with a per-image value (pointing,
energy, AUCs, ROAD, deletion, the sanity check's rank correlation) is averaged over the drawn images; the
segmentation test's mIoU pools its intersections and unions over the drawn images, as the test does over all.

Parts: "cnn" (the demo CNN), "transformers" (demo-vit, demo-vit2), "vlm" (the demo LLaVA's colour answers, per
scene, trained against untrained). Each part's results are kept in benchmarks/claims.json, and the section
"Claims and their uncertainty" of RESULTS.md is written from all parts there.

Verdict of a claim that A is better (worse) than B: "holds" when the interval over both seeds excludes 0 on the
claimed side and each seed's own difference has the claimed sign; "reversed" when the interval excludes 0 on the
other side; otherwise "no measurable difference". A claim of no difference ("=") holds when the interval contains
0. A claim with no side ("?") or about one method's own level only reports the interval.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnlrp_rules import SETTINGS as ATTNLRP_SETTINGS  # noqa: E402
from common import machine, write_section  # noqa: E402
from quality import (  # noqa: E402
    CURVE_STEPS,
    OPTION_ROWS,
    PERTURBATION_FRACTIONS,
    ROAD_SHARES,
    TOLERANCE,
    TRANSFORMERS,
    baseline_maps,
    last_block_layer,
    perturbation_correct,
    quiet,
    segmentation_parts,
)

import explain  # noqa: E402
from explain import metrics  # noqa: E402
from explain.data import load_demo_model, make_dataset  # noqa: E402
from explain.data.train import EVALUATION_SEED, to_model_input  # noqa: E402

RESULTS_JSON = Path(__file__).with_name("claims.json")
FRESH_SEED = 20261126
"""A seed no training, table or setting used: the second image set."""
RESAMPLES = 2000
BOOTSTRAP_SEED = 0
LEVEL = 0.95
HIGHER_IS_BETTER = {"pointing": True, "energy PG": True, "mass acc.": True, "rank acc.": True, "deletion ↓": False,
                    "insertion ↑": True, "ROAD MoRF ↓": False, "avg drop % ↓": False, "mIoU": True,
                    "pos. AUC ↓": False, "neg. AUC ↑": True, "sanity ↓": False, "energy": True}
"""Which way each metric is better. "sanity ↓": the rank correlation of the maps before and after the top layer
(the CNN's ``fc``, a transformer's ``head``) is randomised: near 0 passes, near 1 fails."""
SANITY_STAGE = {"cnn": "fc", "transformers": "head"}
SANITY_SEEDS = (0, 1, 2)
"""The sanity check's value depends on the random draw of the top layer's weights as much as on the images (on
demo-vit, AttnLRPRollout's mean after the head moves from 0.70 to 0.79 with another draw): each image's value is
the mean over these draws."""
ATTNLRP_ROWS = {"attnlrp, signed": ATTNLRP_SETTINGS["LRP-0, signed (reduce=\"sum\")"],
                "attnlrp, linear γ 1": ATTNLRP_SETTINGS["linear γ 1"],
                "attnlrp, conv γ 0.25": ATTNLRP_SETTINGS["conv γ 0.25"],
                "attnlrp, CP-LRP": ATTNLRP_SETTINGS["CP-LRP"]}
"""AttnLRP's settings that docs/transformers.md compares with its default."""


# ------------------------------------------------------------------ the bootstrap


def resample_indices(strata: Sequence[int], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Tensor:
    """(resamples, Σ strata) int64 indices into the images laid end to end, stratum after stratum: each row draws,
    with replacement, as many images from each stratum as it holds, from that stratum only."""
    generator = torch.Generator().manual_seed(seed)
    columns, offset = [], 0
    for size in strata:
        columns.append(torch.randint(size, (resamples, size), generator=generator) + offset)
        offset += size
    return torch.cat(columns, dim=1)


def mean_statistic(values: Tensor, indices: Tensor) -> Tensor:
    """(N,) per-image values, (B, n) indices → (B,) means over the indexed images."""
    return values.double()[indices].mean(dim=-1)


def pooled_iou_statistic(counts: Tensor, indices: Tensor) -> Tensor:
    """(N, 4) per-image pixel counts (intersection of background, of foreground; union of background, of
    foreground), (B, n) indices → (B,) mIoU of the indexed images, their counts pooled (Chefer et al.'s test)."""
    pooled = counts.double()[indices].sum(dim=-2)  # (B, 4)
    return (pooled[..., :2] / pooled[..., 2:]).mean(dim=-1)


@dataclass
class Interval:
    """A statistic on every image (``estimate``), its bootstrap percentile interval [``low``, ``high``], and the
    statistic on each stratum alone (``per_stratum``)."""

    estimate: float
    low: float
    high: float
    per_stratum: list[float]


def paired_bootstrap(statistic: Callable[[Tensor, Tensor], Tensor], first: Tensor, second: Optional[Tensor],
                     strata: Sequence[int], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED,
                     level: float = LEVEL) -> Interval:
    """The statistic of ``first`` minus that of ``second`` (the statistic of ``first`` alone when ``second`` is
    None), both per image in the same order, on the same bootstrap draws of the images (paired), drawn within
    each stratum (``strata``: image counts, laid end to end). ``statistic(values, indices)`` maps per-image values
    and (B, n) indices to (B,) statistics (``mean_statistic``, ``pooled_iou_statistic``)."""
    if sum(strata) != len(first) or (second is not None and len(second) != len(first)):
        raise ValueError(f"strata {list(strata)} must add up to the images of both methods ({len(first)}, "
                         f"{None if second is None else len(second)}).")

    def difference(indices: Tensor) -> Tensor:
        values = statistic(first, indices)
        return values if second is None else values - statistic(second, indices)

    draws = difference(resample_indices(strata, resamples, seed))
    tail = (1 - level) / 2
    low, high = torch.quantile(draws, torch.tensor([tail, 1 - tail], dtype=draws.dtype)).tolist()
    everything = torch.arange(sum(strata))[None]
    bounds = np.cumsum([0, *strata])
    per_stratum = [difference(everything[:, start:end]).item() for start, end in zip(bounds[:-1], bounds[1:])]
    return Interval(estimate=difference(everything).item(), low=low, high=high, per_stratum=per_stratum)


def verdict(interval: Interval, metric: str, expected: str, per_draw: Sequence[float] = ()) -> str:
    """"holds", "reversed", "no measurable difference", "differs" (for "="), or "" (no side claimed), for a claim
    that the first method is better (">") or worse ("<") than the second by ``metric``, or level with it ("=").
    ``per_draw``: the difference with each random draw of the sanity check's weights alone, which must agree too."""
    if expected == "=":
        return "holds" if interval.low <= 0 <= interval.high else "differs"
    if expected not in (">", "<"):
        return ""
    sign = 1 if (expected == ">") == HIGHER_IS_BETTER[metric] else -1  # the claimed sign of first − second
    if sign * interval.low > 0 and sign * interval.high > 0:
        agreeing = all(sign * value > 0 for value in [*interval.per_stratum, *per_draw])
        return "holds" if agreeing else "no measurable difference"
    if sign * interval.low < 0 and sign * interval.high < 0:
        return "reversed"
    return "no measurable difference"


# ------------------------------------------------------------------ the claims


@dataclass(frozen=True)
class Claim:
    """"``first`` is better (``expected`` ">") / worse ("<") / level ("=") than ``second`` by ``metric`` on
    ``model``" ("?": no side; ``second`` None: ``first``'s own value). ``where``: the documents that say it."""

    key: str
    where: str
    says: str
    part: str
    model: str
    metric: str
    first: str
    second: Optional[str]
    expected: str


def claim(key, where, says, part, model, metric, first, second, expected) -> Claim:
    return Claim(key, where, says, part, model, metric, first, second, expected)


RQ = "RESULTS \"Quality: what the numbers say\""
R17 = "RESULTS \"Issue 17 methods\""
R16 = "RESULTS \"Issue 16 methods\""
RT = "RESULTS \"Transformers: what the numbers say\""
RV = "RESULTS \"Vision-language models\""
TM = "docs/transformers.md"
ME = "docs/methods.md"
EV = "docs/evaluation.md"

CLAIMS: list[Claim] = [
    # the demo CNN
    *[claim(f"cnn-deconvnet-random-{metric}", f"{RQ}", "every method beats the random map on the four localisation "
            "metrics, deconvnet by the narrowest margin", "cnn", "demo", metric, "deconvnet", "random map", ">")
      for metric in ("pointing", "energy PG", "mass acc.", "rank acc.")],
    claim("cnn-deletion-fooled", f"{RQ}; {EV} \"Deletion is fooled\"", "a random map scores better than the true mask "
          "on deletion", "cnn", "demo", "deletion ↓", "random map", "true mask", ">"),
    claim("cnn-gradcam-pointing", f"{RQ}; docs/getting-started.md", "Grad-CAM's pointing game is 0.97 (the target was "
          "at least 0.9)", "cnn", "demo", "pointing", "gradcam", None, ""),
    claim("cnn-sobel-deletion", f"{RQ}", "on deletion Sobel edges score worst (worse than the true mask)", "cnn",
          "demo", "deletion ↓", "Sobel edges", "true mask", "<"),
    claim("cnn-road-not-fooled", f"{RQ}; {EV}", "ROAD is not fooled: the true mask beats a random map",
          "cnn", "demo", "ROAD MoRF ↓", "true mask", "random map", ">"),
    claim("cnn-insertion-not-fooled", f"{RQ}; {EV}", "insertion is not fooled: the true mask beats a random map",
          "cnn", "demo", "insertion ↑", "true mask", "random map", ">"),
    claim("cnn-road-cam-mask", f"{RQ}", "ROAD puts every CAM at the level of the true mask", "cnn", "demo",
          "ROAD MoRF ↓", "gradcam", "true mask", "="),
    claim("cnn-sanity-gradcam", f"{RQ}; {EV}; {ME} table", "Grad-CAM passes the sanity check (−0.24 after fc)",
          "cnn", "demo", "sanity ↓", "gradcam", None, ""),
    claim("cnn-sanity-gbp-gradcam", f"{RQ}; {EV} \"Pretty is not faithful\"; {ME}", "guided backprop keeps its "
          "maps when fc is random (0.86), Grad-CAM does not (−0.24)", "cnn", "demo", "sanity ↓", "guidedbackprop",
          "gradcam", "<"),
    claim("cnn-sanity-gradcam++-gradcam", f"{RQ}; {ME}", "Grad-CAM++ keeps 0.88 after fc, unlike Grad-CAM", "cnn",
          "demo", "sanity ↓", "gradcam++", "gradcam", "<"),
    claim("cnn-sanity-scorecam-gradcam", f"{RQ}; {ME}", "Score-CAM keeps 0.88 after fc, unlike Grad-CAM", "cnn",
          "demo", "sanity ↓", "scorecam", "gradcam", "<"),
    *[claim(f"cnn-lrp-{other}-{metric}", f"{R17}; {ME} \"In short\"", "LRP localises best of the pixel "
            "(attribution) methods (old text)", "cnn", "demo", metric, "lrp", other, ">")
      for other in ("guidedbackprop", "guidedgradcam", "blurig") for metric in ("pointing", "energy PG", "mass acc.")],
    *[claim(f"cnn-{method}-ig-pointing", f"{R17}", "DeepLIFT, Guided IG, GradientSHAP sit with Integrated Gradients "
            "and SmoothGrad on the pointing game", "cnn", "demo", "pointing", method, "integratedgradients", "=")
      for method in ("deeplift", "guidedig", "gradientshap", "smoothgrad")],
    *[claim(f"cnn-sanity-{method}-ig", f"{R17}", "the path methods behave as Integrated Gradients does in the sanity "
            "check", "cnn", "demo", "sanity ↓", method, "integratedgradients", "=")
      for method in ("deeplift", "gradientshap")],
    claim("cnn-xrai-gradcam-road", f"{R17}", "XRAI's ROAD MoRF is next to the CAMs'", "cnn", "demo", "ROAD MoRF ↓",
          "xrai", "gradcam", "="),
    claim("cnn-blurig-lrp-insertion", f"{R17}", "LRP's insertion is the best of all rows but Blur IG's", "cnn", "demo",
          "insertion ↑", "blurig", "lrp", ">"),
    claim("cnn-lig-scorecam-road", f"{R17}", "Layer IG / Conductance have the best ROAD MoRF of all methods (old text)",
          "cnn", "demo", "ROAD MoRF ↓", "layerintegratedgradients", "scorecam", ">"),
    claim("cnn-lig-mask-road", f"{R17}", "Layer IG's ROAD MoRF is below the true mask's", "cnn", "demo",
          "ROAD MoRF ↓", "layerintegratedgradients", "true mask", ">"),
    claim("cnn-lig-gradcam++-deletion", f"{R17}", "Layer IG / Conductance have the lowest deletion", "cnn", "demo",
          "deletion ↓", "layerintegratedgradients", "gradcam++", ">"),
    claim("cnn-xrai-fullgrad-drop", f"{R17}", "XRAI keeps the model's confidence best of all rows", "cnn", "demo",
          "avg drop % ↓", "xrai", "fullgrad", ">"),
    claim("cnn-sanity-lrp-gbp", f"{R17}", "after fc, LRP keeps its ranking like guided backprop (old text)",
          "cnn", "demo", "sanity ↓", "lrp", "guidedbackprop", "="),
    claim("cnn-sanity-lig-gradcam", f"{R17}", "the layer methods change most after fc, as Grad-CAM (old text)",
          "cnn", "demo", "sanity ↓", "layerintegratedgradients", "gradcam", "?"),
    *[claim(f"cnn-gradcam-randomcam-{metric}", f"{R16}", "every CAM beats RandomCAM on every localisation metric",
            "cnn", "demo", metric, "gradcam", "randomcam", ">")
      for metric in ("pointing", "energy PG", "mass acc.", "rank acc.")],
    *[claim(f"cnn-deconvnet-randomcam-{metric}", f"{R16}; {EV} \"need a floor\"", "deconvnet does not beat "
            "RandomCAM on energy, mass and rank accuracy", "cnn", "demo", metric, "deconvnet", "randomcam", "<")
      for metric in ("energy PG", "mass acc.", "rank acc.")],
    *[claim(f"cnn-fullgrad-randomcam-{metric}", f"{R16}; {EV}", "FullGrad does not beat RandomCAM on pointing and "
            "rank accuracy", "cnn", "demo", metric, "fullgrad", "randomcam", "<")
      for metric in ("pointing", "rank acc.")],
    claim("cnn-randomcam-random-pointing", f"{EV}", "RandomCAM points at the object more often than a random map "
          "(feature maps concentrate on objects)", "cnn", "demo", "pointing", "randomcam", "random map", ">"),
    claim("cnn-fullgrad-gradcam-drop", f"{R16}", "FullGrad's maps keep the most confidence (avg drop 21.8 % against "
          "Grad-CAM's 72.0 %)", "cnn", "demo", "avg drop % ↓", "fullgrad", "gradcam", ">"),
    *[claim(f"cnn-fem-{other}-{metric}", f"{R16}", "FEM puts the most mass in the object of all CAMs (old text)",
            "cnn", "demo", metric, "fem", other, ">")
      for other in ("eigengradcam", "gradcam, layer3+4 product") for metric in ("energy PG", "mass acc.")],
    *[claim(f"cnn-{method}-eigencam-energy", f"{R16}", "Eigen-Grad-CAM and KPCA-CAM match Eigen-CAM", "cnn", "demo",
            "energy PG", method, "eigencam", "=") for method in ("eigengradcam", "kpcacam")],
    claim("cnn-augment-rank", f"{R16}", "smooth=\"augment\" gives Grad-CAM's best rank accuracy", "cnn", "demo",
          "rank acc.", "gradcam, smooth=augment", "gradcam", ">"),
    claim("cnn-layers-mean-raw", f"{R16}", "layer3+4: the normalised and the raw mean barely differ (old text)",
          "cnn", "demo", "energy PG", "gradcam, layer3+4 mean", "gradcam, layer3+4 raw mean", "="),
    *[claim(f"cnn-layers-product-{metric}", f"{R16}", "layer3+4: the product concentrates the maps", "cnn", "demo",
            metric, "gradcam, layer3+4 product", "gradcam, layer3+4 mean", ">")
      for metric in ("energy PG", "mass acc.")],
    # the demo transformers
    *[claim(f"vit-ta-rollout-{metric}-{model}", f"{TM} \"Which transformer method\"", "TransformerAttribution beats "
            "attention rollout on both models' mIoU and positive AUC (old text)", "transformers", model, metric,
            "transformerattribution", "attentionrollout", ">")
      for model in TRANSFORMERS for metric in ("mIoU", "pos. AUC ↓")],
    *[claim(f"vit-ta-{other}-mIoU-{model}", f"{TM} \"Which transformer method\"; {ME} table", "TransformerAttribution:"
            " best mIoU on both models (old text: best on demo-vit, second on demo-vit2)", "transformers", model,
            "mIoU", "transformerattribution", other, ">")
      for model in TRANSFORMERS for other in ("gradientrollout", "attnlrp", "attnlrprollout", "saliency")],
    *[claim(f"vit-gradrollout-ta-{metric}-{model}", f"{TM}; {ME} \"In short\"", "gradient-weighted rollout is nearly "
            "as good as TransformerAttribution at half the cost (old text; now: a quarter of the cost)",
            "transformers", model, metric, "gradientrollout", "transformerattribution", "?")
      for model in TRANSFORMERS for metric in ("mIoU", "pos. AUC ↓")],
    *[claim(f"vit-ta-attnlrprollout-{metric}-{model}", f"{TM} (AttnLRPRollout paragraph)", "how TransformerAttribution "
            "and AttnLRPRollout compare", "transformers", model, metric, "transformerattribution", "attnlrprollout",
            "?") for model in TRANSFORMERS for metric in ("pos. AUC ↓", "neg. AUC ↑")],
    *[claim(f"vit-attnlrp-{other}-mIoU-demo-vit2", f"{TM} \"Which transformer method\"", "AttnLRP: second-best mIoU "
            "on demo-vit2 (old text: best)", "transformers", "demo-vit2", "mIoU", "attnlrp", other, ">")
      for other in ("gradientrollout", "attentionrollout", "attnlrprollout", "saliency")],
    *[claim(f"vit-legrad-gradcam-{metric}-{model}", f"{TM} \"Which transformer method\"",
            "LeGrad localises worst (old text; now: worst of the attention methods)",
            "transformers", model, metric, "legrad", "gradcam", "<")
      for model in TRANSFORMERS for metric in ("mIoU", "pointing")],
    *[claim(f"vit-sanity-{method}-{model}", f"{TM}; {ME} table; {RT}", "the sanity check after the head",
            "transformers", model, "sanity ↓", method, None, "")
      for model in TRANSFORMERS for method in ("transformerattribution", "attnlrprollout", "attnlrp", "legrad",
                                               "gradientrollout", "gradcam", "saliency")],
    *[claim(f"vit-sanity-attnlrp-saliency-{model}", f"{TM}", "AttnLRP, like saliency, changes little when the head is "
            "randomised", "transformers", model, "sanity ↓", "attnlrp", "saliency", "=") for model in TRANSFORMERS],
    claim("vit-sanity-gradcam-gradrollout", f"{RT}", "Grad-CAM changes most after the head", "transformers",
          "demo-vit", "sanity ↓", "gradcam", "gradientrollout", ">"),
    *[claim(f"vit-sanity-ta-attnlrprollout-{model}", f"{TM}", "AttnLRPRollout keeps more of its map than "
            "TransformerAttribution when the head is randomised", "transformers", model, "sanity ↓",
            "transformerattribution", "attnlrprollout", ">") for model in TRANSFORMERS],
    *[claim(f"vit-sanity-legrad-ta-{model}", f"{TM}", "LeGrad changes the most of the attention methods when the head "
            "is randomised", "transformers", model, "sanity ↓", "legrad", "transformerattribution", ">")
      for model in TRANSFORMERS],
    *[claim(f"vit-pointing-{first}-{second}", f"{RT}; {TM}; README \"Two findings\"", f"{first} points at the object "
            f"more often than {second} on the demo transformer", "transformers", "demo-vit", "pointing", first, second,
            ">")
      for first, second in (("gradientrollout", "gradcam"), ("gradientrollout", "saliency"),
                            ("gradientrollout", "integratedgradients"), ("attentionrollout", "gradcam"))],
    *[claim(f"vit-energy-gradrollout-gradcam-{metric}", f"{RT}", "gradient-weighted rollout puts the most relevance "
            "inside the object (against Grad-CAM)", "transformers", "demo-vit", metric, "gradientrollout", "gradcam",
            ">") for metric in ("energy PG", "mass acc.")],
    *[claim(f"vit-energy-ta-gradrollout-{metric}", f"{RT}", "gradient-weighted rollout puts the most relevance "
            "inside the object (old text; of all methods)", "transformers", "demo-vit", metric, "gradientrollout",
            "transformerattribution", ">") for metric in ("energy PG", "mass acc.")],
    claim("vit-energy-rollout-spreads", f"{RT}; {TM}", "attention rollout spreads its mass (against gradient-weighted "
          "rollout)", "transformers", "demo-vit", "energy PG", "attentionrollout", "gradientrollout", "<"),
    claim("vit-scorecam-gaussian-pointing", f"{RT}", "Score-CAM at the norm points below the centred Gaussian",
          "transformers", "demo-vit", "pointing", "scorecam", "centred Gaussian", "<"),
    *[claim(f"vit-road-{first}-{second}", f"{RT}", "ROAD MoRF puts both rollouts ahead of Grad-CAM, saliency and "
            "Integrated Gradients", "transformers", "demo-vit", "ROAD MoRF ↓", first, second, ">")
      for first in ("gradientrollout", "attentionrollout")
      for second in ("gradcam", "saliency", "integratedgradients")],
    claim("vit-road-gradrollout-mask", f"{RT}", "ROAD MoRF puts the rollouts next to the true mask", "transformers",
          "demo-vit", "ROAD MoRF ↓", "gradientrollout", "true mask", "="),
    *[claim(f"vit-attnlrp-signed-{model}", f"{TM} (AttnLRP paragraph and settings)", "the unsigned maps localise far "
            "better than the signed sum", "transformers", model, "mIoU", "attnlrp", "attnlrp, signed", ">")
      for model in TRANSFORMERS],
    *[claim(f"vit-attnlrp-setting-{setting[9:]}-{metric}-{model}", f"{TM} (AttnLRP settings)", "LRP-γ and CP-LRP move "
            "mIoU by at most 0.04 and help neither model's positive AUC consistently", "transformers", model, metric,
            setting, "attnlrp", "?")
      for setting in ("attnlrp, linear γ 1", "attnlrp, conv γ 0.25", "attnlrp, CP-LRP") for model in TRANSFORMERS
      for metric in ("mIoU", "pos. AUC ↓")],
    claim("vit-random-ta-pos-auc", f"{TM}", "the positive AUC separates the methods little: a random map ends near "
          "the others", "transformers", "demo-vit2", "pos. AUC ↓", "transformerattribution", "random map", "?"),
    # the demo vision-language model
    *[claim(f"vlm-attnlrp-{other}-{metric}", f"{RV}", "AttnLRP points at the shape most often and puts the most "
            "relevance there", "vlm", "demo-vlm", metric, "attnlrp", other, ">")
      for other in ("attention", "input_x_gradient") for metric in ("pointing", "energy")],
    claim("vlm-attention-untrained", f"{RV}", "gradient × attention points at the shape as often for the untrained "
          "model as for the trained one (old text)", "vlm", "demo-vlm", "pointing", "attention (untrained)",
          "attention", "="),
]


# ------------------------------------------------------------------ per-image values


@dataclass
class ImageSet:
    seed: int
    images: np.ndarray  # (N, H, W, 3) uint8
    masks: np.ndarray  # (N, H, W) bool
    batch: Tensor
    labels: Tensor


def image_set(count: int, seed: int) -> ImageSet:
    data = make_dataset(count, seed=seed)
    return ImageSet(seed, data.images, data.masks, to_model_input(data.images), torch.from_numpy(data.labels))


def explainer_for(label: str, model: nn.Module, layer: str):
    """The explainer a row label names: a registered method (CAMs at ``layer``), a CAM option row of quality.py's
    OPTION_ROWS, or an AttnLRP setting of ATTNLRP_ROWS."""
    if label in OPTION_ROWS:
        name, options = OPTION_ROWS[label]
        options = dict(options)
        return explain.get_method(name)(model, options.pop("layer"), **options)
    if label in ATTNLRP_ROWS:
        return explain.AttnLRP(model, **ATTNLRP_ROWS[label])
    cls = explain.get_method(label)
    return cls(model, layer, **quiet(cls)) if cls.needs_layer else cls(model, **quiet(cls))


def maps_of(label: str, model: nn.Module, layer: str, images: ImageSet, baselines: dict[str, Tensor]) -> Tensor:
    if label in baselines:
        return baselines[label]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return explainer_for(label, model, layer).explain(images.batch, target=images.labels.tolist()).maps


def per_image(metric: str, model: nn.Module, images: ImageSet, maps: Tensor, label: str, layer: str,
              part: str) -> Tensor:
    """(N,) values of ``metric`` per image (mIoU: (N, 4) pixel counts, see ``pooled_iou_statistic``)."""
    masks = torch.from_numpy(images.masks)
    target = images.labels.tolist()
    batch = images.batch
    if metric == "pointing":
        return metrics.pointing_game(maps, masks, tolerance=TOLERANCE)
    if metric == "energy PG":
        return metrics.energy_pointing_game(maps, masks)
    if metric == "mass acc.":
        return metrics.relevance_mass_accuracy(maps, masks)
    if metric == "rank acc.":
        return metrics.relevance_rank_accuracy(maps, masks)
    if metric == "deletion ↓":
        return metrics.deletion(model, batch, maps, target, steps=CURVE_STEPS).area
    if metric == "insertion ↑":
        return metrics.insertion(model, batch, maps, target, steps=CURVE_STEPS).area
    if metric == "ROAD MoRF ↓":
        return metrics.road(model, batch, maps, target, percentages=ROAD_SHARES).area
    if metric == "avg drop % ↓":
        return 100 * metrics.confidence_change(model, batch, maps, target).drop
    if metric in ("pos. AUC ↓", "neg. AUC ↑"):
        order = "positive" if metric.startswith("pos") else "negative"
        correct = perturbation_correct(model, batch, maps, images.labels, order).float()  # (S, N)
        return 100 * torch.trapezoid(correct, torch.tensor(PERTURBATION_FRACTIONS), dim=0)
    if metric == "mIoU":
        parts = segmentation_parts(maps, masks)
        return torch.cat([parts.intersections, parts.unions], dim=1)
    if metric.startswith("sanity ↓ seed "):  # one draw of the top layer's random weights
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a randomised copy may give empty maps
            stages = metrics.cascading_randomization(explainer_for(label, model, layer), batch, target,
                                                     stages=[SANITY_STAGE[part]], seed=int(metric.split()[-1]))
        return stages[0].rank_correlation
    raise ValueError(f"no per-image form for metric {metric!r}")


def needed(part: str) -> dict[str, dict[str, set[str]]]:
    """model → method label → the metrics the part's claims take of it."""
    wanted: dict[str, dict[str, set[str]]] = {}
    for item in CLAIMS:
        if item.part != part:
            continue
        for label in (item.first, item.second):
            if label is not None:
                wanted.setdefault(item.model, {}).setdefault(label, set()).add(item.metric)
    return wanted


def sanity_keys(label: str) -> list[tuple[str, str]]:
    return [(label, f"sanity ↓ seed {seed}") for seed in SANITY_SEEDS]


def image_values(part: str, model_name: str, model: nn.Module, layer: str, sets: list[ImageSet],
                 wanted: dict[str, set[str]], cached: Optional[dict[tuple[str, str], Tensor]] = None
                 ) -> dict[tuple[str, str], Tensor]:
    """(method label, metric) → per-image values over the image sets laid end to end; "sanity ↓" is the mean over
    SANITY_SEEDS of the values of each draw ("sanity ↓ seed S"). Values in ``cached`` (from --load-values, over
    the same image sets) are kept, only the missing ones are computed."""
    values = dict(cached or {})
    for label, metric_names in wanted.items():
        missing = sorted({key[1] for metric in metric_names
                          for key in (sanity_keys(label) if metric == "sanity ↓" else [(label, metric)])
                          if key not in values})
        parts: dict[str, list[Tensor]] = {metric: [] for metric in missing}
        for images in sets:
            if not missing:
                break
            started = time.perf_counter()
            maps = None
            if any(not metric.startswith("sanity") for metric in missing):
                maps = maps_of(label, model, layer, images, baseline_maps(images.images, images.masks))
            for metric in missing:
                parts[metric].append(per_image(metric, model, images, maps, label, layer, part).detach().cpu())
            print(f"  {model_name} seed {images.seed}: {label} ({', '.join(missing)}) "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
        values.update({(label, metric): torch.cat(tensors) for metric, tensors in parts.items()})
        if "sanity ↓" in metric_names:
            values[(label, "sanity ↓")] = torch.stack([values[key] for key in sanity_keys(label)]).mean(dim=0)
    return values


def vlm_values(scene_counts: Sequence[int]) -> tuple[dict[tuple[str, str], Tensor], list[int]]:
    """Per scene, the pointing game and the energy on the shape's token cells of each method of the demo LLaVA's
    colour answer (as benchmarks/vlm_quality.py), trained and untrained ("… (untrained)")."""
    from vlm_quality import METHODS, shape_cells

    from explain import GenerationExplainer
    from explain.data.demo_vlm import HELD_OUT_SEED, QUESTIONS, build_model, held_out_scenes, load_vlm_demo

    trained, processor = load_vlm_demo()
    torch.manual_seed(0)
    untrained = build_model()
    scenes = [*held_out_scenes(scene_counts[0]), *held_out_scenes(scene_counts[1], seed=FRESH_SEED)]
    assert HELD_OUT_SEED != FRESH_SEED
    values: dict[tuple[str, str], Tensor] = {}
    for suffix, model in (("", trained), (" (untrained)", untrained)):
        for method in METHODS:
            started = time.perf_counter()
            explainer = GenerationExplainer(model, processor, method=method)
            pointing, energy = [], []
            for scene in scenes:
                raw = explainer.explain(scene.image, QUESTIONS["color"], max_new_tokens=2).raw_maps[0, 0]
                relevance = raw.detach().cpu().numpy()
                cells = shape_cells(scene)
                pointing.append(float(cells.flat[int(relevance.argmax())]))
                positive = np.clip(relevance, 0, None)
                energy.append(float(positive[cells].sum() / max(positive.sum(), 1e-30)))
            values[(method + suffix, "pointing")] = torch.tensor(pointing)
            values[(method + suffix, "energy")] = torch.tensor(energy)
            print(f"  vlm{suffix}: {method} {time.perf_counter() - started:.1f} s", flush=True)
    return values, list(scene_counts)


# ------------------------------------------------------------------ results


def evaluate_claims(part: str, values: dict[str, dict[tuple[str, str], Tensor]], strata: list[int],
                    resamples: int) -> list[dict]:
    rows = []
    for item in CLAIMS:
        if item.part != part:
            continue
        model_values = values[item.model]
        statistic = pooled_iou_statistic if item.metric == "mIoU" else mean_statistic
        first = model_values[(item.first, item.metric)]
        second = None if item.second is None else model_values[(item.second, item.metric)]
        interval = paired_bootstrap(statistic, first, second, strata, resamples)
        per_draw = []
        if item.metric == "sanity ↓":  # the same difference with each random draw of the top layer alone
            per_draw = [(model_values[first_key].double().mean() - (0 if item.second is None else model_values[
                second_key].double().mean())).item()
                for first_key, second_key in zip(sanity_keys(item.first), sanity_keys(item.second or item.first))]
        rows.append({"key": item.key, "estimate": interval.estimate, "low": interval.low, "high": interval.high,
                     "per_stratum": interval.per_stratum, "per_draw": per_draw,
                     "verdict": verdict(interval, item.metric, item.expected, per_draw)})
    return rows


def number(value: float, metric: str) -> str:
    digits = 1 if metric in ("pos. AUC ↓", "neg. AUC ↑", "avg drop % ↓") else 3
    return f"{value:+.{digits}f}"


EXPECTED_WORDS = {">": "better", "<": "worse", "=": "level", "?": "–", "": "–"}


def section(stored: dict) -> str:
    lines = [
        "Every comparative claim of README.md, docs/ and the \"what the numbers say\" sections above, measured per "
        "image on two image sets of the synthetic data: the held-out seed the tables use "
        f"({EVALUATION_SEED}) and a fresh seed ({FRESH_SEED}) no table or setting was chosen on. Δ is the first "
        "method's value minus the second's (the first's own value where there is no second), over both sets; the "
        f"interval is the 2.5th–97.5th percentile of {RESAMPLES:,} paired bootstrap draws of the images (within "
        f"each seed, the same draw for both methods, seed {BOOTSTRAP_SEED}); mIoU pools its pixel counts over the "
        "drawn images, every other metric is a mean of per-image values. \"claimed\": the side the text claims for "
        "the first method (better, worse, level, – none). Verdict: \"holds\" when the interval excludes 0 on the "
        "claimed side and both seeds agree; \"reversed\" when it excludes 0 on the other side; \"no measurable "
        "difference\" otherwise; for \"level\", \"holds\" when the interval contains 0. Metrics as in the \"Quality\" "
        "sections (↓: lower is better; \"sanity ↓\": Spearman rank correlation of each image's map before and after "
        f"randomising the top layer, `fc` or `head`, averaged over {len(SANITY_SEEDS)} random draws of its weights).",
    ]
    by_key = {item.key: item for item in CLAIMS}
    titles = {"cnn": "The demo CNN", "transformers": "The demo transformers", "vlm": "The demo vision-language model"}
    for part in ("cnn", "transformers", "vlm"):
        if part not in stored:
            continue
        record = stored[part]
        sizes = " + ".join(str(size) for size in record["strata"]) + (" scenes" if part == "vlm" else " images")
        lines += ["", f"### {titles[part]}", "",
                  f"{record['date']}, {record['machine']}; {sizes} (held-out + fresh); run time "
                  f"{record['seconds']:.0f} s. Command: `{record['command']}`.", "",
                  "| claim | where | model | metric | first − second | claimed | held-out | fresh | Δ [95 % interval] "
                  "| verdict |",
                  "| --- | --- | --- | --- | --- | --- | ---: | ---: | --- | --- |"]
        for row in record["rows"]:
            item = by_key.get(row["key"])
            if item is None:
                continue
            pair = item.first if item.second is None else f"{item.first} − {item.second}"
            held, fresh = (number(value, item.metric) for value in row["per_stratum"])
            lines.append(f"| {item.says} | {item.where} | {item.model} | {item.metric} | {pair} | "
                         f"{EXPECTED_WORDS[item.expected]} | {held} | {fresh} | {number(row['estimate'], item.metric)}"
                         f" [{number(row['low'], item.metric)}, {number(row['high'], item.metric)}]"
                         + (f"; each draw {' / '.join(number(value, item.metric) for value in row['per_draw'])}"
                            if row.get("per_draw") else "") + f" | {row['verdict'] or '–'} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=("cnn", "transformers", "vlm"),
                        default=["cnn", "transformers", "vlm"])
    parser.add_argument("--images", type=int, default=100, help="held-out images (the tables' seed) per part")
    parser.add_argument("--fresh-images", type=int, default=300, help="fresh-seed images for the transformers")
    parser.add_argument("--cnn-fresh-images", type=int, default=100, help="fresh-seed images for the CNN (its "
                        "Blur IG and XRAI take about 0.4 and 1 s per image)")
    parser.add_argument("--scenes", type=int, default=200, help="held-out and fresh scenes each for the VLM")
    parser.add_argument("--resamples", type=int, default=RESAMPLES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only; leave claims.json and RESULTS.md")
    parser.add_argument("--save-values", type=Path, help="also save each part's per-image values to DIR/PART.pt")
    parser.add_argument("--load-values", type=Path, help="start from the per-image values in DIR/PART.pt (saved "
                        "by --save-values with the same counts): only the missing ones are computed")
    arguments = parser.parse_args(argv)
    torch.set_num_threads(arguments.threads)
    stored = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else {}
    for part in arguments.parts:
        started = time.perf_counter()
        saved = torch.load(arguments.load_values / f"{part}.pt") if arguments.load_values is not None else None
        if part == "vlm":
            if saved is not None:
                values, record = saved["values"], saved["record"]
            else:
                model_values, strata = vlm_values([arguments.scenes, arguments.scenes])
                values = {"demo-vlm": model_values}
                record = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "strata": strata,
                          "seconds": time.perf_counter() - started,
                          "command": f"python benchmarks/claims.py --threads {arguments.threads} --parts vlm "
                                     f"--scenes {arguments.scenes}"}
        else:
            fresh = arguments.cnn_fresh_images if part == "cnn" else arguments.fresh_images
            strata = [arguments.images, fresh]
            if saved is not None and saved["record"]["strata"] != strata:
                raise SystemExit(f"{arguments.load_values / f'{part}.pt'} holds {saved['record']['strata']} images, "
                                 f"not {strata}: give the counts it was saved with.")
            values = {}
            loaders = {"demo": load_demo_model} if part == "cnn" else {name: TRANSFORMERS[name].load
                                                                       for name in TRANSFORMERS}
            for model_name, wanted in needed(part).items():
                model = loaders[model_name]().eval()
                layer = "layer4" if part == "cnn" else last_block_layer(model)
                sets = [image_set(arguments.images, EVALUATION_SEED), image_set(fresh, FRESH_SEED)]
                cached = None if saved is None else saved["values"].get(model_name)
                values[model_name] = image_values(part, model_name, model, layer, sets, wanted, cached)
            seconds = time.perf_counter() - started + (0 if saved is None else saved["record"]["seconds"])
            unchanged = saved is not None and all(set(values[name]) == set(saved["values"].get(name, {}))
                                                  for name in values)
            record = saved["record"] if unchanged else {
                "date": time.strftime("%Y-%m-%d"), "machine": machine(), "strata": strata, "seconds": seconds,
                "command": f"python benchmarks/claims.py --threads {arguments.threads} --parts {part} --images "
                           f"{arguments.images} --{'cnn-' if part == 'cnn' else ''}fresh-images {fresh}"}
        if arguments.save_values is not None:
            arguments.save_values.mkdir(parents=True, exist_ok=True)
            torch.save({"values": values, "record": record}, arguments.save_values / f"{part}.pt")
        rows = evaluate_claims(part, values, record["strata"], arguments.resamples)
        stored[part] = {**record, "rows": rows}
        for row in rows:
            print(f"{row['key']}: {row['estimate']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}] "
                  f"per seed {[round(value, 4) for value in row['per_stratum']]} {row['verdict']}", flush=True)
        if not arguments.no_write:
            RESULTS_JSON.write_text(json.dumps(stored, indent=1, ensure_ascii=False) + "\n")
            write_section("Claims and their uncertainty", section(stored))


if __name__ == "__main__":
    main()
