"""Dataset-scale runs: a folder or DataLoader to disk, resumable, sharded under torchrun."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import explain
from explain.cli import main
from explain.data import CLASS_NAMES, load_demo_model, make_dataset
from explain.dataset_tools.batch import item_id, run
from explain.dataset_tools.index import MapReader
from explain.dataset_tools.stored_maps import load_maps


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    data = make_dataset(200, seed=11)
    for index, image in enumerate(data.images):
        subfolder = folder / ("a" if index % 2 else "b")
        subfolder.mkdir(exist_ok=True)
        Image.fromarray(image).save(subfolder / f"shape{index:03d}.png")
    return folder


def read_index(path: Path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_run_writes_every_result_resumes_and_keeps_memory_flat(image_folder, tmp_path):
    model = load_demo_model()
    explainer = explain.GradCAM(model, "layer4", class_names=CLASS_NAMES)
    out = tmp_path / "out"
    calls = []
    original = explainer.explain

    def interrupted(*args, **kwargs):
        if len(calls) == 5:
            raise KeyboardInterrupt  # the user presses Ctrl-C during the sixth batch
        calls.append(len(args[0]))
        return original(*args, **kwargs)

    explainer.explain = interrupted
    with pytest.raises(KeyboardInterrupt):
        run(explainer, image_folder, out, batch_size=16, progress=False)
    assert len(read_index(out / "index.csv")) == 5 * 16

    explainer.explain = lambda *args, **kwargs: (calls.append(len(args[0])), original(*args, **kwargs))[1]
    memory = []

    def sample(done):
        memory.append(tracemalloc.get_traced_memory()[0])

    tracemalloc.start()
    run(explainer, image_folder, out, batch_size=16, progress=False, overlays=True, on_batch=sample)
    tracemalloc.stop()
    assert sum(calls) == 200  # the 80 finished images were not explained again
    rows = read_index(out / "index.csv")
    assert len(rows) == 200 and len({row["id"] for row in rows}) == 200
    assert max(memory[2:]) - memory[2] < 500_000, "memory grew across the run"
    row = rows[0]
    saved = MapReader(out).read(row).numpy()
    assert saved.shape == (1, 64, 64) and 0 <= saved.min() and saved.max() <= 1
    reference = original(str(image_folder / row["image"].split(str(image_folder) + os.sep)[-1]))
    np.testing.assert_allclose(saved[0], reference.maps[0].numpy(), atol=1e-3)
    assert row["class_name"] == CLASS_NAMES[int(row["target"])] and float(row["probability"]) > 0.5
    assert (out / "overlays" / f"{rows[-1]['id']}.png").exists()  # written by the resumed run
    run(explainer, image_folder, out, batch_size=16, progress=False)  # everything done: nothing to do
    assert sum(calls) == 200


def test_run_over_a_dataloader_with_topk(tmp_path):
    model = load_demo_model()
    data = make_dataset(10, seed=3)
    batch = torch.from_numpy(data.images).permute(0, 3, 1, 2).float() / 255
    normalized = explain.Normalize()(batch[0])  # one image, to check the layout below
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.stack([explain.Normalize()(image) for image in batch]), torch.from_numpy(data.labels)), batch_size=4)
    index = run(explain.GradCAM(model, "layer4"), loader, tmp_path, topk=2, progress=False).index
    rows = read_index(index)
    assert len(rows) == 20 and [row["id"] for row in rows[:2]] == ["00000000", "00000000"]
    assert MapReader(tmp_path).read(rows[0]).shape == (2, 64, 64)
    expected = explain.GradCAM(model, "layer4").explain(normalized, topk=2)
    assert [int(row["target"]) for row in rows[:2]] == expected.targets[0].tolist()
    # the batches' labels fill the label columns; the top class is the prediction (role topk)
    with torch.no_grad():
        probabilities = model(torch.stack([explain.Normalize()(image) for image in batch])).softmax(1)
    for row in rows:
        image = int(row["id"])
        assert (row["label"], row["role"]) == (str(data.labels[image]), "topk")
        assert row["predicted"] == str(int(probabilities[image].argmax()))
        assert float(row["confidence"]) == pytest.approx(float(probabilities[image].max()), abs=1e-5)
        assert row["correct"] == str(int(data.labels[image] == probabilities[image].argmax()))


def test_explain_batch_command_and_torchrun_shards_each_image_once(image_folder, tmp_path):
    small = tmp_path / "small"
    for path in sorted(image_folder.rglob("*.png"))[:12]:
        (small / path.parent.name).mkdir(parents=True, exist_ok=True)
        (small / path.parent.name / path.name).write_bytes(path.read_bytes())
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29533",
               "-m", "explain", "batch", str(small), "--model", "demo", "--out", str(out), "--batch-size", "4",
               "--no-progress"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_index(out / "index.csv")
    assert sorted(row["id"] for row in rows) == sorted(item_id(path, small) for path in small.rglob("*.png"))
    assert not list(out.glob("index.rank*.csv"))
    assert sorted(item for path in (out / "maps").iterdir() for item in load_maps(path).ids) == sorted(
        row["id"] for row in rows)  # each image's maps once, in one file
    assert main(["batch", str(small), "--model", "demo", "--out", str(out), "--no-progress"]) == 0
    assert len(read_index(out / "index.csv")) == 12  # resumed: nothing added
