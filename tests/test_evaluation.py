"""explain.evaluate / `explain evaluate`: the method × metric table equals the metrics called one by one, ranks as
worked out by hand (ties, metrics that do not apply), resuming after a kill computes only what is missing and gives
the same table, and the command writes the table and the figure."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

import explain
from explain import metrics
from explain.cli import main
from explain.data import make_dataset
from explain.data.train import EVALUATION_SEED, to_model_input
from explain.dataset_tools.evaluation import METRICS, Evaluation, Metric, evaluate


@pytest.fixture(scope="module")
def demo():
    model = explain.load_model("demo").model
    data = make_dataset(8, seed=EVALUATION_SEED)
    return model, to_model_input(data.images), torch.from_numpy(data.labels), torch.from_numpy(data.masks)


class Counting(explain.Saliency):
    """Saliency that counts its calls."""

    calls = 0

    def explain(self, *args, **kwargs):
        Counting.calls += 1
        return super().explain(*args, **kwargs)


def test_the_values_are_the_metrics_called_one_by_one(demo):
    model, x, y, masks = demo
    result = evaluate(model, ["gradcam", "integratedgradients"], (x, y, masks),
                      metrics=["deletion", "pointing_game", "sparseness", "completeness"], batch_size=4,
                      progress=False)
    for name in ("gradcam", "integratedgradients"):
        explainer = explain.get_method(name)(model, progress=False)
        parts = [explainer.explain(x[i:i + 4], target=y[i:i + 4]) for i in (0, 4)]
        expected = {
            "deletion": torch.cat([metrics.deletion(model, x[i:i + 4], part, y[i:i + 4], steps=16).area
                                   for i, part in zip((0, 4), parts)]),
            "pointing_game": torch.cat([metrics.pointing_game(part, masks[i:i + 4]) for i, part in zip((0, 4), parts)]),
            "sparseness": torch.cat([metrics.sparseness(part) for part in parts]),
        }
        for metric, values in expected.items():
            torch.testing.assert_close(result.values[name][metric], values.double().cpu(), rtol=1e-6, atol=1e-9)
    # completeness needs input attributions: NaN (shown "–", not ranked) for Grad-CAM; Integrated Gradients ≈ 0
    assert torch.isnan(result.values["gradcam"]["completeness"]).all()
    assert result.values["integratedgradients"]["completeness"].mean() < 0.05
    assert math.isnan(result.ranks()["gradcam"]["completeness"])
    assert result.ranks()["integratedgradients"]["completeness"] == 1
    assert "| –" in result.markdown().splitlines()[2] or "| –" in result.markdown().splitlines()[3]


def test_ranks_and_the_mean_rank_as_worked_out_by_hand():
    higher, lower = METRICS["insertion"], METRICS["deletion"]
    values = {
        "a": {"insertion": torch.tensor([0.75, 0.25]), "deletion": torch.tensor([0.25, 0.25])},  # means 0.5, 0.25
        "b": {"insertion": torch.tensor([0.5, 0.5]), "deletion": torch.tensor([0.125, 0.125])},  # 0.5 (tie), 0.125
        "c": {"insertion": torch.tensor([0.0, 0.25]), "deletion": torch.tensor([math.nan, math.nan])},  # 0.125, n/a
    }
    result = Evaluation(["a", "b", "c"], [higher, lower], values)
    ranks = result.ranks()
    assert ranks["a"]["insertion"] == ranks["b"]["insertion"] == 1.5 and ranks["c"]["insertion"] == 3
    assert ranks["b"]["deletion"] == 1 and ranks["a"]["deletion"] == 2 and math.isnan(ranks["c"]["deletion"])
    assert result.mean_rank() == {"a": 1.75, "b": 1.25, "c": 3.0}
    assert result.spread("a", "insertion") == pytest.approx(torch.tensor([0.75, 0.25]).std().item() / math.sqrt(2))
    table = result.markdown().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["b", "a", "c"]  # best mean rank first


def test_a_run_killed_while_writing_resumes_with_only_what_is_missing(demo, tmp_path):
    model, x, y, masks = demo
    chosen = ["deletion", "sparseness", "pointing_game"]
    whole = evaluate(model, {"saliency": explain.Saliency(model)}, (x, y, masks), chosen, batch_size=2,
                     progress=False)
    out = tmp_path / "evaluation"
    evaluate(model, {"saliency": Counting(model)}, (x, y, masks), chosen, out=out, batch_size=2, progress=False)
    values_file = out / "evaluation.csv"
    lines = values_file.read_text(encoding="utf-8").splitlines(keepends=True)
    rows_per_group = 2 * len(chosen)
    # a kill during the last group's write: its last metric half written, the last line torn
    values_file.write_text("".join(lines[: 1 + 3 * rows_per_group + rows_per_group - 1])[:-5], encoding="utf-8")
    Counting.calls = 0
    resumed = evaluate(model, {"saliency": Counting(model)}, (x, y, masks), chosen, out=out, batch_size=2,
                       progress=False)
    assert Counting.calls == 1  # only the fourth batch again
    for metric in chosen:
        torch.testing.assert_close(resumed.values["saliency"][metric], whole.values["saliency"][metric])
    with open(values_file, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 4 * rows_per_group  # no group twice
    assert (out / "evaluation.md").is_file() and (out / "evaluation.png").is_file()
    with pytest.raises(ValueError, match="other settings.*metrics"):
        evaluate(model, {"saliency": Counting(model)}, (x, y, masks), ["deletion"], out=out, batch_size=2,
                 progress=False)


def test_bad_arguments_get_clear_errors(demo):
    model, x, y, masks = demo
    with pytest.raises(ValueError, match="unknown metric 'delete'"):
        evaluate(model, ["saliency"], (x, y), ["delete"], progress=False)
    with pytest.raises(ValueError, match="need the objects' masks"):
        evaluate(model, ["saliency"], (x, y), ["pointing_game"], progress=False)
    with pytest.raises(ValueError, match="labels \\(N,\\)"):
        evaluate(model, ["saliency"], (x, y[:3]), ["sparseness"], progress=False)
    with pytest.raises(ValueError, match="unknown method"):
        evaluate(model, ["salency"], (x, y), ["sparseness"], progress=False)


def test_the_command_writes_the_table_and_the_figure_for_four_methods_and_eight_metrics(tmp_path, capsys):
    out = tmp_path / "evaluation"
    eight = ["deletion", "insertion", "confidence_drop", "pointing_game", "energy_pointing_game", "top_k_intersection",
             "sparseness", "complexity"]
    assert main(["evaluate", "--model", "demo", "--methods", "gradcam", "saliency", "lrp", "inputxgradient",
                 "--metrics", *eight, "--images", "4", "--batch-size", "4", "--out", str(out), "--no-progress"]) == 0
    table = (out / "evaluation.md").read_text(encoding="utf-8")
    header = table.splitlines()[0]
    assert header.count("|") == 8 + 3  # method, 8 metrics, mean rank
    assert all(f"| {method} |" in table for method in ("gradcam", "saliency", "lrp", "inputxgradient"))
    assert (out / "evaluation.png").stat().st_size > 10_000
    assert "mean rank" in capsys.readouterr().out
    assert main(["evaluate", "--model", "demo", "--methods", "gradcam", "--out", str(tmp_path / "other"),
                 "--data", str(tmp_path / "missing")]) == 2


# ------------------------------------------------------------------ every metric of explain.metrics, by name

SMALL = {
    # name: (settings small enough for a test, the function of explain.metrics called directly with them)
    "road_combined": ({"percentages": (0.2, 0.6)},
                      lambda c: metrics.road_combined(c.model, c.x, c.e, c.y, percentages=(0.2, 0.6))),
    "confidence_increase": ({}, lambda c: metrics.confidence_change(c.model, c.x, c.e, c.y).increase),
    "masked_score_change": ({}, lambda c: metrics.masked_score_change(c.model, c.x, c.e, c.y).change),
    "faithfulness_correlation": ({"runs": 4, "subset_size": 64}, lambda c: metrics.faithfulness_correlation(
        c.model, c.x, c.e, c.y, runs=4, subset_size=64, generator=c.seeded())),
    "faithfulness_estimate": ({"steps": 4}, lambda c: metrics.faithfulness_estimate(c.model, c.x, c.e, c.y, steps=4)),
    "monotonicity": ({"steps": 4}, lambda c: metrics.monotonicity(c.model, c.x, c.e, c.y, steps=4).monotonic),
    "monotonicity_correlation": ({"steps": 4, "samples": 2}, lambda c: metrics.monotonicity_correlation(
        c.model, c.x, c.e, c.y, steps=4, samples=2, generator=c.seeded())),
    "region_perturbation": ({"grid": 4, "regions": 4}, lambda c: metrics.region_perturbation(
        c.model, c.x, c.e, c.y, patch_size=16, regions=4).aopc),  # 64 px in a 4 × 4 grid: 16-px patches
    "selectivity": ({"grid": 4}, lambda c: metrics.selectivity(c.model, c.x, c.e, c.y, patch_size=16).area),
    "irof": ({}, lambda c: metrics.irof(c.model, c.x, c.e, c.y).area_over_curve),
    "sensitivity_n": ({"runs": 3, "subset_sizes": (16, 256)}, lambda c: metrics.sensitivity_n(
        c.model, c.x, c.e, c.y, runs=3, subset_sizes=[16, 256], generator=c.seeded()).correlations.mean(dim=1)),
    "infidelity": ({"samples": 4}, lambda c: metrics.infidelity(c.model, c.x, c.e, c.y, samples=4, noise=0.1,
                                                                normalize=True, generator=c.seeded())),
    "sufficiency": ({}, lambda c: metrics.sufficiency(c.model, c.x, c.e, threshold=0.6)),
    "arcc": ({}, lambda c: metrics.arcc(c.explainer, c.x, c.e, c.y).arcc),
    "non_sensitivity": ({"grid": 4}, lambda c: metrics.non_sensitivity(c.model, c.x, c.e, c.y, patch_size=16)),
    "random_logit": ({}, lambda c: metrics.random_logit(c.explainer, c.x, c.y, generator=c.seeded()).similarity),
    "efficient_mprt": ({}, lambda c: metrics.efficient_mprt(c.explainer, c.x, c.y, bins=100).rise),
    "cascading_randomization": ({}, lambda c: torch.stack(
        [stage.rank_correlation for stage in metrics.cascading_randomization(c.explainer, c.x, c.y)]).mean(dim=0)),
    "smooth_mprt": ({"samples": 2}, lambda c: torch.stack([stage.rank_correlation for stage in metrics.smooth_mprt(
        c.explainer, c.x, c.y, samples=2, noise_level=0.1, generator=c.seeded())]).mean(dim=0)),
    "max_sensitivity": ({"samples": 2}, lambda c: metrics.max_sensitivity(c.explainer, c.x, c.y, samples=2,
                                                                          radius=0.2, generator=c.seeded())),
    "avg_sensitivity": ({"samples": 2}, lambda c: metrics.avg_sensitivity(c.explainer, c.x, c.y, samples=2,
                                                                          radius=0.2, generator=c.seeded())),
    "local_lipschitz_estimate": ({"samples": 2}, lambda c: metrics.local_lipschitz_estimate(
        c.explainer, c.x, c.y, samples=2, std=0.1, generator=c.seeded())),
    "relative_input_stability": ({"samples": 2}, lambda c: metrics.relative_input_stability(
        c.explainer, c.x, c.y, samples=2, radius=0.2, generator=c.seeded())),
    "relative_output_stability": ({"samples": 2}, lambda c: metrics.relative_output_stability(
        c.explainer, c.x, c.y, samples=2, radius=0.2, generator=c.seeded())),
    "relative_representation_stability": ({"samples": 2}, lambda c: metrics.relative_representation_stability(
        c.explainer, c.x, c.y, layers="layer4", samples=2, radius=0.2, generator=c.seeded())),  # the demo's CAM layer
    "continuity": ({"shares": (-0.25, 0.125)}, lambda c: metrics.continuity(c.explainer, c.x, c.y, shifts=[-16, 8])),
    "relevance_mass_accuracy": ({}, lambda c: metrics.relevance_mass_accuracy(c.e, c.masks)),
    "effective_complexity": ({}, lambda c: metrics.effective_complexity(c.e, eps=1e-5)),
}
LEFT_OUT = {"focus", "consistency"}
"""The metrics of explain.metrics that evaluate cannot run per image (the registry's docstring and
docs/evaluation.md say why)."""
# confidence_change is confidence_drop and _increase
HELPERS = {"boxes_to_masks", "instance_boxes", "make_mosaics", "noisy_linear_imputation", "patch_grid",
           "slic_segments", "spearman", "ssim", "substrate_for", "confidence_change"}


class Batch:
    """One batch as the metrics are called on it by hand: its index b seeds the random draws."""

    def __init__(self, model, explainer, x, y, masks, b):
        self.model, self.explainer, self.x, self.y, self.masks, self.b = model, explainer, x, y, masks, b
        self.e = explainer.explain(x, target=y)

    def seeded(self):
        return torch.Generator().manual_seed(self.b)


def test_every_metric_of_explain_metrics_is_registered_or_left_out_with_its_reason():
    functions = {name for name in metrics.__all__ if name[0].islower()}
    assert functions - HELPERS - LEFT_OUT <= set(METRICS)
    assert {"confidence_drop", "confidence_increase"} <= set(METRICS)
    page = (Path(__file__).resolve().parent.parent / "docs" / "evaluation.md").read_text(encoding="utf-8")
    for name in LEFT_OUT:
        assert f"`{name}`" in page and name not in METRICS
    for metric in METRICS.values():  # the docs' table lists every registered metric
        assert f"`{metric.name}`" in page, metric.name
        assert metric.better in ("higher", "lower") and metric.measures


def test_each_new_metric_by_name_equals_its_function_called_with_the_same_settings_and_seed(demo):
    model, x, y, masks = demo
    x, y, masks = x[:4], y[:4], masks[:4]
    chosen = {name: METRICS[name].with_options(**options) for name, (options, _) in SMALL.items()}
    saliency = explain.Saliency(model, progress=False)
    result = evaluate(model, {"saliency": saliency}, (x, y, masks), list(chosen.values()), batch_size=4,
                      progress=False)
    batch = Batch(model, saliency, x, y, masks, 0)
    for name, (_, direct) in SMALL.items():
        expected = direct(batch).reshape(-1).double().cpu()
        torch.testing.assert_close(result.values["saliency"][chosen[name].name], expected, rtol=1e-6, atol=1e-9,
                                   msg=name)
    # a CAM's raw maps are taken as they are; the draws of batch b come from a generator seeded with b
    gradcam = explain.GradCAM(model, "layer4", progress=False)
    two = [chosen["faithfulness_correlation"], chosen["relative_representation_stability"]]
    cam = evaluate(model, {"gradcam": gradcam}, (x, y, masks), two, batch_size=2, progress=False)
    cam_batches = [Batch(model, gradcam, x[i:i + 2], y[i:i + 2], masks[i:i + 2], b) for b, i in enumerate((0, 2))]
    for metric, name in zip(two, ("faithfulness_correlation", "relative_representation_stability")):
        expected = torch.cat([SMALL[name][1](batch) for batch in cam_batches]).double().cpu()
        torch.testing.assert_close(cam.values["gradcam"][metric.name], expected, rtol=1e-6, atol=1e-9)
    with_seed_0 = metrics.faithfulness_correlation(model, x[2:4], cam_batches[1].e, y[2:4], runs=4, subset_size=64,
                                                   generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(with_seed_0.double().cpu(), cam.values["gradcam"][two[0].name][2:])


class RandomMaps(explain.Saliency):
    """A baseline that knows nothing: its attributions, and so its maps, are uniform noise drawn anew at each call."""

    def __init__(self, model):
        super().__init__(model, reduce="sum", progress=False)
        self.draws = torch.Generator().manual_seed(0)

    def attribute(self, batch, target, topk):
        attribution = super().attribute(batch, target, topk)
        attribution.attributions = torch.rand(attribution.attributions.shape, generator=self.draws) * 2 - 1
        attribution.maps = attribution.attributions.sum(dim=2)
        return attribution


def test_higher_or_lower_is_better_as_the_known_best_map_of_a_linear_model_ranks_first():
    """f(x) = w·x + b: Input × Gradient summed over the channels is the exact relevance of each pixel (zeroing a set
    of pixels drops the logit by its sum), and the gradient w does not move with the input and predicts every
    change f(x) − f(x − I) = Iᵀw exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3)).eval()
    torch.nn.init.normal_(model[1].weight)  # weights of about 1: the logit moves by about 1 under the noise
    x = torch.randn(4, 3, 8, 8)
    y = torch.tensor([0, 1, 2, 0])
    methods = {"inputxgradient": explain.InputXGradient(model, reduce="sum", progress=False),
               "gradient": explain.Saliency(model, reduce="sum", progress=False), "random": RandomMaps(model)}
    exact_relevance = {METRICS["faithfulness_correlation"].with_options(runs=8, subset_size=16): 1.0,
                       METRICS["faithfulness_estimate"].with_options(steps=8): 1.0,
                       METRICS["sensitivity_n"].with_options(runs=6, subset_sizes=(4, 32)): 1.0}
    exact_gradient = {METRICS["infidelity"].with_options(samples=8): 0.0,
                      METRICS["max_sensitivity"].with_options(samples=3): 0.0,
                      METRICS["local_lipschitz_estimate"].with_options(samples=3): 0.0,
                      METRICS["continuity"].with_options(shares=(-0.25, 0.25)): 0.0}
    result = evaluate(model, methods, (x, y), [*exact_relevance, *exact_gradient], batch_size=2, progress=False)
    ranks = result.ranks()
    for best, known in (("inputxgradient", exact_relevance), ("gradient", exact_gradient)):
        for metric, value in known.items():
            assert result.mean(best, metric.name) == pytest.approx(value, abs=1e-4), metric.name
            assert ranks[best][metric.name] == 1 and ranks["random"][metric.name] > 1, metric.name
            assert abs(result.mean("random", metric.name) - value) > 0.05, metric.name


