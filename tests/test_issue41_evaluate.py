"""Issue 41, point 1: `explain evaluate` shows every metric's settings in its table and figure, takes the metrics'
options (--metric-option), --device, --layer and --option as `explain batch` does, marks the differences that lie
inside the standard error, and its progress bar counts images towards a total."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
import torch

import explain
from explain import metrics
from explain.cli import main
from explain.data import make_dataset
from explain.data.train import EVALUATION_SEED
from explain.dataset_tools.evaluation import METRICS, Evaluation

IMAGES = 16


def demo_data(count: int = IMAGES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The images `explain evaluate --data demo --images COUNT` evaluates, as the demo model takes them."""
    loaded = explain.load_model("demo")
    data = make_dataset(count, seed=EVALUATION_SEED)
    inputs = torch.stack([loaded.preprocess(image) for image in data.images])
    return inputs, torch.from_numpy(data.labels), torch.from_numpy(data.masks)


def csv_values(folder, method: str, metric: str) -> torch.Tensor:
    with open(folder / "evaluation.csv", encoding="utf-8") as values_file:
        rows = [row for row in csv.DictReader(values_file)  # a metric with other settings: "name(key=value)"
                if row["method"] == method and row["metric"].split("(")[0] == metric]
    rows.sort(key=lambda row: (int(row["batch"]), int(row["image"])))
    return torch.tensor([float(row["value"]) for row in rows], dtype=torch.float64)


