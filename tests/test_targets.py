"""The shape rules of targets."""

from __future__ import annotations

import pytest
import torch

from explain.core.targets import select_targets

OUTPUT = torch.tensor([[0.5, 3.0, -1.0, 2.0], [5.0, 0.0, 1.0, 4.0]])


def test_none_is_top1_int_is_broadcast_and_sequence_is_per_image():
    top1 = select_targets(OUTPUT, None)
    assert top1.class_indices.tolist() == [[1], [0]] and not top1.keep_target_dim
    assert top1.scores.tolist() == [[3.0], [5.0]]
    assert select_targets(OUTPUT, 2).class_indices.tolist() == [[2], [2]]
    assert select_targets(OUTPUT, [3, 1]).scores.tolist() == [[2.0], [0.0]]
    assert select_targets(OUTPUT, torch.tensor([3, 1])).class_indices.tolist() == [[3], [1]]


def test_k_targets_per_image_keep_the_k_dimension():
    nested = select_targets(OUTPUT, [[0, 1], [2, 3]])
    assert nested.keep_target_dim and nested.scores.tolist() == [[0.5, 3.0], [1.0, 4.0]]
    top2 = select_targets(OUTPUT, None, topk=2)
    assert top2.keep_target_dim and top2.class_indices.tolist() == [[1, 3], [0, 3]]
    assert select_targets(OUTPUT, None, topk=1).keep_target_dim


def test_probabilities_are_the_softmax_of_the_explained_classes():
    selected = select_targets(OUTPUT, [3, 1])
    expected = OUTPUT.softmax(1)[torch.arange(2), torch.tensor([3, 1])]
    torch.testing.assert_close(selected.probabilities[:, 0], expected)


def test_callable_targets():
    selected = select_targets(OUTPUT, lambda out: out.sum(1))
    assert selected.scores.tolist() == [[4.5], [10.0]] and selected.class_indices is None
    assert select_targets(OUTPUT, lambda out: out[:, :2]).keep_target_dim


@pytest.mark.parametrize(
    "target, topk, message",
    [
        ([1, 2, 3], None, "3 targets were given for a batch of 2"),
        ([1], None, "1 targets were given for a batch of 2"),
        (4, None, "out of range.*4 classes"),
        (-1, None, "out of range"),
        ([[0, 9], [1, 1]], None, "out of range"),
        (1.5, None, "must be integers"),
        ("cat", None, "target must be"),
        (1, 2, "either target or topk"),
        (None, 9, "topk must be"),
        (lambda out: out.sum(), None, "shape \\(N,\\) or \\(N, K\\)"),
        (lambda out: out[:1, 0], None, "returned 1 scores for a batch of 2"),
    ],
)
def test_bad_targets_are_refused_with_the_fix(target, topk, message):
    with pytest.raises((ValueError, TypeError), match=message):
        select_targets(OUTPUT, target, topk, batch_size=2)


def test_class_targets_need_class_scores():
    with pytest.raises(ValueError, match="Pass a callable target"):
        select_targets(torch.zeros(2, 3, 4, 4), 1)
