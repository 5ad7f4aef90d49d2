"""``explain.evaluate``: a method × metric table over a data set, for comparing explanation methods.

    result = explain.evaluate(model, ["gradcam", "saliency", "lrp", "integratedgradients"], (images, labels, masks),
                              metrics=["deletion", "insertion", "pointing_game", "sparseness"], out="evaluation/")
    print(result.markdown())           # mean ± spread per method and metric, and each method's mean rank

Each batch is explained once per method (for its labels), and every metric is computed on those maps; the values
of every image are kept. Metrics disagree with each other, so the methods are also ranked per metric (1 = best,
ties share their mean rank) and the ranks averaged across metrics, as LATEC does (Klein et al. 2024).

With ``out``, the run is resumable like ``explain batch``: each (batch, method)'s values (and the seconds each metric
took) go to OUT/evaluation.csv in one write, after which a kill loses nothing; a rerun computes only what is
missing. OUT/evaluation.json records the settings (a rerun with other methods, metrics or batch size is an error
that says what differs), and the end of the run writes OUT/evaluation.md (the table) and OUT/evaluation.png (the
figure: each method's rank per metric).
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union, cast

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import metrics
from .batch import append_rows, write_atomically
from .explanation import Explanation
from .methods.base import Explainer, get_method, progress_shown_by_caller

FIELDS = ["batch", "method", "metric", "image", "value", "seconds"]
SETTINGS_FILE = "evaluation.json"
VALUES_FILE = "evaluation.csv"
EvaluationBatch = Union[tuple[Tensor, Tensor], tuple[Tensor, Tensor, Optional[Tensor]]]
"""(inputs (N, C, H, W) model input, labels (N,) class indices[, masks (N, H, W) bool of the objects or None])."""


@dataclass
class MetricInput:
    """What a metric is computed from: the model, the explainer, the model-input batch (N, C, H, W), the maps
    explaining ``targets`` (N,), and the objects' masks (N, H, W) when the data has them."""

    model: nn.Module
    explainer: Explainer
    inputs: Tensor
    explanation: Explanation
    targets: Tensor
    masks: Optional[Tensor]


@dataclass(frozen=True)
class Metric:
    """A metric as ``evaluate`` runs it: its name, whether higher or lower is better, what it measures (one line),
    the function giving (N,) values for a batch, whether it needs object masks, and whether it applies to a
    method's explanation (completeness needs input attributions: a CAM's values are NaN there, shown as "–")."""

    name: str
    better: str
    measures: str
    compute: Callable[[MetricInput], Tensor]
    needs_masks: bool = False
    applies: Callable[[Explanation], bool] = lambda explanation: True


def _on(values: Tensor) -> Tensor:
    return values.detach().double().cpu()


def _localisation(function: Callable[..., Tensor]) -> Callable[[MetricInput], Tensor]:
    def compute(given: MetricInput) -> Tensor:
        assert given.masks is not None, "needs_masks metrics run only with masks"
        return _on(function(given.explanation, given.masks))

    return compute


def _model_metric(function: Callable[..., Any], field_name: str, **options: Any) -> Callable[[MetricInput], Tensor]:
    def compute(given: MetricInput) -> Tensor:
        result = function(given.model, given.inputs, given.explanation, given.targets, **options)
        return _on(getattr(result, field_name) if field_name else result)

    return compute


def _explainer_metric(function: Callable[..., Any], field_name: str, **options: Any
                      ) -> Callable[[MetricInput], Tensor]:
    def compute(given: MetricInput) -> Tensor:
        result = function(given.explainer, given.inputs, given.targets, **options)
        return _on(getattr(result, field_name).to(torch.float64))

    return compute


def _maps_metric(function: Callable[[Any], Tensor]) -> Callable[[MetricInput], Tensor]:
    return lambda given: _on(function(given.explanation))


