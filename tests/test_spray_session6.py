"""Attacks on SpRAy (explain.strategies), session 6: two runs writing strategies into one folder at once, a
strategies.json of another method than the folder's run.json, and the border rule on maps of pure noise. Each case
is checked on two inputs (maps given as arrays and a folder; noise of two kinds; a corner and a frame strategy)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from scipy.ndimage import gaussian_filter

import explain
from explain.cli import main as cli_main
from explain.data.demo_watermark import load_watermark_demo, write_watermark_folder
from explain.dataset_tools import spray
from explain.dataset_tools.html_report import report
from explain.dataset_tools.run_folder import FolderInUseError
from explain.dataset_tools.run_record import read_run_record
from explain.dataset_tools.spray import strategies


def left_or_right(count: int, seed: int, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Maps whose relevance fills the left or the right quarter (plus a little noise), one class of ``count``:
    (maps (count, size, size), classes (count,))."""
    rng = np.random.default_rng(seed)
    maps = np.zeros((count, size, size))
    maps[: count // 2, :, : size // 4] = 1
    maps[count // 2 :, :, -size // 4 :] = 1
    return maps[rng.permutation(count)] + rng.uniform(0, 0.05, maps.shape), np.zeros(count, int)


def pictures_named_exist(out: Path) -> list[str]:
    """The mean-map PNGs that OUT/strategies.json names and that are missing (none when the folder is whole)."""
    data = json.loads((out / "strategies.json").read_text(encoding="utf-8"))
    named = [cluster["mean_map"] for entry in data["classes"] for cluster in entry["clusters"]]
    return [name for name in named if not (out / name).is_file()]


# ---- 2. Two runs into one folder at once ---------------------------------------------------------------------


@pytest.mark.parametrize("first_clusters, second_clusters", [(2, 4), (4, 2)])
def test_a_second_strategies_run_into_a_folder_being_written_is_refused(tmp_path, monkeypatch, first_clusters,
                                                                        second_clusters):
    """Run A writes its first mean map; run B, started meanwhile into the same folder, writes its own maps and
    strategies.json; A then writes its JSON and removes B's maps that it did not write. Unlocked (HEAD), B went
    through and the folder mixed the two runs' files. B must be refused with a clear error naming A's process, and
    the JSON left must name only PNGs that exist, of A's clusters."""
    maps, classes = left_or_right(40, seed=first_clusters)
    out = tmp_path / "out"
    errors: list[BaseException] = []
    original = spray.write_atomically
    started = threading.Event()

    def second_run() -> None:
        try:
            strategies(maps, classes=classes, clusters=second_clusters, out=out, progress=False)
        except BaseException as error:  # noqa: BLE001 - examined below
            errors.append(error)

    def first_picture_then_second(path: Path, write) -> None:
        original(path, write)
        if path.suffix == ".png" and not started.is_set():
            started.set()
            thread = threading.Thread(target=second_run)
            thread.start()
            thread.join(timeout=60)

    monkeypatch.setattr(spray, "write_atomically", first_picture_then_second)
    first = strategies(maps, classes=classes, clusters=first_clusters, out=out, progress=False)
    assert started.is_set()
    assert len(errors) == 1 and isinstance(errors[0], FolderInUseError), errors
    message = str(errors[0])
    assert "another run of explain strategies is writing into" in message and f"pid {os.getpid()}" in message
    assert "Wait until it ends" in message
    assert pictures_named_exist(out) == []
    pictures = sorted(path.name for path in (out / "strategies").glob("*.png"))
    assert pictures == [f"class0_cluster{k}.png" for k in range(first_clusters)]
    assert len(first.classes[0].clusters) == first_clusters
    assert not (out / "strategies" / ".explain.lock").exists()  # released and removed
    monkeypatch.setattr(spray, "write_atomically", original)
    second = strategies(maps, classes=classes, clusters=second_clusters, out=out, progress=False)  # now it goes
    assert len(second.classes[0].clusters) == second_clusters and pictures_named_exist(out) == []
    assert len(list((out / "strategies").glob("*.png"))) == second_clusters


HOLD_LOCK = """
import fcntl, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.pwrite(descriptor, f"pid {os.getpid()} on a test host, since now".encode(), 0)
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no flock on Windows: runs into one folder are not locked there")
def test_a_run_held_by_another_process_is_refused_and_a_killed_one_blocks_nothing(tmp_path):
    """Another process holds OUT/strategies (as a running ``explain strategies OUT`` does): ``Strategies.save`` and
    ``strategies(out=)`` are refused, naming it, and write nothing; once it is killed with SIGKILL (its lock file
    left behind), both go through."""
    maps, classes = left_or_right(30, seed=5)
    result = strategies(maps, classes=classes, progress=False)  # nothing written: no out=
    out = tmp_path / "out"
    (out / "strategies").mkdir(parents=True)
    lock_file = out / "strategies" / ".explain.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock_file)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUseError, match=rf"another run of explain strategies .*pid {holder.pid} on a test"):
            result.save(out)
        with pytest.raises(FolderInUseError, match="another run of explain strategies"):
            strategies(maps, classes=classes, out=out, progress=False)
        assert not (out / "strategies.json").exists() and list((out / "strategies").glob("*.png")) == []
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert lock_file.exists()  # left by the killed process, locked by no one
    assert result.save(out) == out / "strategies.json" and pictures_named_exist(out) == []
    again = strategies(maps, classes=classes, out=out, progress=False)
    assert again.json_file == out / "strategies.json" and not lock_file.exists()


def test_a_refused_or_failed_run_into_a_new_folder_leaves_no_empty_folder(tmp_path):
    """Bad maps given with out= in a folder that exists: the error is the maps', and no empty strategies/ folder
    is left behind by the lock."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="classes"):
        strategies(np.ones((30, 8, 8)), classes=None, out=out, progress=False)
    assert list(out.iterdir()) == []


# ---- 3. strategies.json of another method than run.json ------------------------------------------------------


def redo_run_keeping_strategies(out: Path, explainer) -> None:
    """Redo the batch run in ``out`` with another explainer, as a user who deletes the run's files (but not
    strategies.json and its mean maps) and runs explain batch again."""
    for path in out.iterdir():
        if path.name not in ("strategies.json", "strategies"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    explain.run(explainer, out.parent / "images", out, progress=False)


@pytest.fixture(scope="module")
def gradcam_run_with_strategies(tmp_path_factory) -> Path:
    """A batch run of GradCAM over 30 watermark images, with its strategies.json written by `explain strategies`."""
    root = tmp_path_factory.mktemp("run")
    write_watermark_folder(root / "images", count=30)
    explain.run(explain.GradCAM(load_watermark_demo(), "layer4"), root / "images", root / "out", progress=False)
    assert cli_main(["strategies", str(root / "out"), "--min-images", "5", "--no-progress"]) == 0
    assert json.loads((root / "out" / "strategies.json").read_text())["method"] == "gradcam"
    return root


def report_notes(out: Path) -> tuple[list[str], list[str]]:
    """The report's notes and the texts of the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = report(out)
    return result.notes, [str(warning.message) for warning in caught]


@pytest.mark.parametrize("method, method_class", [("saliency", "Saliency"), ("lrp", "LRP")])
def test_a_report_of_strategies_of_another_method_than_run_json_says_so(tmp_path, gradcam_run_with_strategies,
                                                                         method, method_class):
    """GradCAM's strategies were written, then the batch run was redone with another method: the report showed
    GradCAM's clusters beside the new method's maps without a word (HEAD). It must note (and warn) that
    strategies.json holds 'gradcam' strategies while run.json records the new method, and say to rerun
    `explain strategies OUT`; once that is done, the note is gone."""
    out = tmp_path / "out"
    shutil.copytree(gradcam_run_with_strategies / "out", out)
    shutil.copytree(gradcam_run_with_strategies / "images", tmp_path / "images")
    model = load_watermark_demo()
    redo_run_keeping_strategies(out, explain.Saliency(model) if method == "saliency" else explain.LRP(model))
    assert (read_run_record(out).method, read_run_record(out).method_class) == (method, method_class)
    notes, warned = report_notes(out)
    stale = [note for note in notes if "run.json records" in note]
    assert len(stale) == 1, notes
    assert f"strategies of 'gradcam' maps, but run.json records {method!r} ({method_class})" in stale[0]
    assert "Run `explain strategies OUT` again" in stale[0]
    assert any("run.json records" in text for text in warned), warned
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "run.json records" in page
    assert cli_main(["strategies", str(out), "--min-images", "5", "--no-progress"]) == 0  # the fix it names
    notes, _ = report_notes(out)
    assert not [note for note in notes if "run.json records" in note], notes


def test_strategies_of_the_same_or_an_unnamed_method_give_no_note(tmp_path, gradcam_run_with_strategies):
    """The same method (by its registry or its class name, any case), or strategies that name no method (maps
    given as an array) or a run.json that is missing: nothing to compare, no note."""
    out = tmp_path / "out"
    shutil.copytree(gradcam_run_with_strategies / "out", out)
    record = read_run_record(out)
    for named in ("gradcam", "GradCAM", "GRADCAM", "unspecified", ""):
        assert spray.other_method_note(named, record) is None, named
    assert spray.other_method_note("lrp", None) is None
    note = spray.other_method_note("lrp", record)
    assert note is not None and "'lrp' maps, but run.json records 'gradcam' (GradCAM)" in note
    notes, _ = report_notes(out)
    assert not [note for note in notes if "run.json records" in note], notes


# ---- 1. The border rule on noise ------------------------------------------------------------------------------


NOISE = {
    "uniform 8×8": lambda rng: rng.random((120, 8, 8)),
    "smooth 64×64": lambda rng: np.stack([gaussian_filter(rng.normal(size=(64, 64)), 6) for _ in range(120)]),
}


@pytest.mark.parametrize("kind", list(NOISE))
def test_the_border_rule_flags_no_cluster_of_noise(kind):
    """Maps of pure noise, 3 classes of 40: on HEAD the mean map's hottest 5 % fell in the border band (44 % of the
    image at border 1/8) about as often as not, and 15 of 20 seeds of uniform 8×8 noise (20 of 20 of smooth noise)
    had a cluster flagged. The hottest pixels picked from the other maps of a cluster are, in a map of noise, no
    hotter than its mean (lift about 1, measured at most 2 over 20 seeds): no cluster is flagged, seeds 0 … 9."""
    for seed in range(10):
        result = strategies(NOISE[kind](np.random.default_rng(seed)), classes=np.repeat(np.arange(3), 40),
                            progress=False)
        assert result.flagged == [], (seed, [cluster.reason for _, cluster in result.flagged])
        for entry in result.classes:
            for cluster in entry.clusters:
                assert cluster.size < 5 or cluster.border_lift < 2.5, (seed, cluster.border_lift)


def by_hand_border_lift(members: np.ndarray, band: np.ndarray) -> float:
    """The held-out lift in plain loops: for each map, the hottest 5 % of the pixels (np.percentile, linear) of
    the other maps' sum, those in the band; the map's mean there × pixels; the mean over the maps."""
    lifts = []
    for index, own in enumerate(members):
        others = np.delete(members, index, axis=0).sum(0)
        chosen = (others >= np.percentile(others, 95)) & band
        lifts.append(own[chosen].mean() * own.size if chosen.any() else 0.0)
    return float(np.mean(lifts))


def planted_border_strategy(kind: str, seed: int) -> np.ndarray:
    """50 maps of objects anywhere in the middle, then 20 maps whose relevance is on a corner blob ("corner") or
    on a frame 2 to 4 pixels wide ("frame"), plus noise: (70, 64, 64)."""
    rng = np.random.default_rng(seed)
    rows, columns = np.mgrid[:64, :64]

    def blob(centre: np.ndarray, width: float) -> np.ndarray:
        return np.exp(-((rows - centre[0]) ** 2 + (columns - centre[1]) ** 2) / (2 * width**2))

    objects = [blob(rng.uniform(16, 48, 2), rng.uniform(5, 8)) for _ in range(50)]
    fixed = []
    for _ in range(20):
        if kind == "corner":
            fixed.append(blob(np.array([60.0, 3.0]) + rng.normal(0, 1, 2), rng.uniform(2, 3)))
        else:
            frame, width = np.zeros((64, 64)), int(rng.integers(2, 5))
            frame[:width] = frame[-width:] = frame[:, :width] = frame[:, -width:] = rng.uniform(0.5, 1.0)
            fixed.append(frame)
    return np.stack(objects + fixed) + rng.uniform(0, 0.05, (70, 64, 64))


@pytest.mark.parametrize("kind, seed", [("corner", 1), ("corner", 2), ("frame", 1), ("frame", 2)])
def test_a_planted_corner_or_frame_strategy_is_still_flagged_by_the_border_rule(kind, seed):
    """A real border strategy (a corner blob; a frame) keeps being flagged, each of its maps holding several times
    its mean relevance on the band's hottest pixels picked without it; the lift equals a by-hand computation."""
    maps = planted_border_strategy(kind, seed)
    (entry,) = strategies(maps, classes=np.zeros(70, int), progress=False).classes
    fixed = set(range(50, 70))
    caught = set().union(*({int(m) for m in c.members} for c in entry.clusters if c.flagged))
    assert len(caught & fixed) >= 18, [(c.size, c.border_share, c.border_lift) for c in entry.clusters]
    normalised = spray.normalise(spray.downsample(maps, (32, 32)))
    band = np.ones((32, 32), bool)
    band[4:28, 4:28] = False
    for cluster in entry.clusters:
        members = normalised[[int(m) for m in cluster.members]]
        if cluster.size >= 5:
            assert cluster.border_lift == pytest.approx(by_hand_border_lift(members, band), rel=1e-6)
        if cluster.flagged and "border band" in cluster.reason:
            assert cluster.border_lift >= spray.BORDER_LIFT and "times its mean relevance per pixel" in cluster.reason
