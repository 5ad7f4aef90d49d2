"""Layer lookup, hook hygiene and error messages of the capture core."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch
import torchvision
from conftest import SmallCNN, assert_state_equal, hook_count, model_state
from torch import nn

from explain import GradCAM, LayerNotFoundError, LayerNotRunError, find_layers


def test_unknown_layer_lists_the_closest_names():
    model = torchvision.models.resnet18()
    with pytest.raises(LayerNotFoundError) as error:
        GradCAM(model, "layer5")
    message = str(error.value)
    assert "'layer5'" in message and "'layer4'" in message and "explain layers" in message
    with pytest.raises(LayerNotFoundError, match="'layer4.1.conv2'"):
        GradCAM(model, "layer4.1.conv3")


def test_layers_by_name_module_glob_and_type():
    model = torchvision.models.resnet18()
    assert find_layers(model, "layer4") == [("layer4", model.layer4)]
    assert find_layers(model, model.layer3[1]) == [("layer3.1", model.layer3[1])]
    assert [name for name, _ in find_layers(model, "layer*")] == ["layer1", "layer2", "layer3", "layer4"]
    assert [name for name, _ in find_layers(model, "layer?.*.conv2")] == [
        f"layer{stage}.{block}.conv2" for stage in range(1, 5) for block in range(2)]
    assert [name for name, _ in find_layers(model, "layer4.**")] == [
        name for name, _ in model.named_modules() if name.startswith("layer4.")]
    assert len(find_layers(model, nn.Conv2d)) == sum(isinstance(m, nn.Conv2d) for m in model.modules())
    with pytest.raises(LayerNotFoundError, match="not part of the model"):
        find_layers(model, nn.Conv2d(1, 1, 1))
    with pytest.raises(LayerNotFoundError, match="matches no layer"):
        find_layers(model, "encoder.*")


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Conv2d(3, 4, 3, padding=1)
        self.unused = nn.Conv2d(3, 4, 3, padding=1)
        self.shared = nn.ReLU()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.shared(self.shared(self.used(x))).mean(dim=(2, 3)))


def test_layer_that_did_not_run_or_ran_twice_is_an_error_and_leaves_no_hook():
    model = Branchy().eval()
    before = model_state(model)
    with pytest.raises(LayerNotRunError, match="did not run"):
        GradCAM(model, "unused").explain(torch.randn(1, 3, 8, 8))
    assert_state_equal(before, model_state(model))
    with pytest.raises(LayerNotRunError, match="ran more than once"):
        GradCAM(model, "shared").explain(torch.randn(1, 3, 8, 8))
    assert_state_equal(before, model_state(model))


def test_no_hook_between_calls_and_plain_forward_stores_nothing():
    model = SmallCNN().eval()
    explainer = GradCAM(model, "features.6")
    explainer.explain(torch.randn(1, 3, 16, 16))
    assert hook_count(model) == 0
    assert not any(isinstance(value, torch.Tensor) for value in vars(explainer).values())
    model(torch.randn(1, 3, 16, 16))
    assert hook_count(model) == 0


def test_layer_with_non_tensor_output_is_refused_clearly():
    class TupleLayer(nn.Module):
        def forward(self, x):
            return x, x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = TupleLayer()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(self.pair(x)[0].mean(dim=(2, 3)))

    with pytest.raises(TypeError, match="returned a tuple"):
        GradCAM(Model(), "pair").explain(torch.randn(1, 3, 4, 4))


def test_two_hundred_calls_leave_no_hook_and_flat_memory():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    explainer = GradCAM(model, "features.6")
    x = torch.randn(2, 3, 16, 16)
    for _ in range(20):  # warm-up: allocator caches, lazy imports
        explainer.explain(x)
    gc.collect()
    tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    for _ in range(200):
        explainer.explain(x)
    gc.collect()
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert hook_count(model) == 0
    assert end - start < 200_000, f"Python memory grew by {end - start} bytes over 200 calls"
