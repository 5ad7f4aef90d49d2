"""Nothing of a call is retained: per-call state is cleared also when the call raises, no tensor of the call's graph
stays on the explainer, the model or the Explanation, and repeated calls keep the count of live tensors constant."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import pytest
import torch
from conftest import SmallCNN
from torch import nn

import explain


def per_call_state(explainer: explain.Explainer) -> dict[str, Any]:
    """What this thread's per-call state of the explainer (and of those it wraps) holds, None/False/0 left out."""
    return {name: value for state in explainer._thread_states() for name, value in state.__dict__.items()
            if value not in (None, False, 0)}


def graph_tensors(value: Any, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Tensors that require grad or carry a graph, reachable from ``value`` through attributes and containers
    (modules are skipped: the model's parameters require grad by design)."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (nn.Module, str, bytes, int, float, type)):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad or value.grad_fn is not None else []
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set)):
        items = list(value)
    elif isinstance(value, threading.local):
        items = list(value.__dict__.values())
    else:
        items = list(getattr(value, "__dict__", {}).values())
    return [tensor for item in items for tensor in graph_tensors(item, seen)]


def cnn_explainers(model: nn.Module) -> list[explain.Explainer]:
    return [explain.GradCAM(model, "features.6"), explain.GradCAMPlusPlus(model, "features.6"),
            explain.ScoreCAM(model, "features.6", progress=False), explain.GuidedBackprop(model),
            explain.GuidedGradCAM(model, "features.6"), explain.Saliency(model), explain.DeepLift(model)]


def test_a_call_with_a_bad_target_leaves_no_per_call_state():
    """Old code: CAMs kept their layer layouts, guided backprop its count of ReLU calls."""
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    for explainer in cnn_explainers(model):
        with pytest.raises(ValueError, match="class index 9"):
            explainer.explain(x, target=9)
        assert per_call_state(explainer) == {}, type(explainer).__name__
        assert graph_tensors(explainer) == []


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_call_interrupted_in_a_later_forward_pass_leaves_no_state_hooks_or_graph(error):
    """A forward hook of the user's raising in the second forward pass (ScoreCAM's masked pass)."""
    torch.manual_seed(0)
    model = SmallCNN().eval()
    grads_before = [parameter.grad for parameter in model.parameters()]
    runs = []

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        runs.append(weakref.ref(output))
        if len(runs) == 2:
            raise error("the user's hook failed")

    handle = model.head.register_forward_hook(hook)
    explainer = explain.ScoreCAM(model, "features.6", progress=False)
    try:
        with pytest.raises((RuntimeError, KeyboardInterrupt)) as raised:
            explainer.explain(torch.randn(2, 3, 16, 16), target=1)
    finally:
        handle.remove()
    del raised  # its traceback's frames (the caller's to keep) hold the call's tensors
    gc.collect()
    assert per_call_state(explainer) == {}
    assert graph_tensors(explainer) == []
    assert all(not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
               for module in model.modules())
    assert not torch.nn.modules.module._global_forward_hooks
    assert [parameter.grad for parameter in model.parameters()] == grads_before == [None] * len(grads_before)
    assert all(ref() is None for ref in runs), "an output of the call is still alive"


def test_the_explanation_holds_no_graph_and_no_activation_survives_the_call():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    outputs = []
    handle = model.features[3].register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))
    try:
        for explainer in cnn_explainers(model):
            explanation = explainer.explain(torch.randn(2, 3, 16, 16), target=[1, 2])
            assert graph_tensors(explanation) == [], type(explainer).__name__
            assert graph_tensors(explainer) == [] and per_call_state(explainer) == {}
    finally:
        handle.remove()
    gc.collect()
    assert outputs and all(ref() is None for ref in outputs)


def live_tensors() -> int:
    gc.collect()
    return sum(1 for value in gc.get_objects() if isinstance(value, torch.Tensor))


def test_repeated_calls_and_failures_keep_the_number_of_live_tensors():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(1, 3, 16, 16)
    explainers = [explain.GradCAM(model, "features.6"), explain.GuidedBackprop(model)]
    for explainer in explainers:
        explainer.explain(x, target=1)
    before = live_tensors()
    for step in range(20):
        for explainer in explainers:
            explainer.explain(x, target=1)
            if step % 5 == 0:
                with pytest.raises(ValueError):
                    explainer.explain(x, target=9)
    assert live_tensors() == before


def test_one_explainer_in_two_threads_keeps_and_clears_each_threads_state():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    explainer = explain.GradCAM(model, "features.6")
    x = torch.randn(2, 3, 16, 16)
    expected = explainer.explain(x, target=1).raw_maps
    left: dict[str, dict[str, Any]] = {}
    failures: list[BaseException] = []

    def work(name: str, target: int) -> None:
        try:
            for _ in range(5):
                if target < 5:
                    torch.testing.assert_close(explainer.explain(x, target=target).raw_maps, expected)
                else:
                    with pytest.raises(ValueError):
                        explainer.explain(x, target=target)
            left[name] = per_call_state(explainer)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=work, args=("good", 1)), threading.Thread(target=work, args=("bad", 9))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert left == {"good": {}, "bad": {}}
    assert per_call_state(explainer) == {}
