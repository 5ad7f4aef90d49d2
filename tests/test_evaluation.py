"""explain.evaluate / `explain evaluate`: the method × metric table equals the metrics called one by one, ranks as
worked out by hand (ties, metrics that do not apply), resuming after a kill computes only what is missing and gives
the same table, and the command writes the table and the figure."""

from __future__ import annotations

import csv
import math

import pytest
import torch

import explain
from explain import metrics
from explain.cli import main
from explain.data import make_dataset
from explain.data.train import EVALUATION_SEED, to_model_input
from explain.evaluation import METRICS, Evaluation, evaluate


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