def test_a_resumed_run_of_random_drawing_metrics_gives_the_uninterrupted_values(demo, tmp_path):
    model, x, y, masks = demo
    chosen = [METRICS["faithfulness_correlation"].with_options(runs=3, subset_size=32),
              METRICS["max_sensitivity"].with_options(samples=2), METRICS["random_logit"]]
    whole = evaluate(model, {"saliency": explain.Saliency(model)}, (x, y), chosen, batch_size=2, progress=False)
    out = tmp_path / "evaluation"
    Counting.calls = 0
    evaluate(model, {"saliency": Counting(model)}, (x, y), chosen, out=out, batch_size=2, progress=False)
    calls_per_batch = Counting.calls / 4  # the batch's maps, and the metrics' explanations of copies and classes
    values_file = out / "evaluation.csv"
    lines = values_file.read_text(encoding="utf-8").splitlines(keepends=True)
    rows_per_group = 2 * len(chosen)
    values_file.write_text("".join(lines[: 1 + 2 * rows_per_group + 3]), encoding="utf-8")  # third batch half written
    Counting.calls = 0
    resumed = evaluate(model, {"saliency": Counting(model)}, (x, y), chosen, out=out, batch_size=2, progress=False)
    assert Counting.calls == 2 * calls_per_batch  # the third and the fourth batch again
    for metric in chosen:
        assert torch.equal(resumed.values["saliency"][metric.name], whole.values["saliency"][metric.name])
    assert not torch.equal(whole.values["saliency"][chosen[0].name][:2], whole.values["saliency"][chosen[0].name][2:4])
    with pytest.raises(ValueError, match="other settings.*runs=4"):  # other settings are another metric's name
        evaluate(model, {"saliency": Counting(model)}, (x, y),
                 [METRICS["faithfulness_correlation"].with_options(runs=4, subset_size=32), *chosen[1:]], out=out,
                 batch_size=2, progress=False)