METRICS: dict[str, Metric] = {metric.name: metric for metric in [
    Metric("deletion", "lower", "faithfulness: probability as the most relevant pixels are deleted (area, 16 steps)",
           _model_metric(metrics.deletion, "area", steps=16)),
    Metric("insertion", "higher", "faithfulness: probability as the most relevant pixels are inserted into a "
           "blurred image (area, 16 steps)", _model_metric(metrics.insertion, "area", steps=16)),
    Metric("road", "lower", "faithfulness: probability as the most relevant pixels are imputed from their "
           "neighbours (ROAD, area over 10–90 %)", _model_metric(metrics.road, "area", percentages=(0.1, 0.3, 0.5,
                                                                                                 0.7, 0.9))),
    Metric("confidence_drop", "lower", "faithfulness: the probability lost when the image is multiplied by its map",
           _model_metric(metrics.confidence_change, "drop")),
    Metric("completeness", "lower", "axiomatic: |Σ map − (score − score at a black baseline)| / |score change|",
           lambda given: _on(metrics.completeness(given.model, given.inputs, given.explanation, given.targets
                                                  ).relative_error.abs()),
           applies=lambda explanation: explanation.attributions is not None),
    Metric("random_logit", "lower", "randomisation: SSIM of the map for the class and for a random other class",
           _explainer_metric(metrics.random_logit, "similarity")),
    Metric("input_invariance", "higher", "axiomatic: 1 where the map is unchanged when a constant shift of the "
           "input is absorbed by the first layer", _explainer_metric(metrics.input_invariance, "invariant")),
    Metric("pointing_game", "higher", "localisation: 1 where the map's maximum lies on the object",
           _localisation(metrics.pointing_game), needs_masks=True),
    Metric("energy_pointing_game", "higher", "localisation: share of the positive relevance on the object",
           _localisation(metrics.energy_pointing_game), needs_masks=True),
    Metric("relevance_rank_accuracy", "higher", "localisation: share of the object among the top-|object| pixels",
           _localisation(metrics.relevance_rank_accuracy), needs_masks=True),
    Metric("top_k_intersection", "higher", "localisation: share of the top 1000 pixels on the object",
           _localisation(metrics.top_k_intersection), needs_masks=True),
    Metric("auc", "higher", "localisation: ROC AUC of the map as a detector of the object's pixels",
           _localisation(metrics.auc), needs_masks=True),
    Metric("sparseness", "higher", "complexity: Gini index of |map| (1: all relevance on one pixel)",
           _maps_metric(metrics.sparseness)),
    Metric("complexity", "lower", "complexity: entropy of |map| / Σ|map|", _maps_metric(metrics.complexity)),
]}
"""The metrics ``evaluate`` knows, by name, with the settings it uses (each function's docstring says more)."""


@dataclass
class Evaluation:
    """The values of an evaluation: ``values[method][metric]`` (images,) float64 in data order; ``seconds``, the
    time each metric took in all per method; ``metrics`` the Metric of each name, in the order asked."""

    methods: list[str]
    metrics: list[Metric]
    values: dict[str, dict[str, Tensor]]
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)

    def mean(self, method: str, metric: str) -> float:
        return float(self.values[method][metric].mean())

    def spread(self, method: str, metric: str) -> float:
        """The standard error of the mean over images."""
        values = self.values[method][metric]
        return float(values.std() / math.sqrt(len(values))) if len(values) > 1 else 0.0

    def ranks(self) -> dict[str, dict[str, float]]:
        """``ranks[method][metric]``: 1 for the best mean, ties sharing their mean rank; NaN where the metric does
        not apply to the method (ranked among the methods it applies to)."""
        ranks: dict[str, dict[str, float]] = {method: {} for method in self.methods}
        for metric in self.metrics:
            sign = -1.0 if metric.better == "higher" else 1.0
            means = {method: sign * self.mean(method, metric.name) for method in self.methods}
            applicable = [mean for mean in means.values() if not math.isnan(mean)]
            for method, mean in means.items():
                ranks[method][metric.name] = math.nan if math.isnan(mean) else 1 + sum(
                    other < mean for other in applicable) + (sum(other == mean for other in applicable) - 1) / 2
        return ranks

    def mean_rank(self) -> dict[str, float]:
        """Each method's rank averaged over the metrics that apply to it (lower is better)."""
        ranks = self.ranks()
        mean_ranks = {}
        for method in self.methods:
            applicable = [rank for rank in ranks[method].values() if not math.isnan(rank)]
            mean_ranks[method] = sum(applicable) / len(applicable) if applicable else math.nan
        return mean_ranks

    def markdown(self) -> str:
        """The table: a row per method, a column per metric (mean ± standard error, its rank), and the mean rank."""
        ranks, mean_rank = self.ranks(), self.mean_rank()
        header = "| method | " + " | ".join(f"{m.name} {'↑' if m.better == 'higher' else '↓'}" for m in self.metrics)
        lines = [header + " | mean rank |", "| --- |" + " ---: |" * (len(self.metrics) + 1)]
        for method in sorted(self.methods, key=lambda name: mean_rank[name]):
            cells = ["–" if math.isnan(ranks[method][m.name]) else
                     f"{self.mean(method, m.name):.3f} ± {self.spread(method, m.name):.3f} ({ranks[method][m.name]:g})"
                     for m in self.metrics]
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {mean_rank[method]:.2f} |")
        return "\n".join(lines)

    def cost_markdown(self) -> str:
        """Seconds per image of each metric, per method."""
        count = len(next(iter(next(iter(self.values.values())).values())))
        lines = ["| metric | " + " | ".join(self.methods) + " |", "| --- |" + " ---: |" * len(self.methods)]
        for metric in self.metrics:
            lines.append(f"| {metric.name} | " + " | ".join(
                f"{self.seconds.get(method, {}).get(metric.name, 0.0) / count:.4f}" for method in self.methods) + " |")
        return "\n".join(lines)

    def figure(self) -> Any:
        """A matplotlib figure: each method's rank per metric (colour) with its mean (text)."""
        import matplotlib.pyplot as plt

        ranks, mean_rank = self.ranks(), self.mean_rank()
        order = sorted(self.methods, key=lambda name: mean_rank[name])
        grid = [[ranks[method][metric.name] for metric in self.metrics] for method in order]
        figure, axes = plt.subplots(figsize=(1.1 * len(self.metrics) + 2.5, 0.55 * len(order) + 1.6))
        image = axes.imshow(grid, cmap="RdYlGn_r", vmin=1, vmax=max(len(order), 2), aspect="auto")
        for row, method in enumerate(order):
            for column, metric in enumerate(self.metrics):
                mean = self.mean(method, metric.name)
                axes.text(column, row, "–" if math.isnan(mean) else f"{mean:.2f}", ha="center", va="center",
                          fontsize=8)
        axes.set_xticks(range(len(self.metrics)),
                        [f"{m.name}\n{'↑' if m.better == 'higher' else '↓'}" for m in self.metrics],
                        rotation=45, ha="right", fontsize=8)
        axes.set_yticks(range(len(order)), [f"{method} ({mean_rank[method]:.1f})" for method in order], fontsize=8)
        figure.colorbar(image, ax=axes, label="rank (1 = best)")
        axes.set_title("methods × metrics: mean value, coloured by rank (mean rank in brackets)", fontsize=9)
        figure.tight_layout()
        return figure


