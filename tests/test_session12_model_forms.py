"""Models in the forms users hand over: torch.fx GraphModules, torch.compile and DataParallel wrappers, a module
used twice in one forward, residual sums written in the forward, dropout in train mode. Each map equals the same
method on the plain model (or Grad-CAM by hand); where no layer can be chosen, the refusal says why; the model is
left as found, also after an error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from conftest import assert_state_equal, class_scores, gradcam_by_hand, model_state
from torch import nn

import explain


class Block(nn.Module):
    """torchvision's BasicBlock in small: one ReLU module used twice, the shortcut summed in the forward."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + x)


class ResidualNet(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU())
        self.stage = nn.Sequential(Block(6), Block(6))
        self.fc = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stage(self.stem(x)).mean(dim=(2, 3)))


class TopLevelResidual(nn.Module):
    """The shortcut written in the model's own forward: the last block runs once but the sum goes around it."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1))
        self.fc = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stem(x)
        return self.fc((features + self.block(features)).relu().mean(dim=(2, 3)))


def residual_net() -> ResidualNet:
    torch.manual_seed(0)
    model = ResidualNet().eval()
    for module in model.modules():  # running statistics that are not the identity
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model


def awkward_state(model: nn.Module) -> nn.Module:
    """Modes and flags an explainer must not touch: train mode with one module in eval, one parameter frozen."""
    model.train()
    model.fc.eval()
    next(model.parameters()).requires_grad_(False)
    return model


X = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))


def test_every_path_nodes_by_hand():
    """x → a = 2x → (exp(a), sin(a)) → sum: a's node is on every path from the sum to x, each branch's is not."""
    from explain.core.layers import _nodes_on_every_path

    x = torch.randn(3, requires_grad=True)
    a = x * 2
    b, c = a.exp(), a.sin()
    out = b + c
    on_every_path = _nodes_on_every_path([out.grad_fn], x)
    assert id(a.grad_fn) in on_every_path and id(out.grad_fn) in on_every_path
    assert id(b.grad_fn) not in on_every_path and id(c.grad_fn) not in on_every_path
    detached = (x.detach() * 3).requires_grad_()  # a root that does not reach x: no node is on a path to it
    assert _nodes_on_every_path([(detached * 2).grad_fn], x) == set()
    # two roots (a tuple output): a node is on every path when both roots' paths go through it
    assert id(a.grad_fn) in _nodes_on_every_path([b.grad_fn, c.grad_fn], x)
    assert id(b.grad_fn) not in _nodes_on_every_path([b.grad_fn, c.grad_fn], x)


def test_plain_residual_model_gets_its_stage_by_hand():
    model = residual_net()
    explanation = explain.GradCAM(model, normalize=None).explain(X, target=[1, 2])
    assert explanation.layer == "stage"
    expected = gradcam_by_hand(model, model.stage, X, class_scores([1, 2]))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_fx_graph_module_default_layer_is_refused_not_a_residual_branch():
    """symbolic_trace runs each block's modules one by one: 'stage' never runs, the block's output is the second
    call of its shared ReLU, and the last layer that runs once ('stage.1.bn2') is bypassed by the shortcut. Its map
    (not the stage's) was chosen silently; now the call says why and what to do, and leaves the model as found."""
    graph_module = awkward_state(torch.fx.symbolic_trace(residual_net()))
    before = model_state(graph_module)
    with pytest.raises(ValueError, match=r"torch\.fx GraphModule.*'stage\.1\.bn2' for the evidence"):
        explain.GradCAM(graph_module).explain(X, target=1)
    assert_state_equal(before, model_state(graph_module))


def test_top_level_residual_default_layer_is_refused():
    torch.manual_seed(0)
    model = TopLevelResidual().eval()
    with pytest.raises(ValueError, match=r"'block' for the evidence that goes through it, or 'stem'"):
        explain.GradCAM(model).explain(X, target=1)
    for layer in ("block", "stem"):  # a named layer is explained as named
        explanation = explain.GradCAM(model, layer, normalize=None).explain(X, target=[1, 2])
        expected = gradcam_by_hand(model, model.get_submodule(layer), X, class_scores([1, 2]))
        torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_fx_graph_module_named_layers_and_whole_model_methods_equal_the_plain_model():
    plain = residual_net()
    graph_module = awkward_state(torch.fx.symbolic_trace(copy.deepcopy(plain)))
    before = model_state(graph_module)
    explanation = explain.GradCAM(graph_module, "stage.1.bn2", normalize=None).explain(X, target=[1, 0])
    expected = gradcam_by_hand(plain, plain.stage[1].bn2, X, class_scores([1, 0]))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)
    for method, options in [(explain.Saliency, {}), (explain.IntegratedGradients, {"steps": 4}),
                            (explain.LRP, {"composite": "epsilon_plus"})]:
        expected = method(plain, normalize=None, **options).explain(X, target=1).raw_maps
        torch.testing.assert_close(method(graph_module, normalize=None, **options).explain(X, target=1).raw_maps,
                                   expected, rtol=1e-5, atol=1e-8)
    with pytest.raises(explain.LayerNotRunError, match="'stage' did not run"):  # a container the graph skips
        explain.GradCAM(graph_module, "stage").explain(X, target=1)
    assert_state_equal(before, model_state(graph_module))