def test_with_options_names_the_settings_and_refuses_unknown_ones():
    metric = METRICS["faithfulness_correlation"].with_options(runs=8)
    assert metric.name == "faithfulness_correlation(runs=8)" and metric.options == {"runs": 8, "subset_size": 224}
    assert metric.measures.endswith("; with runs=8") and metric.better == "higher"
    assert METRICS["faithfulness_correlation"].with_options(runs=50) is METRICS["faithfulness_correlation"]
    with pytest.raises(ValueError, match="takes the options runs, subset_size; got samples"):
        METRICS["faithfulness_correlation"].with_options(samples=3)
    with pytest.raises(ValueError, match="'deletion' takes the options steps; got runs"):
        METRICS["deletion"].with_options(runs=3)
    with pytest.raises(ValueError, match=r"'auc' takes the options \(none\); got k"):
        METRICS["auc"].with_options(k=3)
    custom = Metric("mine", "higher", "a test", lambda given: given.targets.double())
    with pytest.raises(ValueError, match="no options to change"):
        custom.with_options(runs=1)


def test_a_mean_leaves_out_the_images_where_a_metric_is_undefined(demo):
    model, x, y, _ = demo
    saliency = explain.Saliency(model, progress=False)
    three = evaluate(model, {"saliency": saliency}, (x[:3], y[:3]), ["sufficiency"], batch_size=2, progress=False)
    values = three.values["saliency"]["sufficiency"]  # the last batch holds one image: no other to compare with
    expected = metrics.sufficiency(model, x[:2], saliency.explain(x[:2], target=y[:2])).double()
    assert torch.equal(values[:2], expected) and math.isnan(values[2])
    assert three.mean("saliency", "sufficiency") == pytest.approx(float(expected.mean()))
    lower = METRICS["relative_input_stability"]
    values = {"a": {lower.name: torch.tensor([1.0, math.nan, 3.0])}, "b": {lower.name: torch.tensor([2.5, 2.5, 2.5])},
              "c": {lower.name: torch.tensor([math.nan] * 3)}}
    result = Evaluation(["a", "b", "c"], [lower], values)
    assert result.mean("a", lower.name) == 2.0 and result.spread("a", lower.name) == pytest.approx(1.0)
    assert result.ranks()["a"][lower.name] == 1 and math.isnan(result.ranks()["c"][lower.name])
