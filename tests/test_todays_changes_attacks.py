"""Attacks on the changes of 63617ef..HEAD (signed rendering, image checks, figure's image check, gradient
checkpointing off per call, the automatic layer's whole-path rule, DeepLIFT's summation warning). Each test
asserts the behaviour the change promises; where it fails, the change has a bug."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_io_attacks import ThreeColumns
from torch import nn

import explain
from explain.data import make_dataset
from explain.io import render

torch.set_num_threads(1)


# ---------------------------------------------------------------- 1. signed maps drawn alike everywhere


def test_batch_overlays_draw_signed_maps_as_the_explanation_does(tmp_path: Path):
    """`explain batch --overlays` must draw a signed map (IG with reduce=sum) with the diverging colour map, as
    `Explanation.overlay` / the single-image CLI do, not clip its negative half to "no evidence" with jet."""
    from explain.cli import main

    image = make_dataset(1, seed=0).images[0]
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(image).save(folder / "a.png")
    out = tmp_path / "out"
    assert main(["batch", str(folder), "--model", "demo", "--method", "integratedgradients", "--option",
                 "reduce=sum", "--out", str(out), "--overlays"]) == 0
    (written,) = sorted((out / "overlays").iterdir())
    picture = np.array(Image.open(written))
    loaded = explain.load_model("demo")
    e = explain.IntegratedGradients(loaded.model, reduce="sum", preprocess=loaded.preprocess).explain(image)
    assert bool((e.maps < 0).any()), "the test needs a signed map"
    expected = e.overlay()[0]  # (64, 64, 3)
    scale = picture.shape[1] // expected.shape[1]
    panel = picture[-expected.shape[0] * scale:, :expected.shape[1] * scale][::scale, ::scale]
    assert np.abs(panel.astype(int) - expected.astype(int)).mean() < 2.0


def test_report_thumbnails_draw_negative_evidence_unlike_none(tmp_path: Path):
    """The HTML report's thumbnails of a signed map must not draw −1 (strong negative evidence) in the colour of
    0 (no evidence): they clip the map to [0, 1] with jet."""
    from explain.dataset_tools.html_report import _panels_from_maps

    maps = np.zeros((1, 8, 8), np.float16)
    maps[0, :, :4] = -1.0
    path = tmp_path / "m.npy"
    np.save(path, maps)
    (panel,) = _panels_from_maps(np.load(path), None, 1, 8)
    pixels = np.array(panel).astype(int)
    assert np.abs(pixels[:, 0] - pixels[:, -1]).sum() > 0


def test_nan_in_a_signed_map_is_drawn_neutral_not_as_strongest_negative():
    """NaN is drawn as 0 in unsigned maps (no evidence); in a signed map it becomes the colour of −1."""
    maps = torch.tensor([[[float("nan"), -0.5, 0.0, 0.5]]])
    drawn, cmap = render.as_drawn(maps, "jet")
    colours = render.colorize(drawn, cmap)[0, 0]
    assert torch.allclose(colours[0], colours[2]), (colours[0], colours[2])


class RedSum(ThreeColumns):
    """Score 0 = the mean red of the whole image (ThreeColumns' red-reading 1 × 1 convolution)."""

    def forward(self, x):
        score = self.conv(x).mean((1, 2, 3))
        return torch.stack([score, -score], 1)


def test_an_images_overlay_does_not_depend_on_the_other_images_of_the_batch():
    """Image 0's map is ≥ 0, image 1's is signed: e.overlay()[0] is drawn with RdBu_r, e[0].overlay() with jet."""
    x = torch.rand(2, 3, 8, 8) * 0.5
    x[1, 0, :, :4] -= 1.0
    e = explain.InputXGradient(RedSum(), reduce="sum", preprocess=explain.Normalize((0, 0, 0), (1, 1, 1))).explain(
        x, target=0)
    assert not bool((e.maps[0] < 0).any()) and bool((e.maps[1] < 0).any())
    assert np.array_equal(e.overlay()[0], e[0].overlay()[0])


# ---------------------------------------------------------------- 3. figure's check of the display images


def test_figure_of_other_sized_images_names_both_sizes():
    image = make_dataset(1, seed=0).images[0]  # 64 x 64
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2)).eval()
    a = explain.GradCAM(model, "1").explain(image)
    b = explain.GradCAM(model, "1").explain(np.ascontiguousarray(image[::2, ::2]))  # the same picture, 32 x 32
    with pytest.raises(ValueError) as error:
        explain.figure([a, b])
    assert "(64, 64)" in str(error.value) and "(32, 32)" in str(error.value)


# ---------------------------------------------------------------- 4. gradient checkpointing off for a call


class ReadOnlyFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)

    @property
    def gradient_checkpointing(self):  # derived, read-only (no setter)
        return True

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


def test_a_read_only_gradient_checkpointing_property_does_not_break_every_call():
    e = explain.GradCAM(ReadOnlyFlag(), "conv").explain(torch.randn(1, 3, 8, 8))
    assert e.maps.shape == (1, 8, 8)