def test_wrappers_explain_the_plain_models_maps():
    plain = residual_net()
    expected = gradcam_by_hand(plain, plain.stage, X, class_scores([1, 2]))
    for wrapped, layer in [(torch.compile(copy.deepcopy(plain)), "_orig_mod.stage"),
                           (nn.DataParallel(copy.deepcopy(plain)), "module.stage")]:
        for given in (layer, None):
            explanation = explain.GradCAM(wrapped, given, normalize=None).explain(X, target=[1, 2])
            torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_a_module_run_twice_is_refused_and_the_model_left_as_found():
    """One block applied twice: a hook fires twice, so its Grad-CAM has no single output to explain."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 6, 3, padding=1)
            self.block = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.ReLU())
            self.fc = nn.Linear(6, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.block(self.block(self.stem(x))).mean(dim=(2, 3)))

    torch.manual_seed(0)
    model = awkward_state(Twice())
    before = model_state(model)
    with pytest.raises(explain.LayerNotRunError, match="'block' ran more than once"):
        explain.GradCAM(model, "block").explain(X, target=1)
    assert_state_equal(before, model_state(model))
    explanation = explain.GradCAM(model, normalize=None).explain(X, target=[1, 2])  # the layer that runs once
    assert explanation.layer == "stem"
    model.eval()
    expected = gradcam_by_hand(model, model.stem, X, class_scores([1, 2]))
    torch.testing.assert_close(explanation.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_train_mode_dropout_does_not_reach_multi_pass_methods():
    """Integrated Gradients runs many passes: on a training model with dropout each would draw another mask; the
    call runs it in eval mode, so the map equals the eval model's, and the training flags come back."""

    class Dropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 3, padding=1)
            self.drop = nn.Dropout(0.5)
            self.fc = nn.Linear(6, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.drop(self.conv(x).relu().mean(dim=(2, 3))))

    torch.manual_seed(0)
    model = Dropped()
    expected = explain.IntegratedGradients(copy.deepcopy(model).eval(), normalize=None, steps=8).explain(X, target=1)
    model.train()
    before = model_state(model)
    got = explain.IntegratedGradients(model, normalize=None, steps=8).explain(X, target=1)
    torch.testing.assert_close(got.raw_maps, expected.raw_maps, rtol=0, atol=0)
    assert_state_equal(before, model_state(model))


def test_the_first_parameter_is_read_with_its_generator_closed():
    """``model_device``/``model_dtype`` read the first parameter and close the generator there and then: a generator
    left suspended is closed when collected, where a Ctrl-C landing in it is lost ("Exception ignored")."""
    from explain.core.capture import first_tensor, model_device, model_dtype

    model = nn.Sequential(nn.Embedding(3, 2), nn.Linear(2, 2).double())
    parameters = model.parameters()
    assert first_tensor(parameters) is model[0].weight
    assert parameters.gi_frame is None  # closed, not suspended
    floating = model.parameters()
    model[0].weight.data = model[0].weight.data.half()
    assert first_tensor(floating, lambda tensor: tensor.dtype == torch.float64) is model[1].weight
    assert floating.gi_frame is None
    assert model_dtype(model) == torch.float16 and model_device(model) == torch.device("cpu")
    assert first_tensor(nn.ReLU().parameters()) is None and model_device(nn.ReLU()) == torch.device("cpu")