def _batches(data: Union[EvaluationBatch, Iterable[EvaluationBatch]], batch_size: int
             ) -> Iterator[tuple[Tensor, Tensor, Optional[Tensor]]]:
    """The data as (inputs, labels, masks or None) batches: a single (inputs, labels[, masks]) tuple is cut into
    batches of ``batch_size``; an iterable (a DataLoader) gives its own batches."""
    if isinstance(data, tuple) and len(data) in (2, 3) and isinstance(data[0], Tensor):
        inputs, labels = data[0], torch.as_tensor(data[1])
        masks = cast(Optional[Tensor], data[2] if len(data) == 3 else None)
        if inputs.dim() != 4 or labels.shape != (inputs.shape[0],):
            raise ValueError(f"data must be (inputs (N, C, H, W), labels (N,)[, masks (N, H, W)]); got inputs of "
                             f"shape {tuple(inputs.shape)} and labels of shape {tuple(labels.shape)}.")
        if masks is not None and (masks.dim() != 3 or masks.shape[0] != inputs.shape[0]):
            raise ValueError(f"masks must be (N, H, W) for the {inputs.shape[0]} images; got shape "
                             f"{tuple(masks.shape)}.")
        for start in range(0, inputs.shape[0], batch_size):
            yield (inputs[start:start + batch_size], labels[start:start + batch_size],
                   None if masks is None else masks[start:start + batch_size])
        return
    for position, batch in enumerate(data):
        if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3) or not isinstance(batch[0], Tensor):
            raise ValueError(f"batch {position} of the data is not (inputs, labels[, masks]): evaluate needs each "
                             "image's class to explain and score.")
        yield batch[0], torch.as_tensor(batch[1]), (batch[2] if len(batch) == 3 else None)


def _explainers(model: nn.Module, methods: Union[Sequence[Union[str, Explainer]], Mapping[str, Explainer]]
                ) -> dict[str, Explainer]:
    if isinstance(methods, Mapping):
        return dict(methods)
    explainers: dict[str, Explainer] = {}
    for method in methods:
        explainer = get_method(method)(model) if isinstance(method, str) else method
        if explainer.model is not model and getattr(model, "_orig_mod", None) is not explainer.model:
            raise ValueError(f"the explainer {type(explainer).__name__} explains another model than the one given.")
        name = method if isinstance(method, str) else explainer.name
        if name in explainers:
            raise ValueError(f"method {name!r} is given twice; give a mapping name → explainer to compare two "
                             "settings of one method.")
        explainers[name] = explainer
    if not explainers:
        raise ValueError("evaluate needs at least one method.")
    return explainers