class Flagged(nn.Module):
    def __init__(self, events):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, 2)
        self.grad_checkpointing = True
        self.events = events
        self.seen: dict[str, list[bool]] = {}

    def forward(self, x):
        a_in, b_in, a_done = self.events
        me = threading.current_thread().name
        if me == "A":
            a_in.set()
            b_in.wait(3)
        elif me == "B":
            b_in.set()
            a_done.wait(3)
        self.seen.setdefault(me, []).append(self.grad_checkpointing)
        return self.fc(self.conv(x).mean((2, 3)))


def test_checkpointing_stays_off_for_a_call_while_another_call_on_the_model_ends():
    """Call A turns the flag off; call B begins (the flag is already off: B records nothing); A ends and turns it
    back on while B still runs: B's forward then runs checkpointed."""
    events = (threading.Event(), threading.Event(), threading.Event())
    model = Flagged(events)
    errors = []

    def a():
        try:
            explain.Saliency(model).explain(torch.randn(1, 3, 8, 8))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)
        events[2].set()

    def b():
        events[0].wait(3)
        try:
            explain.Saliency(model).explain(torch.randn(1, 3, 8, 8))
        except Exception as error:  # pragma: no cover
            errors.append(error)

    threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not errors
    assert model.seen["A"] == [False] and model.seen["B"] == [False], model.seen
    assert model.grad_checkpointing is True


def test_checkpointing_flag_restored_after_a_call_that_raises():
    model = Flagged((threading.Event(), threading.Event(), threading.Event()))
    with pytest.raises(ValueError, match="out of range"):
        explain.Saliency(model).explain(torch.randn(1, 3, 8, 8), target=7)
    assert model.grad_checkpointing is True


# ---------------------------------------------------------------- 7. the automatic layer at small inputs


def test_default_layer_of_a_huggingface_resnet_at_a_small_input():
    """HF's ResNetModel (a non-container wrapping the whole network) outputs the last 1 x 1 map first, so every
    layer inside it is dropped: no layer at all. The last whole stage with a 2 x 2 map is stages.2."""
    transformers = pytest.importorskip("transformers")
    from explain.core.layers import default_layer

    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                                       num_labels=3)
    model = transformers.ResNetForImageClassification(config).eval()
    assert default_layer(model, torch.randn(1, 3, 32, 32)) == "resnet.encoder.stages.2"


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.pool(torch.relu(self.c2(torch.relu(self.c1(x)))))


class PooledBackbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Body()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.body(x).flatten(1))


def test_default_layer_inside_a_backbone_that_returns_pooled_maps():
    """A backbone module returning (N, C, 1, 1) pooled features: before today body.c2 (the one path), now none."""
    from explain.core.layers import default_layer

    assert default_layer(PooledBackbone().eval(), torch.randn(1, 3, 16, 16)) == "body.c2"


# ---------------------------------------------------------------- 9. DeepLIFT's summation warning


def test_deeplift_does_not_warn_about_float32_rounding_of_large_scores():
    """Scores ~1000, a baseline close to the image (y(x) − y(x') ~ 0.02): the attributions sum to the score change
    within float32 rounding of the scores themselves (float64 gives an error of 1e-13), yet the warning says the
    multipliers grew: the tolerance scales with |y(x) − y(x')|, not with |y|."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32,
                              depth=4).eval()
    with torch.no_grad():
        model.get_classifier().weight.mul_(3000.0)
    x = torch.randn(2, 3, 32, 32)
    baseline = x.clone()
    baseline[:, :, :4, :4] += 1e-3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = explain.DeepLift(model, baseline=baseline).explain(x)
    error = e.diagnostics["summation_error"].abs()
    assert bool((error < 1e3 * torch.finfo(torch.float32).eps * e.scores.abs()).all()), "rounding, not growth"
    assert not [w for w in caught if "do not sum" in str(w.message)]


@pytest.mark.usefixtures("python_sigint_handler")
def test_ctrl_c_anywhere_in_shapleycam_leaves_checkpointing_on_and_no_rule_or_hook_behind():
    """A Ctrl-C at 40 random signal points of ShapleyCAM on a timm ViT with gradient checkpointing (its call switches
    checkpointing off and computes attention through a call-scoped rule): the flag is back on, no hook, function mode
    or switched-off record is left, and the weights are as they were."""
    import random

    import timm
    from test_interrupts import SignalPointInterrupter, thread_state

    from explain.core.scope import _checkpointing_off

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32, patch_size=8,
                              depth=1, embed_dim=16, num_heads=1).eval()
    model.set_grad_checkpointing(True)
    x = torch.randn(1, 3, 32, 32)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    state = thread_state()

    def call():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            explain.ShapleyCAM(model).explain(x, target=lambda output: output[:, 1] + output.log_softmax(1)[:, 1])

    interrupter = SignalPointInterrupter()
    total = interrupter.run(call)
    for point in sorted(random.Random(0).sample(range(1, total + 1), 40)):
        with pytest.raises(KeyboardInterrupt):
            interrupter.run(call, point)
        assert model.grad_checkpointing is True and not _checkpointing_off, point
        assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules()), point
        assert thread_state() == state and not model.training, point
    assert all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())
