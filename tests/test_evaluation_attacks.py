"""explain.evaluate and `explain evaluate` attacked as a hostile user would: the model left exactly as found after
every call (train-mode models, frozen parameters, Ctrl-C anywhere), the same numbers inside torch.no_grad() and
torch.inference_mode(), resuming after a Ctrl-C or a kill -9 (rows neither lost nor repeated, the values of an
uninterrupted run), resuming with other settings, a model or data that changed (refused with an error naming what
differs), corrupt record files, bad inputs, NaN values, models returning tuples or dicts, and the table, figure and
values file agreeing with the returned result."""

from __future__ import annotations

import csv
import functools
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SmallCNN, assert_state_equal, model_state
from test_outputs_and_targets import TupleOutput
from torch import nn

import explain
from explain import metrics
from explain.cli import main
from explain.dataset_tools.evaluation import FIELDS, METRICS, Evaluation, Metric, evaluate

CHEAP = [METRICS["deletion"].with_options(steps=4), METRICS["sparseness"]]
"""Two metrics that cost almost nothing on 16 px images."""


def small_data(count: int = 6, size: tuple[int, int] = (16, 16), seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(count, 3, *size, generator=generator)
    y = torch.arange(count) % 5
    masks = torch.zeros(count, *size, dtype=torch.bool)
    masks[:, size[0] // 4: size[0] // 2 + 2, size[1] // 4: size[1] // 2 + 2] = True
    return x, y, masks


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on 2 shared cores two threads that wait for each other make these small models 10 ×
    slower whenever another process runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    return SmallCNN().eval()


def rows_of(out: Path) -> list[dict[str, str]]:
    with open(out / "evaluation.csv", newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def assert_same_values(result: Evaluation, expected: Evaluation) -> None:
    assert result.methods == expected.methods
    for method in expected.methods:
        assert result.values[method].keys() == expected.values[method].keys()
        for name, values in expected.values[method].items():
            assert result.values[method][name].dtype == torch.float64
            torch.testing.assert_close(result.values[method][name], values, rtol=0, atol=0, equal_nan=True,
                                       msg=f"{method} {name}")


def assert_each_row_once(out: Path, batches: int, methods: int, images_per_batch: list[int], metric_count: int):
    rows = rows_of(out)
    keys = [(row["batch"], row["method"], row["metric"], row["image"]) for row in rows]
    assert len(keys) == len(set(keys)), "a row is in the values file twice"
    assert len(rows) == methods * metric_count * sum(images_per_batch)
    assert {int(row["batch"]) for row in rows} == set(range(batches))


# ------------------------------------------------------------------ the model as found, whatever happens


def test_a_train_mode_model_with_frozen_parts_is_left_as_found_and_scored_as_in_eval_mode(cnn):
    """Dropout and BatchNorm in train mode would make every forward random and move the running statistics: the
    metrics must run the model in eval mode, give the eval-mode numbers, and leave every flag as it was."""
    x, y, masks = small_data(4)
    chosen = [*CHEAP, METRICS["max_sensitivity"].with_options(samples=2), METRICS["pointing_game"]]
    expected = evaluate(cnn, ["saliency", "gradcam"], (x, y, masks), chosen, batch_size=2, progress=False)
    model = SmallCNN()
    model.load_state_dict(cnn.state_dict())
    model.train()
    model.features[1].eval()  # a frozen BatchNorm in a training model
    model.head.weight.requires_grad_(False)
    before = model_state(model)
    result = evaluate(model, ["saliency", "gradcam"], (x, y, masks), chosen, batch_size=2, progress=False)
    assert_state_equal(before, model_state(model))
    assert_same_values(result, expected)


def test_the_numbers_inside_no_grad_and_inference_mode_are_those_outside(cnn):
    """A user evaluating inside `torch.no_grad()` or `torch.inference_mode()` (as around any other evaluation
    code) must get the same values: the explainers need gradients, and the metrics that perturb the images
    (max_sensitivity) explain copies made in the caller's mode."""
    x, y, masks = small_data(4)
    chosen = [*CHEAP, METRICS["max_sensitivity"].with_options(samples=2), METRICS["random_logit"],
              METRICS["completeness"]]
    expected = evaluate(cnn, ["saliency", "gradcam"], (x, y, masks), chosen, batch_size=2, progress=False)
    with torch.no_grad():
        quiet = evaluate(cnn, ["saliency", "gradcam"], (x, y, masks), chosen, batch_size=2, progress=False)
        assert not torch.is_grad_enabled()
    assert_same_values(quiet, expected)
    with torch.inference_mode():
        inferred = evaluate(cnn, ["saliency", "gradcam"], (x, y, masks), chosen, batch_size=2, progress=False)
        made_inside = x[:2].clone()  # an inference tensor: the caller's data made in inference mode
        assert made_inside.is_inference()
        inside = evaluate(cnn, ["saliency"], (made_inside, y[:2]), chosen, progress=False)
    assert_same_values(inferred, expected)
    assert_same_values(inside, evaluate(cnn, ["saliency"], (x[:2], y[:2]), chosen, progress=False))


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_every_registered_metric_called_inside_no_grad_or_inference_mode_gives_the_values_outside(cnn, context):
    """Each of the registry's metrics, computed directly (not through evaluate, which leaves inference mode itself)
    in the caller's mode: the same values as outside. The metrics that explain perturbed copies made the copies'
    targets, and the randomisation metrics their model copies, as inference tensors, which autograd refused."""
    from explain.dataset_tools.evaluation import MetricInput

    x, y, masks = small_data(2, size=(32, 32))
    for method in ("saliency", "gradcam"):
        explainer = explain.get_method(method)(cnn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            given = MetricInput(cnn, explainer, x, explainer.explain(x, y), y, masks)
            for name, metric in METRICS.items():
                if name == "completeness" and method == "gradcam":  # a CAM has no input attributions
                    continue
                if metric.per_instance:  # detectors' (tests/test_detection_metrics.py)
                    continue
                outside = metric.compute(given)
                with context():
                    inside = metric.compute(given)
                torch.testing.assert_close(inside, outside, rtol=0, atol=0, equal_nan=True, msg=f"{method} {name}")


@pytest.mark.usefixtures("python_sigint_handler")
def test_ctrl_c_anywhere_leaves_the_model_as_found_and_the_run_resumes_to_the_uninterrupted_values(cnn, tmp_path):
    """A real Ctrl-C at random instants CPython could handle it (tests/test_interrupts.py's interrupter) in a
    resumable run: hooks, flags, modes and grad mode as before; the values file holds only whole (batch, method)
    groups; a rerun finishes with the values of an uninterrupted run, each row once."""
    from test_interrupts import SignalPointInterrupter, thread_state

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread")
    model = SmallCNN()
    model.load_state_dict(cnn.state_dict())
    model.train()
    model.features[4].eval()
    x, y, _ = small_data(4, size=(8, 8))
    chosen = [METRICS["deletion"].with_options(steps=2), METRICS["sparseness"]]
    expected = evaluate(model, ["saliency", "gradcam"], (x, y), chosen, batch_size=2, progress=False)
    before, thread_before = model_state(model), thread_state()
    out = tmp_path / "evaluation"
    call = functools.partial(evaluate, model, ["saliency", "gradcam"], (x, y), chosen, out=out, batch_size=2,
                             progress=False)
    interrupter, draws = SignalPointInterrupter(), random.Random(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        points = interrupter.run(call)
        interrupted = 0
        for _ in range(4):
            try:
                interrupter.run(call, draws.randint(1, points))
            except KeyboardInterrupt:
                interrupted += 1
            assert_state_equal(before, model_state(model))
            assert thread_state() == thread_before
            for rows in [rows_of(out)] if (out / "evaluation.csv").exists() else []:
                groups: dict = {}
                for row in rows:
                    groups.setdefault((row["batch"], row["method"]), []).append(row)
                assert all(len(group) == 2 * len(chosen) for group in groups.values())  # whole groups only
            resumed = evaluate(model, ["saliency", "gradcam"], (x, y), chosen, out=out, batch_size=2, progress=False)
            assert_same_values(resumed, expected)
            assert_each_row_once(out, 2, 2, [2, 2], len(chosen))
            for path in out.iterdir():
                path.unlink()
    assert interrupted >= 2
    assert_state_equal(before, model_state(model))


def test_a_kill_9_of_the_command_mid_run_resumes_with_no_row_lost_or_repeated(tmp_path):
    """`explain evaluate` killed with SIGKILL while it runs, then rerun: the rerun computes what is missing, and
    its table and values equal those of a run never killed."""
    out, whole = tmp_path / "killed", tmp_path / "whole"
    arguments = ["evaluate", "--model", "demo", "--methods", "gradcam", "saliency", "--metrics", "sparseness",
                 "deletion", "--images", "12", "--batch-size", "1", "--no-progress"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(explain.__file__).parent.parent)}
    process = subprocess.Popen([sys.executable, "-m", "explain.cli", *arguments, "--out", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            if (out / "evaluation.csv").exists() and len(rows_of(out)) >= 3 * 2:  # the third group written
                break
            time.sleep(0.02)
        process.kill()
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode() if process.stderr else ""
    written = rows_of(out)
    assert 0 < len(written) < 2 * 2 * 12 and not (out / "evaluation.md").exists()  # killed mid-way
    assert main([*arguments, "--out", str(out)]) == 0
    assert main([*arguments, "--out", str(whole)]) == 0
    assert_each_row_once(out, 12, 2, [1] * 12, 2)
    key = lambda row: (int(row["batch"]), row["method"], row["metric"], int(row["image"]))  # noqa: E731
    assert [(key(row), row["value"]) for row in sorted(rows_of(out), key=key)] == \
        [(key(row), row["value"]) for row in sorted(rows_of(whole), key=key)]
    whole_groups = [row for row in written if sum(bool(other["batch"] == row["batch"] and other["method"] ==
                                                       row["method"] and other["seconds"]) for other in written) == 2]
    assert whole_groups and all(row in rows_of(out) for row in whole_groups)  # what the killed run wrote is kept
    table = (out / "evaluation.md").read_text(encoding="utf-8").split("\n\n")[0]
    assert table == (whole / "evaluation.md").read_text(encoding="utf-8").split("\n\n")[0]


# ------------------------------------------------------------------ resuming with something else


def test_resuming_with_more_or_fewer_images_is_refused_naming_the_batch(cnn, tmp_path):
    """6 images in batches of 4 leave a last batch of 2: a rerun on 8 images (or on 3) must not take that batch's
    2 (or 4) stored values for its 4 (or 3) images: that gave 6 values for 8 images, silently."""
    x, y, _ = small_data(8)
    out = tmp_path / "evaluation"
    evaluate(cnn, ["saliency"], (x[:6], y[:6]), CHEAP, out=out, batch_size=4, progress=False)
    with pytest.raises(ValueError, match="batch 1 .*differs"):
        evaluate(cnn, ["saliency"], (x, y), CHEAP, out=out, batch_size=4, progress=False)
    with pytest.raises(ValueError, match="batch 0 .*differs"):
        evaluate(cnn, ["saliency"], (x[:3], y[:3]), CHEAP, out=out, batch_size=4, progress=False)
    # the refusals changed nothing: the same data still resumes, all taken from the record
    resumed = evaluate(cnn, ["saliency"], (x[:6], y[:6]), CHEAP, out=out, batch_size=4, progress=False)
    assert_same_values(resumed, evaluate(cnn, ["saliency"], (x[:6], y[:6]), CHEAP, batch_size=4, progress=False))
    assert_each_row_once(out, 2, 1, [4, 2], len(CHEAP))


def test_resuming_with_other_images_labels_or_masks_is_refused(cnn, tmp_path):
    """The same number of images but other ones (another seed, another order, other labels or masks) would mix
    two data sets' values in one table."""
    x, y, masks = small_data(4)
    chosen = [*CHEAP, METRICS["pointing_game"]]
    out = tmp_path / "evaluation"
    evaluate(cnn, ["saliency"], (x, y, masks), chosen, out=out, batch_size=2, progress=False)
    other_x, _, _ = small_data(4, seed=1)
    shifted = masks.roll(3, dims=2)
    for data in ((other_x, y, masks), (x.flip(0), y.flip(0), masks.flip(0)), (x, (y + 1) % 5, masks),
                 (x, y, shifted)):
        with pytest.raises(ValueError, match="batch 0 of the data differs"):
            evaluate(cnn, ["saliency"], data, chosen, out=out, batch_size=2, progress=False)


def test_resuming_with_another_model_is_refused(cnn, tmp_path):
    """Another model (other weights) in the same folder: its values would be mixed with the first model's."""
    x, y, _ = small_data(4)
    out = tmp_path / "evaluation"
    evaluate(cnn, ["saliency"], (x[:2], y[:2]), CHEAP, out=out, batch_size=2, progress=False)
    torch.manual_seed(1)
    other = SmallCNN().eval()
    with pytest.raises(ValueError, match="other settings.*model"):
        evaluate(other, ["saliency"], (x, y), CHEAP, out=out, batch_size=2, progress=False)
    same_weights = SmallCNN().eval()
    same_weights.load_state_dict(cnn.state_dict())  # the same model loaded again: resumes
    resumed = evaluate(same_weights, ["saliency"], (x, y), CHEAP, out=out, batch_size=2, progress=False)
    assert_same_values(resumed, evaluate(cnn, ["saliency"], (x, y), CHEAP, batch_size=2, progress=False))


def test_the_command_refuses_to_resume_on_other_images(tmp_path, capsys):
    """`--images 2` then `--images 4` in the same folder: the demo's first 2 of 4 images are not the 2 images of
    `--images 2`, so the first batch's stored values are another image's."""
    out = tmp_path / "evaluation"
    common = ["evaluate", "--model", "demo", "--methods", "saliency", "--metrics", "sparseness", "--batch-size", "2",
              "--out", str(out), "--no-progress"]
    assert main([*common, "--images", "2"]) == 0
    capsys.readouterr()
    assert main([*common, "--images", "4"]) == 2
    assert "batch 0 of the data differs" in capsys.readouterr().err


def test_a_run_that_failed_before_computing_anything_leaves_its_folder_free(cnn, tmp_path):
    """A first run refused (a localisation metric without masks) recorded its settings: the corrected rerun in the
    same folder was then refused as "other settings" although the folder held no value."""
    x, y, _ = small_data(4)
    out = tmp_path / "evaluation"
    with pytest.raises(ValueError, match=r"\['pointing_game'\] need the objects' masks"):
        evaluate(cnn, ["saliency"], (x, y), ["pointing_game", "sparseness"], out=out, progress=False)
    result = evaluate(cnn, ["saliency"], (x, y), ["sparseness"], out=out, progress=False)
    assert result.values["saliency"]["sparseness"].shape == (4,)
    with pytest.raises(ValueError, match="other settings.*metrics"):  # now it holds values: protected
        evaluate(cnn, ["saliency"], (x, y), ["pointing_game"], out=out, progress=False)


def test_the_command_on_a_folder_without_masks_runs_its_default_metrics_that_need_none(tmp_path, capsys):
    """docs/evaluation.md: `explain evaluate ... --data images/ --out evaluation/` (no --metrics). The default
    metrics hold pointing_game and energy_pointing_game, which need masks that a class folder has not: the
    command's default is then the default metrics that need no masks, and naming a localisation metric is an
    error."""
    from PIL import Image

    draws = np.random.default_rng(0)
    for name in ("disc", "square"):
        (tmp_path / "images" / name).mkdir(parents=True)
        Image.fromarray((draws.random((64, 64, 3)) * 255).astype(np.uint8)).save(tmp_path / "images" / name / "a.png")
    out = tmp_path / "evaluation"
    common = ["evaluate", "--model", "demo", "--methods", "saliency", "--data", str(tmp_path / "images"),
              "--no-progress", "--images", "2"]
    assert main([*common, "--out", str(out), "--metrics", "sparseness", "pointing_game"]) == 2
    assert "need the objects' masks" in capsys.readouterr().err
    assert main([*common, "--out", str(out)]) == 0
    header = (out / "evaluation.md").read_text(encoding="utf-8").splitlines()[0]
    assert "deletion" in header and "sparseness" in header and "random_logit" in header
    assert "pointing_game" not in header
    assert len(rows_of(out)) == 2 * 6  # two images, six metrics


# ------------------------------------------------------------------ corrupt record files


@pytest.mark.parametrize("name, text, complaint", [
    ("evaluation.csv", "hello\nworld\n", "evaluation.csv"),
    ("evaluation.csv", ",".join(FIELDS) + "\n0,saliency,sparseness,0,abc,0.1\n", "evaluation.csv.*line 2"),
    ("evaluation.csv", ",".join(FIELDS) + "\nx,saliency,sparseness,0,0.5,0.1\n", "evaluation.csv.*line 2"),
    ("evaluation.json", '{"methods": ["sal', "evaluation.json"),
    ("evaluation.json", "[1, 2]", "evaluation.json"),
])
def test_a_corrupt_record_is_an_error_naming_the_file(cnn, tmp_path, capsys, name, text, complaint):
    """A record someone edited or truncated by hand: a ValueError naming the file (the command: exit 2 and one
    line), not a KeyError, AttributeError or a bare "could not convert string to float"."""
    x, y, _ = small_data(2)
    out = tmp_path / "evaluation"
    out.mkdir()
    (out / name).write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=complaint):
        evaluate(cnn, ["saliency"], (x, y), ["sparseness"], out=out, progress=False)
    assert main(["evaluate", "--model", "demo", "--methods", "saliency", "--metrics", "sparseness", "--images", "2",
                 "--out", str(out), "--no-progress"]) == 2
    assert name in capsys.readouterr().err


def test_rows_written_twice_are_taken_once(cnn, tmp_path):
    """Two runs started on one folder at once append each group twice: a rerun takes each image's value once (it
    gave 12 values for 8 images) and writes the file back with each row once."""
    x, y, _ = small_data(8)
    out = tmp_path / "evaluation"
    expected = evaluate(cnn, ["saliency"], (x, y), CHEAP, out=out, batch_size=4, progress=False)
    values_file = out / "evaluation.csv"
    lines = values_file.read_text(encoding="utf-8").splitlines(keepends=True)
    values_file.write_text("".join(lines) + "".join(lines[1: 1 + 4 * len(CHEAP)]), encoding="utf-8")
    resumed = evaluate(cnn, ["saliency"], (x, y), CHEAP, out=out, batch_size=4, progress=False)
    assert_same_values(resumed, expected)
    assert_each_row_once(out, 2, 1, [4, 4], len(CHEAP))


# ------------------------------------------------------------------ bad inputs


def test_bad_methods_and_metrics_get_errors_naming_what_is_wrong(cnn):
    x, y, _ = small_data(2)
    with pytest.raises(ValueError, match="at least one method"):  # an empty mapping said "the data holds no images"
        evaluate(cnn, {}, (x, y), CHEAP, progress=False)
    torch.manual_seed(3)
    other = SmallCNN().eval()
    with pytest.raises(ValueError, match="'other'.*explains another model"):  # a mapping's explainer was not checked
        evaluate(cnn, {"other": explain.Saliency(other)}, (x, y), CHEAP, progress=False)
    with pytest.raises(ValueError, match="'wrong' is not an explainer"):
        evaluate(cnn, {"wrong": "saliency"}, (x, y), CHEAP, progress=False)
    with pytest.raises(ValueError, match="unknown metric 'delete'"):
        evaluate(cnn, ["saliency"], (x, y), ["sparseness", "delete"], progress=False)
    with pytest.raises(ValueError, match="a metric is given twice: sparseness"):
        evaluate(cnn, ["saliency"], (x, y), ["sparseness", METRICS["sparseness"]], progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(cnn, ["saliency"], (x, y), CHEAP, batch_size=0, progress=False)


def test_one_method_or_one_metric_may_be_given_as_a_plain_name(cnn):
    """`metrics="deletion"` was read letter by letter ("unknown metric 'd'"), `methods="saliency"` too."""
    x, y, _ = small_data(2)
    one = evaluate(cnn, "saliency", (x, y), "sparseness", progress=False)
    listed = evaluate(cnn, ["saliency"], (x, y), ["sparseness"], progress=False)
    assert_same_values(one, listed)
    assert [metric.name for metric in one.metrics] == ["sparseness"]


def test_bad_data_gets_errors_naming_what_is_wrong(cnn):
    x, y, masks = small_data(4)
    with pytest.raises(ValueError, match="the data holds no images"):
        evaluate(cnn, ["saliency"], (x[:0], y[:0]), CHEAP, progress=False)
    with pytest.raises(ValueError, match="the data holds no images"):
        evaluate(cnn, ["saliency"], iter([]), CHEAP, progress=False)
    with pytest.raises(ValueError, match=r"masks must be \(N, H, W\) at the maps' size \(16, 16\).*\(4, 8, 8\)"):
        evaluate(cnn, ["saliency"], (x, y, masks[:, :8, :8]), ["pointing_game"], progress=False)
    with pytest.raises(ValueError, match=r"masks must be \(N, H, W\) for the 4 images"):
        evaluate(cnn, ["saliency"], (x, y, masks[:3]), ["pointing_game"], progress=False)
    with pytest.raises(ValueError, match="masks 0, 1, 2, 3 are empty"):
        evaluate(cnn, ["saliency"], (x, y, torch.zeros_like(masks)), ["pointing_game"], progress=False)
    poisoned = x.clone()
    poisoned[1, 0, 3, 3] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        evaluate(cnn, ["saliency"], (poisoned, y), CHEAP, progress=False)
    with pytest.raises(ValueError, match="class index 9 is out of range"):
        evaluate(cnn, ["saliency"], (x, torch.tensor([0, 1, 2, 9])), CHEAP, progress=False)
    with pytest.raises(ValueError, match=r"labels \(N,\)"):
        evaluate(cnn, ["saliency"], (x, y[:3]), CHEAP, progress=False)
    with pytest.raises(ValueError, match="3 targets were given for a batch of 4 images"):
        evaluate(cnn, ["saliency"], [(x, y[:3])], CHEAP, progress=False)  # a DataLoader's batch
    with pytest.raises(ValueError, match=r"\['pointing_game'\] need the objects' masks"):
        evaluate(cnn, ["saliency"], [(x, y)], ["sparseness", "pointing_game"], progress=False)


def test_masks_as_a_numpy_array_are_taken_as_a_tensor(cnn):
    """`make_dataset(...).masks` is a numpy array: passed as it is, it raised AttributeError ('dim')."""
    x, y, masks = small_data(4)
    as_tensor = evaluate(cnn, ["saliency"], (x, y, masks), ["pointing_game", "auc"], batch_size=2, progress=False)
    for data in ((x, y, masks.numpy()), [(x[:2], y[:2], masks[:2].numpy()), (x[2:], y[2:], masks[2:].numpy())]):
        assert_same_values(evaluate(cnn, ["saliency"], data, ["pointing_game", "auc"], batch_size=2,
                                    progress=False), as_tensor)


class Gray(nn.Module):
    """One input channel, no BatchNorm: a grayscale classifier of any image size."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


@pytest.mark.parametrize("shape", [(3, 13, 10), (1, 9, 7)])
def test_odd_sizes_grayscale_and_a_last_batch_of_one_image_give_the_metrics_own_values(cnn, shape):
    """Non-square, odd sizes and a single channel, in batches of 2 over 3 images (the last holds one): each value
    is what the metric function gives for that image's batch; sufficiency, undefined alone, is NaN there and left
    out of the mean."""
    torch.manual_seed(0)
    model = cnn if shape[0] == 3 else Gray().eval()
    x = torch.rand(3, *shape)
    y = torch.tensor([0, 1, 2])
    masks = torch.zeros(3, *shape[1:], dtype=torch.bool)
    masks[:, 2:5, 2:5] = True
    chosen = [METRICS["deletion"].with_options(steps=3), METRICS["pointing_game"], METRICS["sufficiency"],
              METRICS["region_perturbation"].with_options(grid=2, regions=2), METRICS["continuity"]]
    result = evaluate(model, ["saliency"], (x, y, masks), chosen, batch_size=2, progress=False)
    values = result.values["saliency"]
    saliency = explain.Saliency(model, progress=False)
    for start, stop in ((0, 2), (2, 3)):
        e = saliency.explain(x[start:stop], target=y[start:stop])
        part = slice(start, stop)
        torch.testing.assert_close(values[chosen[0].name][part],
                                   metrics.deletion(model, x[part], e, y[part], steps=3).area.double())
        torch.testing.assert_close(values["pointing_game"][part], metrics.pointing_game(e, masks[part]).double())
        patch = -(-max(shape[1:]) // 2)
        torch.testing.assert_close(values[chosen[3].name][part], metrics.region_perturbation(
            model, x[part], e, y[part], patch_size=patch, regions=2).aopc.double())
        shifts = list(dict.fromkeys(round(s * shape[2]) for s in (-0.25, -0.125, -0.0625, 0.0625, 0.125, 0.25)
                                    if round(s * shape[2]) != 0))
        torch.testing.assert_close(values["continuity"][part], metrics.continuity(
            saliency, x[part], y[part], shifts=shifts).double())
    sufficiency = values["sufficiency"]
    assert not sufficiency[:2].isnan().any() and sufficiency[2].isnan()
    assert result.mean("saliency", "sufficiency") == pytest.approx(float(sufficiency[:2].mean()))
    assert result.spread("saliency", "sufficiency") == pytest.approx(float(sufficiency[:2].std()) / math.sqrt(2))


class DictOutput(TupleOutput):
    def forward(self, x):
        return {"logits": self.inner(x), "aux": x.mean()}


@pytest.mark.parametrize("wrapper, output", [(TupleOutput, 0), (DictOutput, "logits")])
def test_a_model_returning_a_tuple_or_a_dict_is_scored_on_its_logits(cnn, wrapper, output):
    """The faithfulness metrics score the explainer's output selector in the model's output: the same values as
    the plain model, whether the methods are names or explainers built with `output=`."""
    x, y, _ = small_data(4)
    chosen = [*CHEAP, METRICS["completeness"], METRICS["relative_output_stability"].with_options(samples=2),
              METRICS["faithfulness_estimate"].with_options(steps=4)]
    expected = evaluate(cnn, ["saliency"], (x, y), chosen, batch_size=2, progress=False)
    model = wrapper(cnn)
    for methods in (["saliency"], {"saliency": explain.Saliency(model, output=output)}):
        assert_same_values(evaluate(model, methods, (x, y), chosen, batch_size=2, progress=False), expected)


# ------------------------------------------------------------------ values, NaN, ranks, the files written


def test_a_custom_metric_may_return_integers_a_graph_tensor_or_a_list(cnn):
    """A user's Metric gives (N,) values of any kind: evaluate keeps them as float64 on the CPU like the registry's
    (integers broke the NaN-skipping mean: "nanmean(): expected input to have floating point dtype")."""
    x, y, _ = small_data(4)
    weight = torch.ones((), requires_grad=True)
    custom = [Metric("label", "higher", "the label", lambda given: given.targets),
              Metric("graph", "lower", "the label, in a graph", lambda given: given.targets.float() * weight),
              Metric("listed", "higher", "the label, as a list", lambda given: given.targets.tolist())]
    result = evaluate(cnn, ["saliency"], (x, y), custom, batch_size=2, progress=False)
    for metric in custom:
        values = result.values["saliency"][metric.name]
        assert values.dtype == torch.float64 and not values.requires_grad
        assert torch.equal(values, y.double())
        assert result.mean("saliency", metric.name) == pytest.approx(float(y.double().mean()))


def test_a_method_no_metric_applies_to_is_listed_last_with_a_dash():
    """Grad-CAM with completeness only (it needs input attributions): its mean rank is undefined. The table and
    the figure must still list the methods best first (a NaN key left the best method last) and show "–"."""
    lower = METRICS["completeness"]
    values = {"worse": {lower.name: torch.tensor([2.0], dtype=torch.float64)},
              "gradcam": {lower.name: torch.tensor([math.nan], dtype=torch.float64)},
              "best": {lower.name: torch.tensor([1.0], dtype=torch.float64)}}
    result = Evaluation(["worse", "gradcam", "best"], [lower], values)
    rows = result.markdown().splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == ["best", "worse", "gradcam"]
    assert rows[2] == "| gradcam | – | – |"
    import matplotlib.pyplot as plt

    figure = result.figure()
    try:
        labels = [label.get_text() for label in figure.axes[0].get_yticklabels()]
    finally:
        plt.close(figure)
    assert labels == ["best (1.0)", "worse (2.0)", "gradcam (–)"]


def test_the_written_table_figure_and_values_match_the_returned_result(cnn, tmp_path):
    x, y, masks = small_data(5)
    chosen = [*CHEAP, METRICS["completeness"], METRICS["pointing_game"], METRICS["sufficiency"]]
    out = tmp_path / "evaluation"
    result = evaluate(cnn, ["saliency", "gradcam"], (x, y, masks), chosen, out=out, batch_size=2, progress=False)
    assert (out / "evaluation.md").read_text(encoding="utf-8") == \
        (f"{result.markdown()}\n\n{result.notes_markdown()}\n\nSeconds per image of each metric:\n\n"
         f"{result.cost_markdown()}\n")
    assert (out / "evaluation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stored: dict = {}
    for row in rows_of(out):
        stored.setdefault((row["method"], row["metric"]), {})[(int(row["batch"]), int(row["image"]))] = \
            float(row["value"])
    for method in ("saliency", "gradcam"):
        for metric in chosen:
            ordered = [stored[(method, metric.name)][key] for key in sorted(stored[(method, metric.name)])]
            torch.testing.assert_close(torch.tensor(ordered, dtype=torch.float64), result.values[method][metric.name],
                                       rtol=0, atol=0, equal_nan=True)
    assert result.values["gradcam"]["completeness"].isnan().all()  # no input attributions: "–", not ranked
    assert math.isnan(result.ranks()["gradcam"]["completeness"])
    # a rerun takes everything from the record and writes the same table
    again = evaluate(cnn, ["saliency", "gradcam"], (x, y, masks), chosen, out=out, batch_size=2, progress=False)
    assert_same_values(again, result)
    assert again.markdown() == result.markdown()


def test_with_options_chained_names_what_is_computed(cnn):
    """`with_options` on a metric that already has options: the name must say the settings in force, once (it
    said "deletion(steps=4)(steps=16)" for what is the default deletion)."""
    four = METRICS["deletion"].with_options(steps=4)
    assert four.with_options(steps=8).name == "deletion(steps=8)"
    assert four.with_options(steps=8).options == {"steps": 8}
    assert four.with_options(steps=16) is METRICS["deletion"]
    both = METRICS["faithfulness_correlation"].with_options(runs=4).with_options(subset_size=8)
    assert both.name == "faithfulness_correlation(runs=4, subset_size=8)"
    assert both.measures == METRICS["faithfulness_correlation"].measures + "; with runs=4, subset_size=8"
    assert both.options == {"runs": 4, "subset_size": 8}
    x, y, _ = small_data(2)
    result = evaluate(cnn, ["saliency"], (x, y), [four.with_options(steps=8)], progress=False)
    e = explain.Saliency(cnn, progress=False).explain(x, target=y)
    torch.testing.assert_close(result.values["saliency"]["deletion(steps=8)"],
                               metrics.deletion(cnn, x, e, y, steps=8).area.double())


def test_the_command_refuses_a_method_given_twice(tmp_path, capsys):
    """`--methods gradcam gradcam` was evaluated once, silently (the API refuses it)."""
    assert main(["evaluate", "--model", "demo", "--methods", "saliency", "saliency", "--metrics", "sparseness",
                 "--images", "2", "--out", str(tmp_path / "evaluation"), "--no-progress"]) == 2
    assert "'saliency' is given twice" in capsys.readouterr().err


def test_resuming_with_another_explainer_under_the_same_name_is_refused(cnn, tmp_path):
    """A mapping name → explainer: "attribution" was Saliency, now Grad-CAM; its values would be mixed."""
    x, y, _ = small_data(4)
    out = tmp_path / "evaluation"
    evaluate(cnn, {"attribution": explain.Saliency(cnn)}, (x[:2], y[:2]), CHEAP, out=out, batch_size=2,
             progress=False)
    with pytest.raises(ValueError, match=r"other settings.*'attribution': Saliency\(.* earlier, GradCAM\(.* now"):
        evaluate(cnn, {"attribution": explain.GradCAM(cnn)}, (x, y), CHEAP, out=out, batch_size=2, progress=False)


def test_resuming_with_other_settings_of_one_explainer_under_the_same_name_is_refused(cnn, tmp_path):
    """Saliency(reduce='sum') under the name of an earlier Saliency(reduce='max'), a CAM at another layer, LRP with
    another ε, a wrapped CAM's layer: the values of two settings would be mixed in one table. The same settings
    built again (another object, another process's memory addresses) resume."""
    x, y, _ = small_data(4)
    pairs = [(lambda: explain.Saliency(cnn, reduce="maxabs"), lambda: explain.Saliency(cnn, reduce="sum")),
             (lambda: explain.GradCAM(cnn, "features.6"), lambda: explain.GradCAM(cnn, "features.3")),
             (lambda: explain.get_method("lrp")(cnn), lambda: explain.get_method("lrp")(cnn, epsilon=0.5)),
             (lambda: explain.get_method("finercam")(cnn, "features.6"),
              lambda: explain.get_method("finercam")(cnn, "features.3"))]
    for index, (earlier, other) in enumerate(pairs):
        out = tmp_path / f"evaluation{index}"
        expected = evaluate(cnn, {"m": earlier()}, (x[:2], y[:2]), CHEAP, out=out, batch_size=2, progress=False)
        with pytest.raises(ValueError, match="other settings .*method 'm': "):
            evaluate(cnn, {"m": other()}, (x, y), CHEAP, out=out, batch_size=2, progress=False)
        assert_same_values(evaluate(cnn, {"m": earlier()}, (x[:2], y[:2]), CHEAP, out=out, batch_size=2,
                                    progress=False), expected)


def test_a_dataloader_gives_the_values_of_the_tuple_and_resumes(cnn, tmp_path):
    """A torch DataLoader of (inputs, labels, masks) batches (lists, as it collates them) is the tuple cut into the
    same batches; resumed from its record, nothing is computed again."""
    from torch.utils.data import DataLoader, TensorDataset

    x, y, masks = small_data(5)
    chosen = [*CHEAP, METRICS["pointing_game"]]
    expected = evaluate(cnn, ["saliency"], (x, y, masks), chosen, batch_size=2, progress=False)
    loader = DataLoader(TensorDataset(x, y, masks), batch_size=2)
    out = tmp_path / "evaluation"
    assert_same_values(evaluate(cnn, ["saliency"], loader, chosen, out=out, progress=False), expected)
    written = rows_of(out)
    assert_same_values(evaluate(cnn, ["saliency"], loader, chosen, out=out, progress=False), expected)
    assert rows_of(out) == written
