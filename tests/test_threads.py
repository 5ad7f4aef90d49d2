"""Threads: a model that serves predictions in one thread while another thread explains it (a
web service answering both from one model) must not notice: hooks, modes and grad mode of an
explainer act only on the explaining thread's forward passes."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import ServingThread, SmallCNN, SmallViT, errors_in_threads
from test_reliability import ATTENTION_METHODS, CNN_METHODS, build

import explain


class Server(ServingThread):
    """A thread that runs plain inference on the model until stopped and records every mismatch
    with the model's true output, and any change of its own grad mode."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, grad_enabled: bool):
        super().__init__(grad_enabled)
        self.model, self.x = model, x
        with torch.set_grad_enabled(grad_enabled):  # (nn.TransformerEncoder takes a fused path without grad)
            self.expected = model(x).detach()

    def serve_once(self):
        output = self.model(self.x)
        if not torch.equal(output.detach(), self.expected):
            self.problems.append(f"output differs by {(output.detach() - self.expected).abs().max():.3g}")


@pytest.mark.parametrize("grad_enabled", [False, True])
@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_another_threads_inference_sees_the_plain_model_while_every_method_explains(grad_enabled, kind):
    torch.manual_seed(0)
    model = (SmallCNN() if kind == "cnn" else SmallViT()).eval()
    methods = CNN_METHODS if kind == "cnn" else [*ATTENTION_METHODS, "gradcam", "saliency", "guidedbackprop"]
    layer = "features.6" if kind == "cnn" else None
    served, explained = torch.randn(3, 3, 16, 16), torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = {name: build(name, model, layer).explain(explained, target=[1, 3]).raw_maps for name in methods}
        with Server(model, served, grad_enabled) as server:
            for _ in range(3):
                for name in methods:
                    maps = build(name, model, layer).explain(explained, target=[1, 3]).raw_maps
                    torch.testing.assert_close(maps, expected[name], msg=name)
    assert server.rounds > 20, "the serving thread hardly ran"
    assert not server.problems, server.problems[:5]


def test_capture_and_edit_blocks_act_on_their_own_thread_only():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(3, 3, 16, 16)
    with Server(model, torch.randn(2, 3, 16, 16), True) as server:
        for _ in range(20):
            with explain.capture(model, "features.*", grads=True) as captured:
                model(x).sum().backward()
            assert all(len(record.calls) == 1 for record in captured.values())
            with explain.edit(model, "features.6", lambda t: t * 0):
                zeroed = model(x)
            torch.testing.assert_close(zeroed, model.head(torch.zeros(3, 16)).expand_as(zeroed))
    model.zero_grad(set_to_none=True)
    assert server.rounds > 20
    assert not server.problems, server.problems[:5]


def test_one_explainer_shared_by_threads_gives_each_its_own_maps():
    """A service may build one explainer at start-up and call it from every request thread."""
    torch.manual_seed(0)
    model = SmallCNN().eval()
    inputs = [torch.randn(2, 3, 16, 16) for _ in range(3)]
    other = torch.randn(2, 16)
    shared = {
        "gradcam": explain.GradCAM(model, "features.6"),
        "ablationcam": explain.AblationCAM(model, "features.6", progress=False),
        "guidedbackprop": explain.GuidedBackprop(model),
        "integratedgradients": explain.IntegratedGradients(model, steps=4),
    }

    class TwoInputs(torch.nn.Module):  # per-call forward arguments must not leak across threads
        def __init__(self):
            super().__init__()
            self.cnn = model

        def forward(self, x, bias):
            return self.cnn(x) + bias[:, :5]

    two_inputs = explain.GradCAM(TwoInputs().eval(), "cnn.features.6")
    expected = {(name, i): explainer.explain(x).raw_maps for name, explainer in shared.items()
                for i, x in enumerate(inputs)}
    expected_two = two_inputs.explain(inputs[0], forward_args=(other,)).raw_maps

    def work(i):
        for _ in range(5):
            for name, explainer in shared.items():
                torch.testing.assert_close(explainer.explain(inputs[i]).raw_maps, expected[(name, i)])
            torch.testing.assert_close(two_inputs.explain(inputs[0], forward_args=(other,)).raw_maps, expected_two)

    errors = errors_in_threads(work, 3)
    assert not errors, errors[:3]
