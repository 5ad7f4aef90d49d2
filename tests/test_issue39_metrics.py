"""Issue 39, points 8 and 12: metrics of a model with a single output, and `explain evaluate` over a folder.

Point 8: a binary classifier trained with a logit gives one column; a softmax over one column is 1 whatever the
input, so every "probability" metric scored every map the same. The probability of its class is sigmoid(logit)
(``explain.core.targets.class_probabilities``), in the metrics, in an explanation's probabilities and in
`explain batch`'s confidence column; a model with two or more classes keeps its softmax.

Point 12: `explain evaluate --data DIR` stacked images of different sizes into one batch (a raw RuntimeError) and
read its own output folder, when inside DIR, as images of a class on the rerun.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor, nn

import explain
from explain import metrics
from explain.cli import main
from explain.core.targets import class_probabilities
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.dataset_tools.batch import run
from explain.dataset_tools.evaluation import METRICS, evaluate
from explain.io.inputs import Normalize, load_image

SIDE = 8
TOP_LEFT = (slice(None), slice(None, SIDE // 2), slice(None, SIDE // 2))  # (N, H, W) index of the top-left quarter
BOTTOM_RIGHT = (slice(None), slice(SIDE // 2, None), slice(SIDE // 2, None))


class OneLogit(nn.Module):
    """A binary classifier of (N, 3, 8, 8) inputs with one logit,
    z = 8 · mean(channel 0 over the top-left quarter) − 4 · mean(channel 0 over the bottom-right quarter) − 2,
    given as ``form``: "column" (N, 1), "flat" (N,) (squeezed: () for one image), "dict" {"logits": (N, 1)},
    "zero" (N, 2) logits (z, 0), whose softmax is sigmoid(z), or "opposite" (N, 2) logits (z, −z), softmax σ(2z)."""

    def __init__(self, form: str = "column"):
        super().__init__()
        self.form = form
        self.features = nn.Conv2d(3, 1, SIDE)
        with torch.no_grad():
            self.features.weight.zero_()
            self.features.weight[0, 0, : SIDE // 2, : SIDE // 2] = 8 / (SIDE // 2) ** 2
            self.features.weight[0, 0, SIDE // 2 :, SIDE // 2 :] = -4 / (SIDE // 2) ** 2
            self.features.bias.fill_(-2.0)

    def forward(self, x: Tensor):
        logit = self.features(x).flatten(1)  # (N, 1)
        if self.form == "flat":
            return logit.squeeze()
        if self.form == "dict":
            return {"logits": logit}
        if self.form == "zero":
            return torch.cat([logit, torch.zeros_like(logit)], dim=1)
        if self.form == "opposite":
            return torch.cat([logit, -logit], dim=1)
        return logit


def image(top_left: float = 1.0, bottom_right: float = 1.0) -> Tensor:
    """(1, 3, 8, 8): channel 0 is ``top_left`` on the top-left quarter, ``bottom_right`` on the bottom-right one,
    0 elsewhere (z = 8 · top_left − 4 · bottom_right − 2; 2 for the default)."""
    x = torch.zeros(1, 3, SIDE, SIDE)
    x[0, 0, : SIDE // 2, : SIDE // 2] = top_left
    x[0, 0, SIDE // 2 :, SIDE // 2 :] = bottom_right
    return x


def maps(good: bool) -> Tensor:
    """(1, 8, 8): the good map is +1 where the class is (top left), −1 where it is contradicted (bottom right), 0
    elsewhere; the bad map is its opposite."""
    values = torch.zeros(1, SIDE, SIDE)
    values[TOP_LEFT], values[BOTTOM_RIGHT] = 1.0, -1.0
    return values if good else -values


def sigma(logits: list[float]) -> Tensor:
    return torch.sigmoid(torch.tensor([logits]))


def trapezoid(curve: Tensor) -> Tensor:
    """(N, S) → (N,) the area under curves over S equally spaced fractions in [0, 1]."""
    return ((curve[:, 1:] + curve[:, :-1]) / 2).mean(dim=1)


# ------------------------------------------------------------------ point 8: the metrics, by hand

FORMS = ["column", "flat", "dict"]


def test_class_probabilities_is_the_sigmoid_of_one_column_and_the_softmax_of_several():
    logits = torch.tensor([[2.0], [-6.0]])
    torch.testing.assert_close(class_probabilities(logits), torch.sigmoid(logits))
    several = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    torch.testing.assert_close(class_probabilities(several), several.softmax(dim=1))


@pytest.mark.parametrize("form", FORMS)
def test_deletion_insertion_and_selectivity_follow_sigmoid_of_the_logit(form):
    """By hand: deleting the top-left quarter (16 of the 64 pixels, the good map's first step of 4) makes the
    logit 0 − 4 − 2 = −6; the bad map deletes the bottom-right first: 8 − 0 − 2 = 6; all deleted: −2. Inserting
    into zeros runs the other way. Selectivity with 4 × 4 patches removes the same quarters, one patch a step."""
    model, x = OneLogit(form), image()
    good, bad = maps(True), maps(False)
    expected = {True: sigma([2, -6, -6, -6, -2]), False: sigma([2, 6, 6, 6, -2])}
    for is_good, given in ((True, good), (False, bad)):
        curve = metrics.deletion(model, x, given, steps=4, substrate="zeros")
        torch.testing.assert_close(curve.curves, expected[is_good])
        torch.testing.assert_close(curve.area, trapezoid(expected[is_good]))
        patches = metrics.selectivity(model, x, given, patch_size=SIDE // 2, substrate="zeros")
        torch.testing.assert_close(patches.curves.cpu(), expected[is_good])
        inserted = metrics.insertion(model, x, given, steps=4, substrate="zeros")
        torch.testing.assert_close(inserted.curves, sigma([-2, 6, 6, 6, 2] if is_good else [-2, -6, -6, -6, 2]))
    assert metrics.deletion(model, x, good, steps=4, substrate="zeros").area < \
        metrics.deletion(model, x, bad, steps=4, substrate="zeros").area


@pytest.mark.parametrize("form", FORMS)
def test_confidence_change_monotonicity_and_irof_follow_sigmoid_of_the_logit(form):
    """By hand. Confidence: the good map (clipped to [0, 1]) keeps the top-left quarter alone: z = 6 > 2, no drop,
    an increase; the bad one keeps the bottom-right: z = −6, drop (σ(2) − σ(−6)) / σ(2). Monotonicity (4 groups,
    least relevant first, into zeros): the good map restores the bottom right first (−6, −6, −6, then 2: never
    falls), the bad map the top left (6, 6, 6, then 2: falls). IROF over the 4 quarters: the relative curve
    σ(z_k) / σ(2) and 1 − its area."""
    model, x = OneLogit(form), image()
    good, bad = maps(True), maps(False)
    change_good = metrics.confidence_change(model, x, good)
    change_bad = metrics.confidence_change(model, x, bad)
    assert change_good.drop.item() == 0.0 and change_good.increase.item() == 1.0
    by_hand = (torch.sigmoid(torch.tensor(2.0)) - torch.sigmoid(torch.tensor(-6.0))) / torch.sigmoid(torch.tensor(2.0))
    torch.testing.assert_close(change_bad.drop, by_hand.view(1))
    assert change_bad.increase.item() == 0.0

    rising = metrics.monotonicity(model, x, good, steps=4, substrate="zeros")
    falling = metrics.monotonicity(model, x, bad, steps=4, substrate="zeros")
    torch.testing.assert_close(rising.curves.cpu(), sigma([-6, -6, -6, 2]))
    torch.testing.assert_close(falling.curves.cpu(), sigma([6, 6, 6, 2]))
    assert rising.monotonic.item() == 1.0 and falling.monotonic.item() == 0.0

    quarters = torch.zeros(1, SIDE, SIDE, dtype=torch.long)
    quarters[:, : SIDE // 2, SIDE // 2 :], quarters[:, SIDE // 2 :, : SIDE // 2], quarters[BOTTOM_RIGHT] = 1, 2, 3
    for given, logits in ((good, [2, -6, -6, -6, -2]), (bad, [2, 6, 6, 6, -2])):
        result = metrics.irof(model, x, given, segments=quarters, substrate="zeros")
        relative = sigma(logits) / torch.sigmoid(torch.tensor(2.0))
        torch.testing.assert_close(result.curves[0].cpu()[None], relative)
        torch.testing.assert_close(result.area_over_curve.cpu(), 1 - trapezoid(relative))


@pytest.mark.parametrize("form", FORMS)
def test_road_scores_a_good_map_below_a_bad_one(form):
    """ROAD (noise off, a quarter removed and imputed from its neighbours, which are 0 but one corner): removing
    the top-left quarter lowers the logit towards −6, removing the bottom-right raises it towards 6."""
    model, x = OneLogit(form), image()
    good = metrics.road(model, x, maps(True), percentages=(0.25,), noise=0.0).area.item()
    bad = metrics.road(model, x, maps(False), percentages=(0.25,), noise=0.0).area.item()
    assert good < torch.sigmoid(torch.tensor(-4.0)).item() and bad > torch.sigmoid(torch.tensor(4.0)).item()


@pytest.mark.parametrize("form, probability", [("zero", lambda z: torch.sigmoid(z)),
                                               ("opposite", lambda z: torch.sigmoid(2 * z))])
def test_two_class_models_keep_their_softmax(form, probability):
    """Regression guard: with two columns the probability is still the softmax, softmax(z, 0)₀ = σ(z) (the same
    curve as the one-logit model) and softmax(z, −z)₀ = σ(2z) (not σ(z))."""
    model, x = OneLogit(form), image()
    curve = metrics.deletion(model, x, maps(True), steps=4, substrate="zeros")
    torch.testing.assert_close(curve.curves, probability(torch.tensor([[2.0, -6, -6, -6, -2]])))
    drop = metrics.confidence_change(model, x, maps(False)).drop
    torch.testing.assert_close(drop, 1 - probability(torch.tensor([-6.0])) / probability(torch.tensor([2.0])))


def test_evaluate_ranks_a_one_logit_model_on_its_sigmoid_not_on_constants():
    """Input × gradient, signed (reduce="sum": +0.5 · x on the top left, −0.25 · x on the bottom right) or by
    magnitude (the default), on images whose bottom right is bright and top left dim (0.25 · x_br > 0.5 · x_tl):
    the signed map calls the top left most relevant and the bottom right least, the magnitude puts the bottom
    right first. Each of the seven probability metrics gives the two different values, and ranks them (with a
    softmax over one column every one was the same constant for both methods, 1 or 0, and every rank a tie).
    Monotonicity in groups of a quarter: the signed map restores the bottom right (its negative evidence) in the
    first group, the score never falls; the magnitude restores it last, after the top left, and it falls."""
    model = OneLogit()
    x = torch.cat([image(0.4, 1.0), image(0.5, 1.5), image(0.3, 0.9)])
    y = torch.zeros(3, dtype=torch.long)
    four_groups = METRICS["monotonicity"].with_options(steps=4)  # a quarter a group: the bottom right restored at once
    chosen = ["deletion", "insertion", "road", "confidence_drop", four_groups, "selectivity", "irof"]
    methods = {"signed": explain.InputXGradient(model, reduce="sum"), "magnitude": explain.InputXGradient(model)}
    result = evaluate(model, methods, (x, y), chosen, progress=False)
    ranks = result.ranks()
    for metric in result.metrics:
        name = metric.name
        assert result.mean("signed", name) != result.mean("magnitude", name), name
        assert ranks["signed"][name] == 1.0 and ranks["magnitude"][name] == 2.0, name
    assert result.mean("signed", four_groups.name) == 1.0 and result.mean("magnitude", four_groups.name) == 0.0


# ------------------------------------------------------------------ point 8: explain batch and explanations


def to_unit_tensor(picture: Image.Image) -> Tensor:
    return torch.from_numpy(np.asarray(picture, dtype=np.float32) / 255).permute(2, 0, 1)


def write_pictures(folder: Path) -> dict[str, float]:
    """Two 8 × 8 PNGs whose red channel is the model's channel 0; each file's logit z by hand."""
    folder.mkdir()
    logits = {}
    for name, (top_left, bottom_right) in {"bright.png": (255, 255), "contradicted.png": (0, 255)}.items():
        pixels = np.zeros((SIDE, SIDE, 3), dtype=np.uint8)
        pixels[: SIDE // 2, : SIDE // 2, 0] = top_left
        pixels[SIDE // 2 :, SIDE // 2 :, 0] = bottom_right
        Image.fromarray(pixels).save(folder / name)
        logits[name] = 8 * top_left / 255 - 4 * bottom_right / 255 - 2
    return logits


@pytest.mark.parametrize("target", [None, 0])
def test_batch_confidence_and_probability_of_a_one_logit_model_are_the_sigmoid(tmp_path, target):
    """`explain batch`'s index: "probability" (the explained class's, from the explanation) and "confidence" (the
    predicted class's; with a given target from its own forward pass) are σ(z): σ(2) and σ(−6), not 1.0."""
    logits = write_pictures(tmp_path / "images")
    explainer = explain.Saliency(OneLogit(), preprocess=to_unit_tensor)
    run(explainer, tmp_path / "images", tmp_path / "out", target=target, progress=False)
    with open(tmp_path / "out" / "index.csv", newline="", encoding="utf-8") as file:
        rows = {Path(row["image"]).name: row for row in csv.DictReader(file)}
    assert set(rows) == set(logits)
    for name, z in logits.items():
        assert float(rows[name]["confidence"]) == pytest.approx(1 / (1 + math.exp(-z)), rel=1e-5)
        assert float(rows[name]["probability"]) == pytest.approx(1 / (1 + math.exp(-z)), rel=1e-5)


def test_batch_confidence_of_a_two_class_model_stays_the_softmax(tmp_path):
    """Regression guard: logits (z, 0): the top class of "contradicted" (z = −6) is class 1, softmax σ(6)."""
    write_pictures(tmp_path / "images")
    explainer = explain.Saliency(OneLogit("zero"), preprocess=to_unit_tensor)
    run(explainer, tmp_path / "images", tmp_path / "out", target=0, progress=False)
    with open(tmp_path / "out" / "index.csv", newline="", encoding="utf-8") as file:
        rows = {Path(row["image"]).name: row for row in csv.DictReader(file)}
    assert rows["contradicted.png"]["predicted"] == "1"
    assert float(rows["contradicted.png"]["confidence"]) == pytest.approx(1 / (1 + math.exp(-6)), rel=1e-5)
    assert float(rows["bright.png"]["confidence"]) == pytest.approx(1 / (1 + math.exp(-2)), rel=1e-5)


def test_sufficiency_of_a_one_logit_model_compares_the_sign_of_the_logit():
    """Sufficiency counts the close maps whose image gets the same prediction: for one logit, the same side of 0
    (the top class of one column is always 0, which made every pair agree). Four images, all maps alike: two
    positive (z = 2), two negative (z = −6): each has one agreeing neighbour among three, 1/3."""
    model = OneLogit()
    x = torch.cat([image(), image(), image(0.0, 1.0), image(0.0, 1.0)])
    alike = maps(True).expand(4, -1, -1) + torch.arange(4.0).view(4, 1, 1) * 1e-3
    values = metrics.sufficiency(model, x, alike, threshold=1.0, distance="euclidean")
    torch.testing.assert_close(values, torch.full((4,), 1 / 3))


# ------------------------------------------------------------------ point 12: explain evaluate over a folder


def shapes_folder(folder: Path, crops: dict[int, tuple[int, int]]) -> list[Path]:
    """Class folders of the demo's shapes ("disc", "square"), three PNGs each; image i is cropped to
    ``crops[i]`` (height, width) from its top-left corner, else left 64 × 64. The files, in sorted order."""
    data = make_dataset(6, seed=5)
    files = []
    for index, pixels in enumerate(data.images):
        folder_name = ("disc", "square")[index % 2]
        (folder / folder_name).mkdir(parents=True, exist_ok=True)
        height, width = crops.get(index // 2, (64, 64))
        path = folder / folder_name / f"{index // 2}.png"
        Image.fromarray(pixels[:height, :width]).save(path)
        files.append(path)
    return sorted(files)


def values_by_batch(values_file: Path) -> dict[tuple[int, str], list[float]]:
    with open(values_file, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    found: dict[tuple[int, str], list[float]] = {}
    for row in rows:
        found.setdefault((int(row["batch"]), row["metric"]), []).append(float(row["value"]))
    return found


def test_evaluate_command_takes_images_of_two_sizes_in_batches_of_one_size_and_resumes_with_out_inside(
        tmp_path, capsys):
    """Images 1 of each class are 48 × 56, the others 64 × 64; the demo model's preprocessing keeps the size.
    Batch 0 is the four 64 × 64 images (in file order), batch 1 the two 48 × 56: their values are those of
    ``explain.evaluate`` on each group as one tensor. The rerun, with --out inside --data, reads neither
    evaluation.png nor the folder as a class, resumes and computes nothing."""
    data = tmp_path / "data"
    files = shapes_folder(data, {1: (48, 56)})
    out = data / "ev"
    command = ["evaluate", "--model", "demo", "--methods", "saliency", "--metrics", "sparseness", "deletion",
               "--data", str(data), "--out", str(out), "--batch-size", "4", "--no-progress"]
    assert main(command) == 0
    first = capsys.readouterr().out
    found = values_by_batch(out / "evaluation.csv")
    assert sorted({batch for batch, _ in found}) == [0, 1]

    model, preprocess = load_demo_model(), Normalize()
    index_of = {name: position for position, name in enumerate(CLASS_NAMES)}
    groups = {0: [path for path in files if path.stem != "1"], 1: [path for path in files if path.stem == "1"]}
    for batch, paths in groups.items():
        inputs = torch.stack([preprocess(load_image(path)) for path in paths])
        labels = torch.tensor([index_of[path.parent.name] for path in paths])
        expected = evaluate(model, {"saliency": explain.Saliency(model)}, (inputs, labels),
                            ["sparseness", "deletion"], batch_size=4, progress=False)
        for metric in ("sparseness", "deletion"):
            torch.testing.assert_close(torch.tensor(found[(batch, metric)], dtype=torch.float64),
                                       expected.values["saliency"][metric], rtol=1e-5, atol=1e-7)

    assert (out / "evaluation.png").is_file()
    before = (out / "evaluation.csv").read_bytes()
    assert main(command) == 0
    assert capsys.readouterr().out == first
    assert (out / "evaluation.csv").read_bytes() == before


def test_evaluate_command_rerun_with_out_inside_a_class_folder(tmp_path, capsys):
    """The rule on another place: --out inside a class folder (data/square/results). Its evaluation.png would be
    read as a square on the rerun (batch 0 then differs from the recorded one, an error); left out, it resumes."""
    data = tmp_path / "data"
    shapes_folder(data, {})
    out = data / "square" / "results"
    command = ["evaluate", "--model", "demo", "--methods", "saliency", "--metrics", "sparseness", "--data",
               str(data), "--out", str(out), "--batch-size", "8", "--no-progress"]
    assert main(command) == 0
    before = (out / "evaluation.csv").read_bytes()
    assert len(values_by_batch(out / "evaluation.csv")[(0, "sparseness")]) == 6
    assert main(command) == 0, capsys.readouterr().err
    assert (out / "evaluation.csv").read_bytes() == before


def test_folder_batches_hold_one_size_each_and_every_image_once(tmp_path, monkeypatch):
    """Three sizes in turn (64 × 64, 48 × 56, 40 × 64, twice each; file order disc/0, disc/1, disc/2, square/0,
    square/1, square/2), batches of 2: each size's pair is given when it is full. With at most one batch's worth
    of images waiting (PENDING_BATCHES = 1), by hand: a third waiting image gives the one waiting longest alone,
    so every image goes alone, in file order. Every batch has one size, every image comes once with its class."""
    from explain import cli
    from explain.models import load_model

    files = shapes_folder(tmp_path / "data", {1: (48, 56), 2: (40, 64)})
    loaded = load_model("demo")

    def check(batches: list[tuple[Tensor, Tensor]], order: list[int], count: int) -> None:
        sizes = [tuple(inputs.shape) for inputs, _ in batches]
        assert sizes == [(count, 3, height, width) for height, width in [(64, 64), (48, 56), (40, 64)] * (2 // count)]
        expected_order = [files[index] for index in order]
        given = torch.cat([inputs.flatten(1)[:, :64] for inputs, _ in batches])
        expected = torch.stack([loaded.preprocess(load_image(path)).flatten()[:64] for path in expected_order])
        torch.testing.assert_close(given, expected)
        labels = torch.cat([batch_labels for _, batch_labels in batches]).tolist()
        assert labels == [CLASS_NAMES.index(path.parent.name) for path in expected_order]

    check(list(cli._folder_batches(tmp_path / "data", loaded, 2)), [0, 3, 1, 4, 2, 5], 2)
    monkeypatch.setattr(cli, "PENDING_BATCHES", 1)
    check(list(cli._folder_batches(tmp_path / "data", loaded, 2)), [0, 1, 2, 3, 4, 5], 1)
