"""What a class-level map gets wrong on a detector, and per-instance maps get right: on held-out synthetic scenes
with two objects of one class ("twins"), the share of each instance's map energy inside its own box and inside its
twin's, for per-instance Grad-CAM, ODAM and D-RISE against class-level Grad-CAM (the gradient of the class's
scores summed over the detector's candidates: one map for both twins), on the shipped demo detector.

    python benchmarks/detection_instances.py [--scenes 150] [--seed 20261128] [--masks 500] [--write]

Energy share in a box: the map's sum inside the box over its sum over the image (maps ≥ 0, normalised). An instance
is explained by its ground-truth box and class (``explain.detection.Instances``), found again in the detector's
output as every explanation does. 95 % intervals: bootstrap over the twin instances (2,000 draws).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bootstrap, write_section  # noqa: E402

import explain  # noqa: E402
from explain.data.demo_detector import DETECTOR_CAM_LAYER, load_demo_detector  # noqa: E402
from explain.data.detection_scenes import make_detection_scenes  # noqa: E402
from explain.detection import Instances  # noqa: E402
from explain.io.inputs import Normalize  # noqa: E402


def twins(labels: np.ndarray) -> list[tuple[int, int]]:
    """(instance, its twin) pairs of a scene: the objects whose class occurs exactly twice, each once as the
    instance."""
    pairs = []
    for label in np.unique(labels):
        where = np.flatnonzero(labels == label)
        if len(where) == 2:
            pairs += [(int(where[0]), int(where[1])), (int(where[1]), int(where[0]))]
    return pairs


def box_share(map_: torch.Tensor, box: np.ndarray) -> float:
    """The share of a ≥ 0 map's sum inside ``box`` (x0, y0, x1, y1, exclusive right and bottom)."""
    total = float(map_.sum())
    if total <= 0:
        return 0.0
    x0, y0, x1, y1 = (int(round(float(value))) for value in box)
    return float(map_[y0:y1, x0:x1].sum()) / total


def class_level_target(label: int):
    """The class's scores summed over every candidate: what a class-level map explains."""
    def target(output):
        return output["scores"][..., label].sum(dim=1)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenes", type=int, default=150)
    parser.add_argument("--seed", type=int, default=20261128, help="held out: not the training script's seed")
    parser.add_argument("--masks", type=int, default=500)
    parser.add_argument("--write", action="store_true")
    arguments = parser.parse_args()
    torch.set_num_threads(2)
    model = load_demo_detector()
    scenes = make_detection_scenes(arguments.scenes, seed=arguments.seed)
    normalize = Normalize()
    methods = {
        "class-level Grad-CAM": explain.GradCAM(model, DETECTOR_CAM_LAYER),
        "per-instance Grad-CAM": explain.GradCAM(model, DETECTOR_CAM_LAYER),
        "ODAM": explain.ODAM(model, DETECTOR_CAM_LAYER),
        "D-RISE": explain.DRISE(model, masks=arguments.masks, progress=False),
    }
    own: dict[str, list[float]] = {name: [] for name in methods}
    twin: dict[str, list[float]] = {name: [] for name in methods}
    lost = 0
    for index in range(len(scenes.images)):
        labels, boxes = scenes.labels[index], scenes.boxes[index]
        pairs = twins(labels)
        if not pairs:
            continue
        batch = normalize(scenes.images[index])[None]
        for instance, other in pairs:
            given = Instances(torch.tensor(boxes[instance], dtype=torch.float32)[None, None],
                              torch.tensor([[int(labels[instance])]]), torch.full((1, 1), float("nan")),
                              torch.ones(1, 1, dtype=torch.bool))
            for name, explainer in methods.items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if name == "class-level Grad-CAM":
                        explanation = explainer.explain(batch, target=class_level_target(int(labels[instance])))
                    else:
                        explanation = explainer.explain(batch, instances=given)
                if name == "per-instance Grad-CAM" and any("zero everywhere" in str(w.message) for w in caught):
                    lost += 1
                map_ = explanation.maps[0] if explanation.maps.dim() == 3 else explanation.maps[0, 0]
                map_ = map_.clamp_min(0)
                own[name].append(box_share(map_, boxes[instance]))
                twin[name].append(box_share(map_, boxes[other]))
    rows = []
    for name in methods:
        mine, theirs = np.array(own[name]), np.array(twin[name])
        wins = (mine > theirs).astype(float)
        low, high = bootstrap(mine)
        win_low, win_high = bootstrap(wins)
        rows.append(f"| {name} | {mine.mean():.3f} [{low:.3f}, {high:.3f}] | {theirs.mean():.3f} | "
                    f"{100 * wins.mean():.1f} % [{100 * win_low:.1f}, {100 * win_high:.1f}] |")
    count = len(own["ODAM"])
    table = "\n".join(["| method | energy in its own box | in its twin's box | own box > twin's box |",
                       "| --- | ---: | ---: | ---: |", *rows])
    body = (f"`python benchmarks/detection_instances.py --scenes {arguments.scenes} --seed {arguments.seed} --masks "
            f"{arguments.masks}{' --write' if arguments.write else ''}`: the shipped demo detector "
            f"(`explain.data.load_demo_detector`, layer {DETECTOR_CAM_LAYER}) on {arguments.scenes} held-out scenes "
            f"(seed {arguments.seed}, 96 px), {count} instances that have a twin (another object of their class in "
            "the scene), each explained by its ground-truth box and class. Means with 95 % bootstrap intervals over "
            f"the instances. Instances the detector did not find (empty per-instance maps): {lost}.\n\n" + table)
    print(body)
    if arguments.write:
        write_section("Detectors: per-instance maps on twin objects", body)


if __name__ == "__main__":
    main()