def _metrics(names: Sequence[Union[str, Metric]]) -> list[Metric]:
    chosen: list[Metric] = []
    for name in names:
        if isinstance(name, Metric):
            chosen.append(name)
        elif name in METRICS:
            chosen.append(METRICS[name])
        else:
            raise ValueError(f"unknown metric {name!r}; known: {', '.join(METRICS)} (or pass an "
                             "explain.evaluation.Metric).")
    if not chosen:
        raise ValueError("evaluate needs at least one metric.")
    if len({metric.name for metric in chosen}) != len(chosen):
        raise ValueError("a metric is given twice.")
    return chosen


def _done(out: Path, settings: dict[str, Any], metric_names: Sequence[str]
          ) -> dict[tuple[int, str], list[dict[str, str]]]:
    """The rows of every (batch, method) that an earlier run finished (every metric, as many values each), after
    checking that it used the same settings; the values file is rewritten without unfinished groups (a kill
    during their write)."""
    record = out / SETTINGS_FILE
    if record.exists():
        earlier = json.loads(record.read_text(encoding="utf-8"))
        differences = [f"{key}: {earlier.get(key)!r} earlier, {value!r} now" for key, value in settings.items()
                       if earlier.get(key) != value]
        if differences:
            raise ValueError(f"{out} holds an evaluation with other settings ({'; '.join(differences)}); rerun with "
                             "the earlier settings to resume it, or give another folder.")
    values_file = out / VALUES_FILE
    text = values_file.read_text(encoding="utf-8") if values_file.exists() else ""
    groups: dict[tuple[int, str], list[dict[str, str]]] = {}
    for row in csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1])):  # a kill may have torn the last line
        groups.setdefault((int(row["batch"]), row["method"]), []).append(row)
    complete = {}
    for key, rows in groups.items():
        counts = [sum(row["metric"] == name for row in rows) for name in metric_names]
        if min(counts) > 0 and len(set(counts)) == 1 and len(rows) == sum(counts):
            complete[key] = rows
    if len(complete) != len(groups) or (text and not text.endswith("\n")):  # keep only the complete groups
        kept = io.StringIO()
        writer = csv.DictWriter(kept, FIELDS, lineterminator="\n")
        writer.writeheader()
        for rows in complete.values():
            writer.writerows(rows)
        write_atomically(values_file, lambda path: path.write_text(kept.getvalue(), encoding="utf-8"))
    return complete


