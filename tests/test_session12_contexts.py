"""Session 12: every registered method (but the detectors') called from the contexts users call it in: inside
``torch.no_grad()``, ``torch.inference_mode()``, ``torch.set_grad_enabled(False)``, on a model whose parameters
all have ``requires_grad=False`` and on an input made under inference mode gives exactly the map of a plain call;
under bfloat16 ``torch.autocast`` it gives the float32 map within ``AUTOCAST_TOLERANCE`` of its maximum or warns
that autocast (bfloat16) moved it. Every call leaves the model as found (flags, modes, hooks) and the caller's grad
mode, inference mode and autocast state as they were. Models and options: tests/test_session12_batch_independence.py,
in float32 (autocast casts float32, not float64)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
from test_session12_batch_independence import CASES, MODELS, explainer
from torch import nn

from explain.methods.registry import REGISTRY

AUTOCAST_TOLERANCE = 0.05
"""bfloat16 keeps 8 significant bits (unit roundoff 2^-9): through a few layers the maps that average gradients or
weigh non-cancelling channels move by ≤ 0.036 of their maximum on these models; a map that moves more warns."""


def model_state(model: nn.Module) -> list[Any]:
    return [(name, module.training, {key: parameter.requires_grad for key, parameter in module._parameters.items()
                                     if parameter is not None},
             dict(module._forward_hooks), dict(module._forward_pre_hooks), dict(module._backward_hooks),
             dict(module._backward_pre_hooks), dict(module._forward_hooks_with_kwargs),
             dict(module._forward_pre_hooks_with_kwargs)) for name, module in model.named_modules()]


def caller_state() -> tuple[Any, ...]:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"))


@contextlib.contextmanager
def grad_disabled() -> Iterator[None]:
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        yield
    finally:
        torch.set_grad_enabled(previous)


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    flags = [parameter.requires_grad for parameter in model.parameters()]
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter, flag in zip(model.parameters(), flags):
            parameter.requires_grad_(flag)


def inference_copy(images: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return images.clone()


EXACT: dict[str, Callable[[nn.Module], contextlib.AbstractContextManager[Any]]] = {
    "no_grad": lambda model: torch.no_grad(), "inference_mode": lambda model: torch.inference_mode(),
    "set_grad_enabled(False)": lambda model: grad_disabled(), "requires_grad=False": frozen,
    "inference input": lambda model: contextlib.nullcontext()}


def called(method: Any, model: nn.Module, images: torch.Tensor, context: contextlib.AbstractContextManager[Any],
           target: Any = (0, 3)) -> tuple[torch.Tensor, list[str]]:
    """The call's raw maps and warnings inside ``context``; the model and the caller's state checked around it."""
    with context:
        model_before, caller_before = model_state(model), caller_state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            maps = method.explain(images, target=list(target)).raw_maps
        assert caller_state() == caller_before, "the caller's grad / inference / autocast state changed"
        assert model_state(model) == model_before, "the model was not left as found"
    return maps, [str(warning.message) for warning in caught]


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_a_method_gives_the_plain_map_in_every_callers_context(name: str, kind: str) -> None:
    make, layer, size = MODELS[kind]
    model = make().float()
    images = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(1))  # one image: a fast sweep
    method = explainer(name, model, layer, size)
    if name == "deepliftshap":
        method.baselines = method.baselines.float()
    outside = caller_state()
    plain, _ = called(method, model, images, contextlib.nullcontext(), (0,))
    scale = float(plain.abs().max())
    assert scale > 0, "the premise: a map that is not zero everywhere"
    for context, enter in EXACT.items():
        maps, _ = called(method, model, inference_copy(images) if context == "inference input" else images,
                         enter(model), (0,))
        assert torch.equal(maps, plain), f"{context}: {float((maps - plain).abs().max()) / scale:.2e} of the maximum"
        assert not maps.is_inference(), context
    maps, messages = called(method, model, images, torch.autocast("cpu", dtype=torch.bfloat16), (0,))
    difference = float((maps.float() - plain).abs().max()) / scale
    said = [message for message in messages if "autocast" in message and "bfloat16" in message]
    assert difference <= AUTOCAST_TOLERANCE or said, f"autocast moved the map by {difference:.3f} of its maximum unsaid"
    assert caller_state() == outside


def test_score_cam_warns_where_its_map_cancels_below_bfloat16_rounding_and_not_in_float32() -> None:
    """Before: on the tiny ViT's first block Score-CAM's map Σ_k w_k A_k (softmax weights nearly equal, a residual
    stream summing to ~1e-4 of its terms) moved by 1.2 of its maximum under bfloat16 autocast (IS-CAM's became zero
    everywhere), silently. By hand: the bound 4 u Σ_k |w_k| |A_k| at u = 2^-9 exceeds 0.02 of the map there, and is
    below it on the CNN's ReLU layer, where the map moves by 0.006 and nothing is said."""
    for kind, expected in (("vit", True), ("cnn", False)):
        make, layer, size = MODELS[kind]
        model = make().float()
        images = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(1))
        method = explainer("scorecam", model, layer, size)
        _, float32_messages = called(method, model, images, contextlib.nullcontext())
        assert not [message for message in float32_messages if "cancels" in message]
        _, messages = called(method, model, images, torch.autocast("cpu", dtype=torch.bfloat16))
        assert bool([message for message in messages if "cancels" in message and "bfloat16" in message]) == expected


def test_the_element_wise_cams_warn_under_autocast_and_grad_cam_does_not() -> None:
    """Before: HiResCAM, element-wise Grad-CAM, Layer-CAM, Eigen-Grad-CAM and Seg-Eigen-CAM, whose maps are made of
    per-position gradients, moved by 0.19-0.24 of their maximum on the CNN under bfloat16 autocast, silently;
    Grad-CAM averages its gradients (moves by 0.006) and stays silent."""
    make, layer, size = MODELS["cnn"]
    model = make().float()
    images = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    for name in ("hirescam", "gradcamelementwise", "layercam", "eigengradcam", "segeigencam", "gradcam"):
        _, messages = called(explainer(name, model, layer, size), model, images,
                             torch.autocast("cpu", dtype=torch.bfloat16))
        assert bool([message for message in messages if "bfloat16" in message]) == (name != "gradcam"), name


assert "drise" not in {name for name, _ in (case.values for case in CASES)} and len(REGISTRY) > 40
