"""SpRAy's nearest-neighbour graph for small classes (numpy, ``small_knn_columns``) against scikit-learn's
``kneighbors_graph``: the same graph, eigenvalues and clusters, also where maps are duplicated (ties)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import sparse

from explain.dataset_tools import spray
from explain.dataset_tools.spray import (
    SMALL_CLASS,
    class_neighbors,
    knn_affinity,
    laplacian_eigenvalues,
    normalise,
    small_knn_columns,
    spectral_labels,
    strategies,
)


def sklearn_affinity(features: np.ndarray, neighbors: int) -> sparse.csr_matrix:
    """The reference: the affinity as computed before the numpy path, by scikit-learn alone."""
    connectivity = spray.sklearn_knn_connectivity(features, neighbors)
    return sparse.csr_matrix((connectivity + connectivity.T) * 0.5)


def random_features(rng: np.random.Generator, count: int, side: int, duplicates: int, kind: str,
                    many: bool) -> np.ndarray:
    """(count, side²) normalised maps (non-negative, sum 1) as analyse_class gets them; ``duplicates`` of the rows
    replaced by copies of others (``many``: a few rows copied several times, groups of identical maps)."""
    if kind == "noise":
        maps = rng.random((count, side, side))
    elif kind == "sparse":  # mostly zeros: many exactly equal distances
        maps = (rng.random((count, side, side)) < 0.05) * rng.integers(1, 3, (count, side, side))
    else:  # one-hot maps: every pair of distinct maps at the same distance
        maps = np.zeros((count, side, side))
        maps.reshape(count, -1)[np.arange(count), rng.integers(0, side * side, count)] = 1.0
    features = normalise(maps).reshape(count, -1).astype(np.float64)
    if duplicates:  # pairs of identical maps, and where ``many``, rows copied several times
        places = rng.permutation(count)
        sources = rng.choice(max(1, count // 4), duplicates) if many else places[duplicates : 2 * duplicates]
        features[places[:duplicates]] = features[sources]
    return features


def same_arrays(one: sparse.csr_matrix, other: sparse.csr_matrix) -> bool:
    """Whether two CSR matrices are stored alike, array for array (values, order, dtypes): then all that is computed
    from them is too."""
    return all(np.array_equal(getattr(one, name), getattr(other, name))
               and getattr(one, name).dtype == getattr(other, name).dtype for name in ("data", "indices", "indptr"))


CASES = [  # count, side, duplicates, kind, many
    (3, 16, 1, "noise", False), (4, 4, 2, "noise", False), (5, 8, 3, "sparse", True), (7, 16, 0, "onehot", False),
    (12, 8, 6, "noise", True), (20, 16, 0, "noise", False), (25, 8, 12, "sparse", True), (64, 32, 0, "noise", False),
    (SMALL_CLASS, 16, 0, "noise", False), (128, 16, 50, "noise", True)]


@pytest.mark.parametrize("count, side, duplicates, kind, many", CASES)
def test_the_small_class_graph_eigenvalues_and_clusters_equal_scikit_learns(count, side, duplicates, kind, many):
    rng = np.random.default_rng(count * 1000 + side * 10 + duplicates)
    features = random_features(rng, count, side, duplicates, kind, many)
    for neighbors in sorted({class_neighbors(10, count), class_neighbors(1, count), class_neighbors(3, count)}):
        expected = sklearn_affinity(features, neighbors)
        columns = small_knn_columns(features, neighbors)
        # Without ties (distinct maps of noise) the numpy path runs; where they matter (copies of a map among the
        # neighbours, one-hot maps all at one distance) it declines, as scikit-learn orders them by rounding.
        if duplicates == 0 and kind == "noise":
            assert columns is not None
        if many or kind == "onehot":
            assert columns is None
        if columns is not None:
            rows = np.repeat(np.arange(count), neighbors)
            connectivity = sparse.csr_matrix((np.ones(columns.size), (rows, columns.reshape(-1))), (count, count))
            assert (connectivity != spray.sklearn_knn_connectivity(features, neighbors)).nnz == 0
        affinity = knn_affinity(features, neighbors)
        assert same_arrays(affinity, expected)  # the same graph, stored alike (also where scikit-learn ran)
        spectrum = min(8, count - 1) + 1
        eigenvalues = laplacian_eigenvalues(affinity, spectrum)
        np.testing.assert_array_equal(eigenvalues, laplacian_eigenvalues(expected, spectrum))
        for clusters in sorted({2, min(3, count - 1)}):
            if eigenvalues[clusters] - eigenvalues[clusters - 1] > 1e-6:  # else the clusters are not unique
                np.testing.assert_array_equal(spectral_labels(affinity, clusters, 0),
                                              spectral_labels(expected, clusters, 0))


def test_the_graph_is_the_by_hand_one_and_ties_at_the_cut_go_to_scikit_learn():
    # Maps 0 and 1 identical (e0), map 2 at e15, map 3 near it: with 1 neighbour, 0 ↔ 1 and 2 ↔ 3, by hand
    # (‖e0 − e15‖² = 2, ‖3 − 2‖² = 0.18, ‖3 − 0‖² = 0.98); scikit-learn agrees.
    base = np.zeros((4, 16))
    base[[0, 1], 0] = 1.0
    base[2, 15] = 1.0
    base[3, [0, 15]] = 0.3, 0.7
    columns = small_knn_columns(base, 1)
    assert columns is not None and columns[:, 0].tolist() == [1, 0, 3, 2]  # 0's copy ties with 0 itself: no matter
    assert (spray.sklearn_knn_connectivity(base, 1) != sparse.csr_matrix(
        (np.ones(4), ([0, 1, 2, 3], [1, 0, 3, 2])), (4, 4))).nnz == 0
    # A third copy of e0: each copy's nearest other copy is a tie that scikit-learn breaks by rounding — declined,
    # and knn_affinity gives scikit-learn's graph.
    tied = np.concatenate([base, base[:1]])
    assert small_knn_columns(tied, 1) is None
    assert (knn_affinity(tied, 1) != sklearn_affinity(tied, 1)).nnz == 0
    assert small_knn_columns(np.ones((3, 16)), 1) is None
    assert small_knn_columns(base[:, :8], 1) is None  # too few features: scikit-learn searches a tree


def test_strategies_on_many_small_classes_equal_the_scikit_learn_path(monkeypatch):
    rng = np.random.default_rng(7)
    maps = rng.random((20 * 5, 16, 16))
    maps[5:10] = maps[5]  # a class of identical maps
    maps[12] = maps[11]
    classes = np.repeat(np.arange(20), 5)
    asked = []
    by_sklearn = spray.sklearn_knn_connectivity
    monkeypatch.setattr(spray, "sklearn_knn_connectivity", lambda *given: asked.append(1) or by_sklearn(*given))
    fast = strategies(maps, classes=classes, size=(16, 16), min_images=3, progress=False)
    assert len(asked) == 2  # the classes with copies of a map (1 and 2); the 18 others by numpy
    monkeypatch.setattr(spray, "SMALL_CLASS", 0)  # every class by scikit-learn
    slow = strategies(maps, classes=classes, size=(16, 16), min_images=3, progress=False)
    assert len(fast.classes) == len(slow.classes) == 20
    for one, other in zip(fast.classes, slow.classes):
        np.testing.assert_array_equal(one.eigenvalues, other.eigenvalues)
        assert one.eigengap_clusters == other.eigengap_clusters
        assert [cluster.members for cluster in one.clusters] == [cluster.members for cluster in other.clusters]