def test_the_pointing_games_tolerance_is_shown_and_set_from_the_command_line(tmp_path, capsys):
    """LRP's peak often lies a pixel off the object: the table must say the game's tolerance, and
    --metric-option pointinggame.tolerance=1 must compute it with that tolerance (checked against the metric called
    by hand on LRP's maps of the same images)."""
    common = ["evaluate", "--model", "demo", "--methods", "lrp", "--metrics", "pointing_game", "sparseness",
              "--images", str(IMAGES), "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "strict")]) == 0
    strict_text = capsys.readouterr().out
    assert main([*common, "--metric-option", "pointinggame.tolerance=1", "--out", str(tmp_path / "tolerant")]) == 0
    tolerant_text = capsys.readouterr().out

    # the settings, in the printed table's heading and in evaluation.md, with what sparseness has (none)
    assert "| pointing_game ↑ (tolerance=0.0) | sparseness ↑ |" in strict_text
    assert "| pointing_game ↑ (tolerance=1) | sparseness ↑ |" in tolerant_text
    written = (tmp_path / "tolerant" / "evaluation.md").read_text(encoding="utf-8")
    assert "pointing_game ↑ (tolerance=1)" in written
    assert re.search(r"^- pointing_game \(higher is better; tolerance=1\)", written, flags=re.M)
    assert re.search(r"^- sparseness \(higher is better; no settings\)", written, flags=re.M)

    inputs, labels, masks = demo_data()
    maps = explain.LRP(explain.load_model("demo")).explain(inputs, target=labels)
    for folder, tolerance in (("strict", 0.0), ("tolerant", 1.0)):
        expected = metrics.pointing_game(maps, masks, tolerance=tolerance).double().cpu()
        assert torch.equal(csv_values(tmp_path / folder, "lrp", "pointing_game"), expected), folder
    strict = csv_values(tmp_path / "strict", "lrp", "pointing_game").mean()
    tolerant = csv_values(tmp_path / "tolerant", "lrp", "pointing_game").mean()
    assert tolerant > strict  # a pixel of tolerance counts the peaks beside the object: the ranking can turn on it
    assert f"{float(tolerant):.3f}" in tolerant_text and f"{float(strict):.3f}" in strict_text


def test_a_metric_option_that_does_not_exist_or_does_not_fit_is_refused_with_the_settings(tmp_path, capsys):
    base = ["evaluate", "--model", "demo", "--methods", "gradcam", "--metrics", "deletion", "--images", "4",
            "--no-progress", "--out", str(tmp_path / "out")]
    assert main([*base, "--metric-option", "deletion.tolerance=1"]) == 2
    assert "deletion has the settings steps=16" in capsys.readouterr().err
    assert main([*base, "--metric-option", "deletion.steps=many"]) == 2
    assert "deletion.steps takes int values (default 16)" in capsys.readouterr().err
    assert main([*base, "--metric-option", "insertion.steps=8"]) == 2
    assert "'insertion' is not one of the metrics evaluated (deletion)" in capsys.readouterr().err
    assert not (tmp_path / "out" / "evaluation.csv").exists()  # refused before anything ran


def test_device_layer_and_options_reach_the_methods_as_explain_batch_gives_them(tmp_path, capsys):
    """--layer goes to the CAMs only, --option KEY=VALUE to each method that takes KEY, METHOD:KEY=VALUE to that
    method; the maps (and so the values) are those of the explainers built so by hand."""
    out = tmp_path / "out"
    assert main(["evaluate", "--model", "demo", "--methods", "gradcam", "integratedgradients", "smoothgrad",
                 "--metrics", "sparseness", "--images", "8", "--device", "cpu", "--layer", "layer3",
                 "--option", "integratedgradients:steps=4", "--option", "samples=3", "--no-progress",
                 "--out", str(out)]) == 0
    record = json.loads((out / "evaluation.json").read_text(encoding="utf-8"))
    settings = dict(zip(record["methods"], record["explainers"]))
    assert "layer3" in settings["gradcam"]
    assert "steps=4" in settings["integratedgradients"] and "samples=3" in settings["smoothgrad"]
    assert "layer3" not in settings["integratedgradients"]  # the input-level methods take no layer

    loaded = explain.load_model("demo")
    inputs, labels, _ = demo_data(8)
    by_hand = explain.GradCAM(loaded, "layer3").explain(inputs, target=labels)
    assert torch.allclose(csv_values(out, "gradcam", "sparseness"), metrics.sparseness(by_hand).double(),
                          atol=1e-6)
    steps = explain.IntegratedGradients(loaded, steps=4).explain(inputs, target=labels)
    assert torch.allclose(csv_values(out, "integratedgradients", "sparseness"), metrics.sparseness(steps).double(),
                          atol=1e-6)

    capsys.readouterr()
    assert main(["evaluate", "--model", "demo", "--methods", "gradcam", "--option", "steps=4", "--images", "4",
                 "--out", str(tmp_path / "other")]) == 2
    assert "none of the methods takes 'steps'" in capsys.readouterr().err
    assert main(["evaluate", "--model", "demo", "--methods", "saliency", "--layer", "layer4", "--images", "4",
                 "--out", str(tmp_path / "other")]) == 2
    assert "none of the methods (saliency) explains a layer" in capsys.readouterr().err
    assert main(["evaluate", "--model", "demo", "--methods", "saliency", "--device", "tpu", "--images", "4",
                 "--out", str(tmp_path / "other")]) == 2
    assert "tpu" in capsys.readouterr().err


def evaluation_of(values: dict[str, dict[str, list[float]]], names: tuple[str, ...]) -> Evaluation:
    return Evaluation(list(values), [METRICS[name] for name in names],
                      {method: {name: torch.tensor(per[name], dtype=torch.float64) for name in names}
                       for method, per in values.items()})


def test_differences_inside_the_standard_error_are_marked_and_share_a_colour():
    """deletion: a 0.26 and b 0.29 with standard errors of about 0.06: their order is not settled (≈, one colour);
    c at 0.90 is set apart. sparseness: three means far apart, no mark. By hand: se = std / √n."""
    spread = [-0.12, 0.0, 0.12, 0.0]  # std 0.098, se 0.049 for 4 images
    values = {"a": {"deletion": [0.26 + x for x in spread], "sparseness": [0.9, 0.9, 0.9, 0.9]},
              "b": {"deletion": [0.29 + x for x in spread], "sparseness": [0.5, 0.5, 0.5, 0.5]},
              "c": {"deletion": [0.90 + x for x in spread], "sparseness": [0.1, 0.1, 0.1, 0.1]}}
    result = evaluation_of(values, ("deletion", "sparseness"))
    assert result.spread("a", "deletion") == pytest.approx(torch.tensor(spread).std().item() / 2)
    assert result.within_error() == {"deletion": [["a", "b"], ["c"]], "sparseness": [["a"], ["b"], ["c"]]}
    table = result.markdown()
    assert "| a | 0.260 ± 0.049 (1 ≈) | 0.900 ± 0.000 (1) |" in table
    assert "| b | 0.290 ± 0.049 (2 ≈) | 0.500 ± 0.000 (2) |" in table
    assert "| c | 0.900 ± 0.049 (3) | 0.100 ± 0.000 (3) |" in table

    figure = result.figure()
    axes = figure.axes[0]
    grid = axes.images[0].get_array()
    order = [label.get_text().split(" (")[0] for label in axes.get_yticklabels()]
    rows = {method: grid[order.index(method)] for method in order}
    assert rows["a"][0] == rows["b"][0] == 1.5 and rows["c"][0] == 3  # one colour for the pair inside the error
    assert [rows[method][1] for method in "abc"] == [1, 2, 3]
    texts = {text.get_text() for text in axes.texts}
    assert {"0.26 ≈", "0.29 ≈", "0.90", "0.50"} <= texts
    import matplotlib.pyplot as plt

    plt.close(figure)

    # the rule on other values: two methods 3 standard errors apart are set apart, 0.5 apart are not
    apart = evaluation_of({"p": {"insertion": [0.5 + x for x in spread]},
                           "q": {"insertion": [0.5 + 3 * math.hypot(0.049, 0.049) + x for x in spread]},
                           "r": {"insertion": [0.5 - 0.5 * 0.049 + x for x in spread]}}, ("insertion",))
    assert apart.within_error() == {"insertion": [["q"], ["p", "r"]]}
    assert "(1) |" in apart.markdown().splitlines()[2] and "≈" not in apart.markdown().splitlines()[2]


def test_the_figure_names_every_metrics_settings_and_the_model_may_be_a_loaded_one(tmp_path):
    loaded = explain.load_model("demo")
    inputs, labels, masks = demo_data(4)
    road = METRICS["road"].with_options(percentages=(0.2, 0.8))
    result = explain.evaluate(loaded, ["gradcam", "saliency"], (inputs, labels, masks),
                              ["pointing_game", road, "sparseness"], progress=False)
    figure = result.figure()
    labels_shown = [label.get_text() for label in figure.axes[0].get_xticklabels()]
    assert labels_shown[0].splitlines() == ["pointing_game ↑", "tolerance=0.0"]
    assert labels_shown[1].splitlines() == ["road ↓", "percentages=(0.2, 0.8)"]
    assert labels_shown[2] == "sparseness ↑"
    import matplotlib.pyplot as plt

    plt.close(figure)
    # the loaded model's preprocessing and class names went to the methods named
    by_hand = explain.GradCAM(loaded.model, preprocess=loaded.preprocess).explain(inputs, target=labels)
    assert torch.equal(result.values["gradcam"]["sparseness"], metrics.sparseness(by_hand).double().cpu())


def test_the_progress_bar_counts_images_towards_the_total(tmp_path, capsys):
    inputs, labels, masks = demo_data(6)
    model = explain.load_model("demo").model
    explain.evaluate(model, ["saliency"], (inputs, labels, masks), ["sparseness"], batch_size=4, progress=True)
    bar = capsys.readouterr().err
    assert re.search(r"evaluate: 100%\|.*\| 6/6 ", bar), bar[-500:]
    # a DataLoader: its data set's size
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels, masks), batch_size=4)
    explain.evaluate(model, ["saliency"], loader, ["sparseness"], progress=True)
    assert re.search(r"\| 6/6 ", capsys.readouterr().err)
