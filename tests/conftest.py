"""Tiny models whose Grad-CAM can be worked out by hand, and helpers to check model state."""

from __future__ import annotations

import os
import signal
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

# Two cores: the suite runs in two pytest-xdist worker processes (pyproject's addopts) with one torch thread each;
# run alone (``-n 0``, or without xdist), with two threads.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: tiny models on a shared CPU run faster than with threads competing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def python_sigint_handler():
    """Python's own SIGINT handler for the test, which a process started in the background lacks (its shell
    sets SIGINT to ignored): without it an interrupt can neither be simulated at a signal point (the ignored
    handler is not callable) nor sent by ``_thread.interrupt_main`` (an ignored signal does nothing)."""
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def errors_in_threads(work: Callable[[int], None], count: int) -> list[Exception]:
    """Run work(0), …, work(count − 1) at once, each in its own thread; the exceptions they raised."""
    errors: list[Exception] = []

    def run(index: int) -> None:
        try:
            work(index)
        except Exception as error:  # reported by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


class ServingThread(ABC):
    """``with Server(...) as server:`` — a thread that serves plain inference (``serve_once``) with a fixed grad
    mode until the block ends, as a web service would from the model being explained. ``problems``: every
    error, wrong result (``serve_once`` appends those) or change of its grad mode; ``rounds``: calls served."""

    def __init__(self, grad_enabled: bool):
        self.grad_enabled = grad_enabled
        self.stop, self.problems, self.rounds = threading.Event(), [], 0
        self.thread = threading.Thread(target=self._serve)

    @abstractmethod
    def serve_once(self) -> None:
        """One call of plain inference; appends to ``problems`` what differs from the expected result."""

    def _serve(self) -> None:
        torch.set_grad_enabled(self.grad_enabled)
        while not self.stop.is_set():
            try:
                self.serve_once()
            except Exception as error:  # reported by the test
                self.problems.append(repr(error))
                continue
            self.rounds += 1
            if torch.is_grad_enabled() != self.grad_enabled:
                self.problems.append("grad mode changed")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc_info):
        self.stop.set()
        self.thread.join()


class ConvGapLinear(nn.Module):
    """conv → (optional in-place ReLU) → global average pool → linear.

    Grad-CAM at ``conv``: ∂y_c/∂A_k(i, j) = W[c, k] / (h w) (times 1[A > 0] with the ReLU),
    so the map is ReLU(Σ_k W[c, k] A_k) / (h w): the classic CAM.
    """

    def __init__(self, in_channels: int = 3, channels: int = 4, classes: int = 3, relu: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, padding=1)
        self.relu = nn.ReLU(inplace=True) if relu else nn.Identity()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        return self.fc(self.pool(self.relu(self.conv(x))).flatten(1))


class SmallCNN(nn.Module):
    """A small CNN with BatchNorm, dropout and in-place ReLUs, for state and memory checks."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        )
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.dropout(self.features(x).mean(dim=(2, 3))))


class SmallViT(nn.Module):
    """A small vision transformer for state and memory checks of the attention methods: 4 × 4
    patches of a 16 × 16 input, a class token, two nn.TransformerEncoder layers with dropout
    (so that train mode matters), a head on the class token."""

    def __init__(self, classes: int = 5, dim: int = 16):
        super().__init__()
        self.patches = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        layer = nn.TransformerEncoderLayer(dim, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), tokens], dim=1)
        return self.head(self.norm(self.encoder(tokens))[:, 0])


def gradcam_by_hand(model, layer_module, x, score_of, to_grid=lambda tensor: tensor) -> torch.Tensor:
    """Grad-CAM by an independent route: capture the layer's output in the graph with a plain
    hook, take ∂score/∂output with autograd, lay both out as (N, C, h, w) with ``to_grid``
    (written in the test), apply the formula and upsample bilinearly to the input."""
    stash = []
    handle = layer_module.register_forward_hook(lambda module, args, output: stash.append(output))
    try:
        output = model(x)
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(score_of(output).sum(), stash[0])
    a, g = to_grid(stash[0].detach()), to_grid(gradient)
    cam = torch.relu((g.mean(dim=(2, 3), keepdim=True) * a).sum(1, keepdim=True))
    return torch.nn.functional.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]


def class_scores(classes):
    """score_of for gradcam_by_hand: the logit of classes[n] for image n."""
    return lambda output: output[torch.arange(len(classes)), torch.tensor(classes)]


def guarded_first_derivative(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x → ∂ model(x)[0, 2] / ∂x, differentiable again (create_graph), computed inside a call scope whose norms get
    the BatchNorm gradient guard (``explain.methods._eval_batch_norm``), as Shapley-CAM's first backward is."""
    from explain.core.scope import CallScope
    from explain.methods._eval_batch_norm import contiguous_batch_norm_gradients

    def first_derivative(inputs: torch.Tensor) -> torch.Tensor:
        with CallScope(model) as scope:
            contiguous_batch_norm_gradients(scope, model.modules())
            (gradient,) = torch.autograd.grad(model(inputs)[0, 2], inputs, create_graph=True)
        return gradient

    return first_derivative


