"""``explain demo --debugging``: model debugging over a data set, end to end, on a model with a known flaw.

The watermark demo model (``explain.data.demo_watermark``) learned the synthetic shapes and also a small tag that
most training images of "square" carry in the bottom-right corner. The demo writes held-out images in ImageFolder
layout, explains each with LRP (``explain.run`` with the folders as labels: misclassified images get the true and
the predicted class's maps), finds each class's strategies with SpRAy (``explain.strategies``) and writes the HTML
report (``explain.report``), where the tag's cluster of "square" is flagged.

    OUT/images/<class>/<index>.png     the held-out images
    OUT/run/index.csv, maps/, overlays/, run.json, strategies.json, strategies/, report.html
    OUT/demo.json                      the number of images, so that a rerun with another count is refused
                                       (the images differ with the count: the folder would mix them)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ..dataset_tools.batch import RunSummary, run
from ..dataset_tools.html_report import ReportResult, report
from ..dataset_tools.run_folder import write_atomically
from ..dataset_tools.spray import Strategies, strategies
from ..methods import LRP
from .demo_watermark import load_watermark_demo, write_watermark_folder
from .synthetic import CLASS_NAMES

RECORD = "demo.json"


@dataclass
class DebuggingDemo:
    """What the demo wrote: the images folder, the run's summary, the strategies found and the report."""

    images: Path
    summary: RunSummary
    strategies: Strategies
    report: ReportResult


def run_debugging_demo(out: Union[str, Path] = "explain-debugging", count: int = 400,
                       progress: bool = True) -> DebuggingDemo:
    """Write ``count`` held-out images of the watermark demo under ``out/images``, explain them (LRP, labels from
    the folders) into ``out/run``, find the strategies and write ``out/run/report.html``. Resumable: a rerun
    explains only what is missing. No network."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a folder for the demo's output (it is created if missing).")
    _claim_folder(out, count)
    images = write_watermark_folder(out / "images", count=count)
    explainer = LRP(load_watermark_demo(), class_names=list(CLASS_NAMES), progress=False)
    results = out / "run"
    summary = run(explainer, images, results, labels="folders", overlays=True, progress=progress)
    found = strategies(results, progress=progress)
    page = report(results)
    return DebuggingDemo(images, summary, found, page)


def _claim_folder(out: Path, count: int) -> None:
    """Record ``count`` in OUT/demo.json, or check it against the one there: the held-out images
    differ with the count, so a rerun with another count would put both sets in one folder, and
    keep the maps of the images that it overwrites. A folder that holds anything else is refused."""
    record = out / RECORD
    if record.is_file():
        try:
            earlier = json.loads(record.read_text(encoding="utf-8")).get("count")
        except (OSError, ValueError, AttributeError):
            earlier = None
        if earlier != count:
            raise ValueError(f"{out} holds the debugging demo of {earlier} images, and the images differ with the "
                             f"count: give another --out for {count} images, or --count {earlier} to go on.")
        return
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty and is not a folder of the debugging demo: give a new or empty folder "
                         "(the demo explains every image under OUT/images).")
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(record, lambda temporary: temporary.write_text(json.dumps({"count": count}), encoding="utf-8"))


def describe(demo: DebuggingDemo) -> str:
    """A few lines for the terminal: accuracy, the flagged strategies and where the report is."""
    summary = demo.summary
    lines = [f"explained {summary.explained} image(s) ({summary.already_done} done before) into "
             f"{summary.index.parent}; {summary.misclassified} misclassified of {summary.labelled} labelled"]
    for entry, cluster in demo.strategies.flagged:
        lines.append(f"flagged: class {entry.class_name!r}, cluster {cluster.cluster} of {cluster.size} image(s): "
                     f"{cluster.reason}")
    for skipped in demo.strategies.skipped:
        lines.append(f"not analysed: class {skipped.class_name!r}: {skipped.reason}")
    if not demo.strategies.flagged:
        analysed = len(demo.strategies.classes)
        lines.append(f"no strategy flagged among the {analysed} class(es) analysed" if analysed else
                     "no class analysed: too few images of each (give a larger --count)")
    lines.append(f"report: {demo.report.page} (open it in a browser; it works offline)")
    return "\n".join(lines)