def evaluate(
    model: nn.Module,
    methods: Union[Sequence[Union[str, Explainer]], Mapping[str, Explainer]],
    data: Union[EvaluationBatch, Iterable[EvaluationBatch]],
    metrics: Sequence[Union[str, Metric]] = ("deletion", "insertion", "road", "pointing_game", "sparseness"),
    *,
    out: Union[str, Path, None] = None,
    batch_size: int = 8,
    progress: bool = True,
) -> Evaluation:
    """Evaluate each method with each metric over ``data``; every image's value kept (see the module docstring).

    methods: registry names ("gradcam", ...; built with their defaults on ``model``), explainers, or a mapping
        name → explainer. data: (inputs (N, C, H, W) model input, labels (N,)[, masks (N, H, W) bool]) or a
        DataLoader of such batches, in a fixed order (resuming relies on it). metrics: names of ``METRICS`` or
        ``Metric`` objects; localisation metrics need masks. out: a folder for the resumable record, the table
        and the figure. batch_size: images per batch when ``data`` is one tuple.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number ≥ 1; got {batch_size!r}.")
    explainers, chosen = _explainers(model, methods), _metrics(list(metrics))
    names = [metric.name for metric in chosen]
    settings = {"methods": list(explainers), "metrics": names, "batch_size": batch_size}
    folder = None if out is None else Path(out)
    done: dict[tuple[int, str], list[dict[str, str]]] = {}
    if folder is not None:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{folder} is a file; give a folder for the evaluation (it is created if missing).")
        folder.mkdir(parents=True, exist_ok=True)
        done = _done(folder, settings, names)
        write_atomically(folder / SETTINGS_FILE, lambda path: path.write_text(json.dumps(settings, indent=1)))
    per_batch: dict[tuple[int, str], dict[str, Tensor]] = {}
    seconds: dict[str, dict[str, float]] = {method: dict.fromkeys(names, 0.0) for method in explainers}
    with progress_shown_by_caller(), tqdm(desc="evaluate", unit="batch", disable=not progress) as bar:
        _run(model, explainers, chosen, data, batch_size, done, per_batch, seconds, folder, bar)
    if not per_batch:
        raise ValueError("the data holds no images.")
    values = {method: {name: torch.cat([per_batch[key][name] for key in sorted(per_batch) if key[1] == method])
                       for name in names} for method in explainers}
    result = Evaluation(list(explainers), chosen, values, seconds)
    if folder is not None:
        _write_summary(result, folder)
    return result


def _run(model: nn.Module, explainers: dict[str, Explainer], chosen: list[Metric],
         data: Union[EvaluationBatch, Iterable[EvaluationBatch]], batch_size: int,
         done: dict[tuple[int, str], list[dict[str, str]]], per_batch: dict[tuple[int, str], dict[str, Tensor]],
         seconds: dict[str, dict[str, float]], folder: Optional[Path], bar: Any) -> None:
    """Every batch × method: taken from an earlier run's rows, or explained and measured (``_evaluate_batch``)."""
    names = [metric.name for metric in chosen]
    for index, (inputs, labels, masks) in enumerate(_batches(data, batch_size)):
        if masks is None and any(metric.needs_masks for metric in chosen):
            needing = [metric.name for metric in chosen if metric.needs_masks]
            raise ValueError(f"the metrics {needing} need the objects' masks: give data as (inputs, labels, masks).")
        for method, explainer in explainers.items():
            if (index, method) in done:
                rows = done[(index, method)]
                per_batch[(index, method)] = {
                    name: torch.tensor([float(row["value"]) for row in rows if row["metric"] == name],
                                       dtype=torch.float64) for name in names}
                for row in rows:
                    seconds[method][row["metric"]] += float(row["seconds"]) / max(1, len(inputs))
                continue
            per_batch[(index, method)] = _evaluate_batch(model, explainer, chosen, inputs, labels, masks,
                                                        seconds[method], folder, index, method)
        bar.update(1)


def _evaluate_batch(model: nn.Module, explainer: Explainer, chosen: list[Metric], inputs: Tensor, labels: Tensor,
                    masks: Optional[Tensor], seconds: dict[str, float], folder: Optional[Path], index: int,
                    method: str) -> dict[str, Tensor]:
    """One batch explained by one method and every metric computed on its maps; their rows appended in one write."""
    explanation = explainer.explain(inputs, target=labels)
    given = MetricInput(model, explainer, inputs, explanation, labels, masks)
    values: dict[str, Tensor] = {}
    spent: dict[str, float] = {}
    for metric in chosen:
        started = time.perf_counter()
        if not metric.applies(explanation):
            values[metric.name] = torch.full((inputs.shape[0],), math.nan, dtype=torch.float64)
            spent[metric.name] = 0.0
            continue
        values[metric.name] = metric.compute(given).reshape(-1)
        spent[metric.name] = time.perf_counter() - started
        seconds[metric.name] += spent[metric.name]
        if values[metric.name].shape[0] != inputs.shape[0]:
            raise RuntimeError(f"metric {metric.name} gave {values[metric.name].shape[0]} values for "
                               f"{inputs.shape[0]} images.")
    if folder is not None:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        if not (folder / VALUES_FILE).exists() or (folder / VALUES_FILE).stat().st_size == 0:
            writer.writerow(FIELDS)
        for name, batch_values in values.items():
            for position, value in enumerate(batch_values.tolist()):
                writer.writerow([index, method, name, position, repr(value), repr(spent[name])])
        with open(folder / VALUES_FILE, "ab") as values_file:
            append_rows(values_file, buffer.getvalue().encode("utf-8"))
    return values


def _write_summary(result: Evaluation, folder: Path) -> None:
    import matplotlib.pyplot as plt

    table = f"{result.markdown()}\n\nSeconds per image of each metric:\n\n{result.cost_markdown()}\n"
    write_atomically(folder / "evaluation.md", lambda path: path.write_text(table, encoding="utf-8"))
    figure = result.figure()
    try:
        write_atomically(folder / "evaluation.png", lambda path: figure.savefig(path, dpi=120, format="png"))
    finally:
        plt.close(figure)
