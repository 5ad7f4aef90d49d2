"""Session 12: three error messages that pointed the wrong way now say what was wrong and what to do.

A layer that runs more than once is told a containing block that ran once in that forward (counted here with
plain hooks), or why none does (a shared block, a torch.fx GraphModule); a GraphModule's container that never
runs as a module is told why, with leaf layers that do run; a forward that reads ``batch["image"]`` is told it
takes a dict, and the wrapper the message describes gives the plain model's map.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from conftest import assert_state_equal, class_scores, gradcam_by_hand, model_state
from torch import nn

import explain

X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def runs_by_hand(model: nn.Module, names: list[str], x: torch.Tensor) -> dict[str, int]:
    """How many times each named module runs in one forward, counted with plain pre-hooks."""
    counts = dict.fromkeys(names, 0)
    handles = [model.get_submodule(name).register_forward_pre_hook(
        lambda module, args, name=name: counts.__setitem__(name, counts[name] + 1)) for name in names]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return counts


class BlockTwice(nn.Module):
    """One block applied twice: its layers run twice, and so does their parent block."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.block(self.block(self.stem(x))).mean(dim=(2, 3)))


class InnerTwiceOuterOnce(nn.Module):
    """``outer.0`` runs three times (twice called directly, once inside ``outer``), ``outer`` once."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.outer = nn.Sequential(nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU()), nn.Conv2d(4, 4, 1))
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.outer[0](self.outer[0](self.stem(x)))
        return self.fc(self.outer(x).mean(dim=(2, 3)))


class Block(nn.Module):
    """A residual block that uses its one ReLU twice (as torchvision's BasicBlock)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)


class ResidualNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.stage = nn.Sequential(Block(), Block())
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stage(self.stem(x)).mean(dim=(2, 3)))


def traced() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return torch.fx.symbolic_trace(ResidualNet().eval())


def test_a_layer_whose_parent_also_runs_twice_is_not_told_to_choose_the_parent():
    torch.manual_seed(0)
    model = BlockTwice()
    assert runs_by_hand(model, ["block", "block.0"], X) == {"block": 2, "block.0": 2}
    before = model_state(model)
    with pytest.raises(explain.LayerNotRunError) as raised:
        explain.GradCAM(model, "block.0").explain(X, target=1)
    message = str(raised.value)
    assert "'block.0' ran more than once in one forward pass (2 times" in message
    assert "choose its parent block" not in message and "no block containing it ran once" in message
    assert "'block' 2 times" in message and "separate module for each place" in message
    assert_state_equal(before, model_state(model))


def test_the_nearest_containing_block_that_ran_once_is_advised_and_explains():
    torch.manual_seed(0)
    model = InnerTwiceOuterOnce()
    counts = runs_by_hand(model, ["outer.0.0", "outer.0", "outer"], X)
    assert counts == {"outer.0.0": 3, "outer.0": 3, "outer": 1}
    with pytest.raises(explain.LayerNotRunError) as raised:
        explain.GradCAM(model, "outer.0.0").explain(X, target=1)
    message = str(raised.value)
    assert "choose 'outer', the nearest block containing it that ran once" in message
    assert "'outer.0' 3 times" in message and "choose its parent block" not in message
    explanation = explain.GradCAM(model, "outer", normalize=None).explain(X, target=[2, 2])  # the advice works
    expected = gradcam_by_hand(model, model.outer, X, class_scores([2, 2]))
    assert (expected.flatten(1).amax(1) > 0).all()
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_a_shared_relu_in_a_graph_module_is_told_about_fx_and_leaves_that_run_once():
    graph_module = traced()
    called = [str(node.target) for node in graph_module.graph.nodes if node.op == "call_module"]
    assert called.count("stage.1.relu") == 2 and "stage.1" not in called  # fx calls the leaves, never the block
    with pytest.raises(explain.LayerNotRunError) as raised:
        explain.GradCAM(graph_module, "stage.1.relu").explain(X, target=1)
    message = str(raised.value)
    assert "choose its parent block" not in message and "torch.fx GraphModule" in message
    assert "before torch.fx.symbolic_trace" in message
    assert "(e.g. 'stage.1.bn2', 'stage.1.conv2', 'stage.1.bn1', 'stage.1.conv1')" in message  # last first
    explanation = explain.GradCAM(graph_module, "stage.1.bn2", normalize=None).explain(X, target=[0, 1])
    expected = gradcam_by_hand(graph_module, graph_module.get_submodule("stage.1.bn2"), X, class_scores([0, 1]))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_a_graph_modules_container_that_never_runs_is_explained_with_its_leaves():
    graph_module = traced()
    called = [str(node.target) for node in graph_module.graph.nodes if node.op == "call_module"]
    once_under_stage = [name for name in reversed(dict.fromkeys(called))
                        if name.startswith("stage.") and called.count(name) == 1]
    assert once_under_stage[:2] == ["stage.1.bn2", "stage.1.conv2"]
    with pytest.raises(explain.LayerNotRunError) as raised:
        explain.GradCAM(graph_module, "stage").explain(X, target=1)
    message = str(raised.value)
    assert "'stage' did not run" in message
    assert "torch.fx GraphModule, which calls its leaf modules directly" in message
    assert "before torch.fx.symbolic_trace" in message
    assert f"run once, last first: {', '.join(map(repr, once_under_stage[:4]))}." in message
    # a plain model's layer that did not run gets no fx note
    plain = ResidualNet()
    plain.unused = nn.Sequential(nn.Conv2d(3, 3, 1))
    with pytest.raises(explain.LayerNotRunError) as plain_raised:
        explain.GradCAM(plain, "unused").explain(X, target=1)
    assert "fx" not in str(plain_raised.value)


class DictInput(nn.Module):
    """A model whose forward reads its image from a dict."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(self.conv(batch[self.key]).mean(dim=(2, 3)))


class Wrapped(nn.Module):
    """The wrapper the message describes."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model({self.key: x})


@pytest.mark.parametrize("key", ["image", "x"])  # torch says "too many indices" (IndexError) or "invalid data type"
@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")
def test_a_forward_that_indexes_its_input_with_a_string_is_told_it_takes_a_dict(key: str):
    torch.manual_seed(0)
    model = DictInput(key)
    with pytest.raises(explain.ModelInputError) as raised:
        explain.GradCAM(model, "conv").explain(X, target=1)
    message = str(raised.value)
    assert f"indexes the image tensor it was given with the string key {key!r}" in message
    assert "takes a dict (mapping) of inputs" in message and f"self.model({{{key!r}: x}})" in message
    assert "preprocess" not in message and "forward_args" not in message
    explanation = explain.GradCAM(Wrapped(model, key), "model.conv", normalize=None).explain(X, target=[1, 2])
    expected = gradcam_by_hand(lambda x: model({key: x}), model.conv, X, class_scores([1, 2]))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_other_index_errors_keep_the_input_size_advice():
    class Indexing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x[:, :, 9].mean(dim=-1))  # a 9th row: needs an input taller than 8 px

    with pytest.raises(explain.ModelInputError) as raised:
        explain.Saliency(Indexing()).explain(X, target=1)
    assert "pass a preprocess that produces it" in str(raised.value) and "dict" not in str(raised.value)