def hook_count(model: nn.Module) -> int:
    """Forward, forward-pre and backward hooks registered on any module of the model."""
    total = 0
    for module in model.modules():
        total += len(module._forward_hooks) + len(module._forward_pre_hooks)
        total += len(module._backward_hooks) + len(module._backward_pre_hooks)
    return total


def model_state(model: nn.Module) -> dict:
    """Everything an explainer must leave unchanged: tensors, flags, modes, module identities."""
    return {
        "tensors": {name: value.detach().clone() for name, value in model.state_dict(keep_vars=True).items()},
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "grads": {name: p.grad for name, p in model.named_parameters()},
        "training": {name: m.training for name, m in model.named_modules()},
        "modules": {name: id(m) for name, m in model.named_modules()},
        "hooks": hook_count(model),
        "grad_enabled": torch.is_grad_enabled(),
    }


def assert_state_equal(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name, tensor in before["tensors"].items():
        assert torch.equal(tensor, after["tensors"][name]), f"{name} changed"
    for key in ("requires_grad", "training", "modules", "hooks", "grad_enabled"):
        assert before[key] == after[key], f"{key} changed"
    assert all(after["grads"][name] is before["grads"][name] for name in before["grads"]), "a .grad changed"


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ---- a browser for the pages explain writes (the report, the VLM page, the concept atlas) -------------------------

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def chromium():
    """Headless Chromium (a fresh profile), or a skip saying what is missing."""
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed "
                                         "(pip install playwright; the browser is Debian's chromium)")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium) for the browser checks")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield browser
        browser.close()


def offline_page(chromium: Any, console_errors: bool = True, **options: Any) -> tuple[Any, Any, list[str], list[str]]:
    """(context, page, blocked, errors): a new browser context (``options``, offline) whose every request that is
    not file:// is aborted and listed in ``blocked``, and a page whose errors (and, with ``console_errors``, the
    console's error messages) are listed in ``errors``. The caller closes the context."""
    context = chromium.new_context(**{"offline": True, **options})
    blocked: list[str] = []
    errors: list[str] = []

    def guard(route: Any) -> None:
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context.route("**/*", guard)
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    if console_errors:
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    return context, page, blocked, errors


def assert_complete_basis_conserves(model: nn.Module, layer: str, method: str, options: dict, x: torch.Tensor,
                                    basis: torch.Tensor) -> None:
    """CRP over a complete basis of directions at ``layer``: the conditional maps add up to the method's
    unconditional map, and the directions' relevances R_k to the channels' R_c (conservation over concepts)."""
    import explain

    e = explain.ConceptRelevance(model, layer, method, directions=basis, batch_size=64, **options).explain(
        x, concepts=None)
    unconditional = explain.get_method(method)(model, **options).explain(
        x, target=e.diagnostics["explained_class"].tolist())
    scale = float(unconditional.attributions.abs().max())
    torch.testing.assert_close(e.attributions.sum(dim=1) / scale, unconditional.attributions[:, 0] / scale,
                               atol=1e-5, rtol=1e-4)
    channels = explain.ConceptRelevance(model, layer, method, **options).explain(x, concepts=1)
    torch.testing.assert_close(e.diagnostics["layer_relevance"].sum(dim=1),
                               channels.diagnostics["layer_relevance"].sum(dim=1), atol=1e-6, rtol=1e-5)


@pytest.fixture
def channels_last_for_small_images(monkeypatch):
    """Batches of small test images reach the model channels-last as large ones do (explain.core.memory_format gives
    only images of at least CHANNELS_LAST_MIN_PIXELS that layout), so that tests of that path can use tiny models."""
    from explain.core import memory_format

    monkeypatch.setattr(memory_format, "CHANNELS_LAST_MIN_PIXELS", 0)


class ResidualNet(nn.Module):
    """stem → (branch + skip) → head: ``branch.0`` is inside the residual branch, ``merge`` after the sum."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU())
        self.branch = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1))
        self.merge = nn.ReLU()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))

    def forward(self, x):
        features = self.stem(x)
        return self.head(self.merge(features + self.branch(features)))
