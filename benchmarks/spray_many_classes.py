"""SpRAy (explain.strategies) on many small classes: the nearest-neighbour graph by numpy for classes of up to
spray.SMALL_CLASS maps, against scikit-learn for every class (the path before), in one process.

    python benchmarks/spray_many_classes.py [--classes 1000] [--per-class 3] [--side 16] [--repeats 1] [--write]

Random maps (``--classes`` × ``--per-class``, ``--side``², seeded), ``min_images`` = ``--per-class``. Times: the
floor (reading the maps as strategies does: downsampling and normalising, ``spray._load_arrays``), then
strategies with the numpy graph and with ``SMALL_CLASS = 0`` (scikit-learn for every class), in turn, each the
median of ``--repeats``, as a multiple of the floor measured in the same run. Checks that both give the same
eigenvalues and clusters. With ``--write``, puts the table in benchmarks/RESULTS.md ("SpRAy on many small
classes").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_section  # noqa: E402

from explain.dataset_tools import spray  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--per-class", type=int, default=3)
    parser.add_argument("--side", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--write", action="store_true")
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    maps = rng.random((options.classes * options.per_class, options.side, options.side)).astype(np.float32)
    classes = np.repeat(np.arange(options.classes), options.per_class)
    size = (options.side, options.side)

    def run() -> spray.Strategies:
        return spray.strategies(maps, classes=classes, size=size, min_images=options.per_class, progress=False)

    small_class = spray.SMALL_CLASS
    spray.strategies(maps[:30], classes=classes[:30], size=size, min_images=options.per_class, progress=False)
    spray.SMALL_CLASS = 0  # warm up scikit-learn's path too (its import is not part of either time)
    spray.strategies(maps[:30], classes=classes[:30], size=size, min_images=options.per_class, progress=False)
    times: dict[str, list[float]] = {"floor": [], "numpy": [], "sklearn": []}
    results = {}
    for _ in range(options.repeats):
        started = time.perf_counter()
        spray._load_arrays(maps, classes, None, None, size)
        times["floor"].append(time.perf_counter() - started)
        for name, limit in (("numpy", small_class), ("sklearn", 0)):
            spray.SMALL_CLASS = limit
            started = time.perf_counter()
            results[name] = run()
            times[name].append(time.perf_counter() - started)
            print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    spray.SMALL_CLASS = small_class
    same = all(np.array_equal(one.eigenvalues, other.eigenvalues) and one.eigengap_clusters == other.eigengap_clusters
               and [c.members for c in one.clusters] == [c.members for c in other.clusters]
               for one, other in zip(results["numpy"].classes, results["sklearn"].classes))
    same = same and len(results["numpy"].classes) == len(results["sklearn"].classes)
    floor, fast, slow = (statistics.median(times[name]) for name in ("floor", "numpy", "sklearn"))
    body = (
        f"`python benchmarks/spray_many_classes.py --classes {options.classes} --per-class {options.per_class} "
        f"--side {options.side} --repeats {options.repeats}`: random maps, {options.classes} classes × "
        f"{options.per_class} maps of {options.side}×{options.side}, min_images={options.per_class}. Floor: reading "
        "and normalising the maps (`spray._load_arrays`). Before: scikit-learn's `kneighbors_graph` for every class "
        "(`SMALL_CLASS = 0`); after: the numpy graph for classes of up to `SMALL_CLASS` maps.\n\n"
        "| path | seconds | × floor | seconds per class |\n| --- | ---: | ---: | ---: |\n"
        f"| floor (read + normalise) | {floor:.3f} | 1 | {floor / options.classes * 1e3:.2f} ms |\n"
        f"| before (scikit-learn) | {slow:.2f} | {slow / floor:.0f} | {slow / options.classes * 1e3:.1f} ms |\n"
        f"| after (numpy) | {fast:.2f} | {fast / floor:.0f} | {fast / options.classes * 1e3:.1f} ms |\n\n"
        f"Speed-up {slow / fast:.1f}×; eigenvalues, eigengap counts and clusters identical: {same}.")
    print(body)
    if not same:
        raise SystemExit("the two paths disagree")
    if options.write:
        write_section("SpRAy on many small classes", body)


if __name__ == "__main__":
    main()
