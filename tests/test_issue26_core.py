"""Issue 26, the pipeline's part: which of a model's other inputs are per-image (item 1), reduced
precision (item 10), the blur baseline on any image size (item 13), out-of-memory detection only in
the error's own chain (item 17) and Integrated Gradients' progress bar (item 22)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from test_attention_models import hf_clip
from torch import Tensor, nn

import explain

# ---------------------------------------------------------------- item 1: per-image inputs, stated


def tiny_clip() -> nn.Module:
    return hf_clip("eager").double()


def slow_integrated_gradients(score: "callable", x: Tensor, steps: int) -> Tensor:
    """(x − 0) ⊙ mean over midpoints α of ∂score/∂x(αx), one point at a time: (C, H, W)."""
    total = torch.zeros_like(x)
    for step in range(steps):
        point = ((step + 0.5) / steps * x).requires_grad_(True)
        (gradient,) = torch.autograd.grad(score(point), point)
        total += gradient
    return x * total / steps


def test_clip_prompts_stated_as_shared_score_the_right_prompt_on_every_path_point():
    """2 images and 2 prompts: the prompts' first dimension equals N. Integrated Gradients must give
    each path point both prompts, not the prompt of its image's row."""
    clip = tiny_clip()
    torch.manual_seed(1)
    pixels, prompts = torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.randint(0, 50, (2, 7))
    explainer = explain.IntegratedGradients(clip, steps=4, output="logits_per_image", normalize=None)
    call = dict(forward_kwargs={"input_ids": prompts}, input_position="pixel_values")
    with pytest.raises(ValueError, match=r"forward_kwargs\['input_ids'\] has 2 rows.*per_image=\['input_ids'\].*"
                                         r"per_image=\[\]"):
        explainer.explain(pixels, target=[1, 0], **call)
    shared = explainer.explain(pixels, target=[1, 0], per_image=[], **call)
    for image, prompt in enumerate([1, 0]):
        def score(point: Tensor, prompt: int = prompt) -> Tensor:
            return clip(pixel_values=point[None], input_ids=prompts).logits_per_image[0, prompt]

        expected = slow_integrated_gradients(score, pixels[image], steps=4)
        torch.testing.assert_close(shared.attributions[image, 0], expected, rtol=1e-9, atol=1e-12)


class Conditioned(nn.Module):
    """A CNN whose features are scaled by a per-image condition row and shifted by a shared table."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, image: Tensor, condition: Tensor, table: Tensor) -> Tensor:
        features = torch.tanh(self.conv(image) * condition[:, :, None, None]).mean(dim=(2, 3))
        return self.head(features) + table.sum(0)[:3]


@pytest.mark.parametrize("name", ["integratedgradients", "smoothgrad", "layerconductance", "scorecam"])
def test_a_stated_per_image_input_follows_its_image_and_a_shared_one_stays_whole(name):
    """Condition (2, 4) per image, table (2, 4) shared: each image's map equals that image explained
    alone with the same inputs (one image: nothing to misread)."""
    torch.manual_seed(0)
    model = Conditioned().double().eval()
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    condition, table = torch.rand(2, 4, dtype=torch.float64) + 0.5, torch.randn(2, 4, dtype=torch.float64)
    cls = explain.get_method(name)
    options = {"integratedgradients": {"steps": 4}, "smoothgrad": {"samples": 3, "noise": 0.0},
               "layerconductance": {"steps": 4},
               "scorecam": {"progress": False}}[name]
    explainer = cls(model, "conv", **options) if cls.needs_layer else cls(model, **options)
    call = dict(forward_args=(condition,), forward_kwargs={"table": table}, input_position=0)
    with pytest.raises(ValueError, match=r"forward_args\[0\] and forward_kwargs\['table'\] have 2 rows"):
        explainer.explain(images, target=[0, 2], **call)
    together = explainer.explain(images, target=[0, 2], per_image=[0], **call)
    for image in range(2):
        alone = explainer.explain(images[image : image + 1], target=[0, 2][image], forward_args=(condition[[image]],),
                                  forward_kwargs={"table": table}, input_position=0, per_image=[0])
        torch.testing.assert_close(together.raw_maps[image], alone.raw_maps[0], rtol=1e-9, atol=1e-12)


def test_a_method_without_copies_needs_no_statement_and_per_image_is_checked():
    torch.manual_seed(0)
    model = Conditioned().eval()
    images, condition, table = torch.randn(2, 3, 8, 8), torch.rand(2, 4) + 0.5, torch.randn(2, 4)
    explain.GradCAM(model, "conv").explain(images, forward_args=(condition, table))  # nothing copied: no question
    explainer = explain.IntegratedGradients(model, steps=2)
    with pytest.raises(ValueError, match=r"per_image names \['mask'\], which are not among"):
        explainer.explain(images, forward_args=(condition, table), per_image=["mask"])
    with pytest.raises(ValueError, match=r"forward_args\[1\] holds one row per image, but it is \(3, 4\)"):
        explainer.explain(images, forward_args=(condition, torch.randn(3, 4)), per_image=[0, 1])
    with pytest.raises(TypeError, match=r"per_image=\['condition'\]"):
        explainer.explain(images, forward_kwargs={"condition": condition}, per_image="condition")


# ---------------------------------------------------------------- item 17: only the error's own chain


class Refuses(nn.Module):
    """A CNN for 8×8 inputs that raises a simulated CUDA out-of-memory error for batches of more than
    ``rows`` rows, as its own error type wrapping torch's (``wrap=True``) or as torch's."""

    class Wrapped(RuntimeError):
        pass

    def __init__(self, rows: int, wrap: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 3)
        self.rows, self.wrap, self.batches = rows, wrap, []

    def forward(self, x: Tensor) -> Tensor:
        self.batches.append(x.shape[0])
        if x.shape[0] > self.rows:
            try:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            except torch.cuda.OutOfMemoryError:
                if not self.wrap:
                    raise
                raise Refuses.Wrapped("the model's own error")  # noqa: B904 (implicitly chained to the OOM)
        return self.head(self.conv(x).flatten(1))


def test_a_wrong_input_inside_the_callers_own_out_of_memory_handler_is_reported_as_a_wrong_input():
    model = Refuses(rows=1000)
    explainer = explain.IntegratedGradients(model, steps=4)
    try:
        raise torch.cuda.OutOfMemoryError("the caller's own, earlier out-of-memory error")
    except torch.cuda.OutOfMemoryError:
        # the first pass holds the image, its baseline and the 4 path points (target selection is folded into it)
        with pytest.raises(explain.ModelInputError, match=r"shape \(6, 3, 9, 9\).*pass a preprocess"):
            explainer.explain(torch.randn(1, 3, 9, 9))  # 9×9: the head expects 8×8
    assert explainer.rows_that_fit == {}  # not taken for a pass that ran out of memory
    # no retries in halves: every forward had all 6 rows (the second, if any, is the retry in the batch's usual
    # layout after the channels-last copy failed: explain.core.memory_format)
    assert model.batches in ([6], [6, 6])


def test_an_out_of_memory_error_the_model_wraps_is_still_found_and_retried_in_halves():
    """The model's own error, implicitly chained to torch's OOM, inside the caller's unrelated handler:
    still an out-of-memory failure, retried in passes of half the rows, with the result of passes that fit."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 8, 8)
    explainer = explain.IntegratedGradients(Refuses(rows=4, wrap=True), steps=4, normalize=None)
    try:
        raise ValueError("the caller's own error, handled while explaining")
    except ValueError:
        retried = explainer.explain(x, target=[0, 1])
    assert explainer.rows_that_fit == {"cpu": 4}
    fitting = explain.IntegratedGradients(Refuses(rows=1000), steps=4, batch_size=4, normalize=None)
    torch.testing.assert_close(retried.attributions, fitting.explain(x, target=[0, 1]).attributions)


# ---------------------------------------------------------------- item 10: reduced precision, said


def demo_and_resnet():
    import torchvision

    from explain.data import load_demo_model

    torch.manual_seed(0)
    return [load_demo_model().eval(), torchvision.models.resnet18(num_classes=10).eval()]


def by_hand_saliency(model: nn.Module, x: Tensor, targets: list[int]) -> Tensor:
    """max_c |∂y_t/∂x_c|, each map divided by its maximum, from the gradient as the caller's context computes it."""
    x = x.clone().requires_grad_(True)
    scores = model(x)[torch.arange(len(targets)), targets]
    (gradient,) = torch.autograd.grad(scores.sum(), x)
    maps = gradient.float().abs().amax(dim=1)
    return maps / maps.flatten(1).amax(dim=1).view(-1, 1, 1)


@pytest.mark.parametrize("model_index", [0, 1], ids=["demo", "resnet18"])
def test_saliency_under_bf16_autocast_is_the_bf16_gradient_and_says_why_it_differs_from_float32(model_index):
    model = demo_and_resnet()[model_index]
    x = torch.randn(2, 3, 64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(RuntimeWarning, match=r"Saliency ran in bfloat16 \(torch.autocast\).*8 significant bits"
                                                r".*call explain outside torch.autocast"):
            mixed = explain.Saliency(model).explain(x, target=[1, 2]).maps
        expected = by_hand_saliency(model, x, [1, 2])
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, expected, rtol=0, atol=1e-6)  # nothing lost beyond the model's rounding


def test_integrated_gradients_of_a_float16_model_sums_its_gradients_in_float64_and_warns():
    model = demo_and_resnet()[0].half()
    x = torch.randn(1, 3, 32, 32).half()
    with pytest.warns(RuntimeWarning, match=r"ran in float16 \(the model's dtype\).*11 significant bits.*model.float"):
        result = explain.IntegratedGradients(model, steps=4, normalize=None).explain(x, target=3)
    total = torch.zeros(3, 32, 32, dtype=torch.float64)
    for step in range(4):
        point = ((step + 0.5) / 4 * x).requires_grad_(True)
        (gradient,) = torch.autograd.grad(model(point)[0, 3], point)
        total += gradient[0].double() / 4
    torch.testing.assert_close(result.attributions[0, 0], (x[0].double() * total).half(), rtol=0, atol=0)


def test_cams_in_reduced_precision_do_not_warn_and_float32_never_warns(recwarn):
    model = demo_and_resnet()[1]
    x = torch.randn(1, 3, 64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explain.GradCAM(model, "layer4").explain(x, target=1)
    explain.Saliency(model).explain(x, target=1)
    assert not [w for w in recwarn if "significant bits" in str(w.message)]


# ---------------------------------------------------------------- item 22: Integrated Gradients' progress bar


def test_integrated_gradients_shows_a_progress_bar_on_long_calls_and_none_inside_another(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).eval()
    x = torch.randn(2, 3, 8, 8)
    explain.IntegratedGradients(model, steps=64, batch_size=8).explain(x)  # 16 passes > PROGRESS_THRESHOLD
    shown = capsys.readouterr().err
    assert "IntegratedGradients:" in shown and "/128 " in shown
    explain.IntegratedGradients(model, steps=64, batch_size=8, progress=False).explain(x)
    explain.IntegratedGradients(model, steps=8, batch_size=8).explain(x)  # 2 passes: quick, no bar
    assert capsys.readouterr().err == ""
    inner = explain.IntegratedGradients(model, steps=64, batch_size=8)
    explain.SmoothGrad(inner, samples=9, batch_size=1).explain(x[:1])  # 9 passes of SmoothGrad, 8 of IG in each
    shown = capsys.readouterr().err
    assert "SmoothGrad(IntegratedGradients):" in shown and "/9 " in shown
    assert "IntegratedGradients:" not in shown.replace("SmoothGrad(IntegratedGradients):", "")
    with pytest.raises(ValueError, match=r"progress must be True, False or None"):
        explain.IntegratedGradients(model, progress="yes")


# ---------------------------------------------------------------- item 16: SmoothGrad's options


@pytest.mark.parametrize("options, message", [
    ({"samples": 2.5}, r"samples must be an int of at least 1.*got 2.5"),
    ({"samples": 0}, r"samples must be an int of at least 1.*got 0"),
    ({"noise": float("inf")}, r"noise must be a finite number ≥ 0.*got inf"),
    ({"noise_std": -0.1}, r"noise_std must be a finite number ≥ 0.*got -0.1"),
    ({"seed": 1.5}, r"seed must be an int .* or None"),
])
def test_smoothgrad_options_are_checked_with_a_message_naming_the_option(options, message):
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(2 * 6 * 6, 3))
    with pytest.raises(ValueError, match=message):
        explain.SmoothGrad(model, **options)


def test_smoothgrad_seed_none_draws_new_noise_each_call_from_torchs_generator():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3)).eval()
    x = torch.randn(1, 3, 8, 8)
    explainer = explain.SmoothGrad(model, samples=3, seed=None, normalize=None)
    torch.manual_seed(5)
    first, second = explainer.explain(x, target=0).raw_maps, explainer.explain(x, target=0).raw_maps
    assert not torch.equal(first, second)
    torch.manual_seed(5)
    torch.testing.assert_close(explainer.explain(x, target=0).raw_maps, first, rtol=0, atol=0)
    seeded = explain.SmoothGrad(model, samples=3, seed=7, normalize=None)
    torch.testing.assert_close(seeded.explain(x, target=0).raw_maps, seeded.explain(x, target=0).raw_maps)


# ---------------------------------------------------------------- item 13: the blur baseline on any image size


@pytest.mark.parametrize("height, width", [(64, 16), (64, 4), (1, 1), (4, 64)])
def test_integrated_gradients_blur_baseline_on_thin_and_tiny_images_is_the_mirrored_gaussian(height, width):
    """x' = x blurred by a Gaussian of σ = max(H, W) / 8 truncated at 3σ, mirrored at the edges (scipy's
    mode="mirror", by hand); the attributions add up to y(x) − y(x')."""
    import numpy as np
    from scipy.ndimage import gaussian_filter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    model = model.double().eval()
    x = torch.randn(1, 3, height, width, dtype=torch.float64)
    sigma = max(height, width) / 8
    radius = int(np.ceil(3 * sigma))
    expected = np.stack([gaussian_filter(channel, sigma, mode="mirror", truncate=radius / sigma if sigma else 0)
                         for channel in x[0].numpy()])
    torch.testing.assert_close(explain.IntegratedGradients(model, baseline="blur").baseline_for(x)[0],
                               torch.from_numpy(expected), rtol=1e-10, atol=1e-12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = explain.IntegratedGradients(model, baseline="blur", steps=64, normalize=None).explain(x, target=1)
    said = " ".join(str(warning.message) for warning in caught)
    assert ("the baseline equals the image, so the path from it has length 0" in said) == (height * width == 1)
    with torch.no_grad():
        change = model(x)[0, 1] - model(torch.from_numpy(expected)[None])[0, 1]
    torch.testing.assert_close(result.attributions.sum(), change, rtol=1e-3, atol=1e-9)


def test_a_non_finite_baseline_tensor_is_refused_by_name():
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(2 * 6 * 6, 3)).eval()
    baseline = torch.zeros(3, 8, 8)
    baseline[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"the baseline .* holds NaN or inf .* index \(1, 2, 3\)"):
        explain.IntegratedGradients(model, baseline=baseline).explain(torch.randn(1, 3, 8, 8))


def test_a_dataset_run_shows_its_own_bar_and_none_of_each_calls(tmp_path, capsys):
    from PIL import Image

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).eval()
    for index in range(2):
        Image.fromarray((torch.rand(8, 8, 3) * 255).byte().numpy()).save(tmp_path / f"image{index}.png")
    explainer = explain.IntegratedGradients(model, steps=64, batch_size=8, progress=True)
    explain.run(explainer, tmp_path, tmp_path / "out")
    shown = capsys.readouterr().err
    assert "explain IntegratedGradients" in shown and "row/s" not in shown and "/128" not in shown


# ---------------------------------------------------------------- found by attacking the above


class TwoInputs(nn.Module):
    """forward(first, second): only ``second`` reaches the output through a convolution."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.head = nn.Conv2d(3, 2, 3, padding=1), nn.Linear(2, 3)

    def forward(self, first: Tensor, second: Tensor) -> Tensor:
        return self.head(torch.tanh(self.conv(second)).mean(dim=(2, 3))) + 0.0 * first.sum()


def test_input_position_minus_one_is_the_last_place_and_nonsense_positions_are_refused():
    model, other, x = TwoInputs().eval(), torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8)
    explainer = explain.Saliency(model, normalize=None)
    last = explainer.explain(x, target=0, forward_args=(other,), input_position=-1)
    by_index = explainer.explain(x, target=0, forward_args=(other,), input_position=1)
    torch.testing.assert_close(last.raw_maps, by_index.raw_maps, rtol=0, atol=0)
    assert last.raw_maps.abs().sum() > 0  # the images went to `second`, the input that matters
    for position in (5, -3, True, 1.0):
        with pytest.raises(ValueError, match=r"input_position must be .* 0 to 1 \(or −1 for the last\)"):
            explainer.explain(x, forward_args=(other,), input_position=position)
    with pytest.raises(ValueError, match=r"forward_kwargs holds 'second' too"):
        explainer.explain(x, forward_kwargs={"first": other, "second": other}, input_position="second")
    with pytest.raises(TypeError, match=r"forward_args must be a tuple or list .* got Tensor"):
        explainer.explain(x, forward_args=other, input_position=1)


def test_tensors_nested_in_an_argument_are_checked_and_follow_their_image_when_stated():
    class DictInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Conditioned()

        def forward(self, image: Tensor, extra: dict) -> Tensor:
            return self.inner(image, extra["condition"], extra["table"][0])

    torch.manual_seed(0)
    model = DictInput().double().eval()
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    condition = torch.rand(2, 4, dtype=torch.float64) + 0.5
    table = torch.randn(1, 2, 4, dtype=torch.float64)  # (1, ...): shared
    explainer = explain.IntegratedGradients(model, steps=4, normalize=None)
    with pytest.raises(ValueError, match=r"forward_kwargs\['extra'\] has 2 rows"):
        explainer.explain(images, target=[0, 2], forward_kwargs={"extra": {"condition": condition, "table": table}})
    with pytest.raises(ValueError, match=r"dict of tensors \[\(2, 4\), \(1, 2, 4\)\]"):
        explainer.explain(images, forward_kwargs={"extra": {"condition": condition, "table": table}},
                          per_image=["extra"])
    extra = {"condition": condition, "table": table.expand(2, 2, 4)}
    together = explainer.explain(images, target=[0, 2], forward_kwargs={"extra": extra}, per_image=["extra"])
    for image in range(2):
        alone = {"condition": condition[[image]], "table": table}
        expected = explainer.explain(images[[image]], target=[0, 2][image], forward_kwargs={"extra": alone},
                                     per_image=["extra"])
        torch.testing.assert_close(together.raw_maps[image], expected.raw_maps[0], rtol=1e-9, atol=1e-12)


def test_an_explainer_called_inside_its_own_target_keeps_the_outer_calls_inputs():
    model, other = TwoInputs().eval(), torch.randn(1, 3, 8, 8)
    explainer = explain.Saliency(model, normalize=None)
    inner_maps = []

    def target(output: Tensor) -> Tensor:  # explains another image without extra inputs midway
        if not inner_maps:
            inner_maps.append(explain.Saliency(nn.Sequential(nn.Flatten(), nn.Linear(192, 2))).explain(
                torch.randn(1, 3, 8, 8)))
            inner_maps.append(explainer.explain(torch.randn(1, 3, 8, 8), target=0,
                                                forward_args=(other,), input_position=1))
        return output[:, 0]

    x = torch.randn(1, 3, 8, 8)
    nested = explainer.explain(x, target=target, forward_args=(other,), input_position=1)
    plain = explainer.explain(x, target=0, forward_args=(other,), input_position=1)
    torch.testing.assert_close(nested.raw_maps, plain.raw_maps)
    assert explainer._forward_call is None


def test_the_precision_warning_covers_fullgrad_xrai_and_a_model_partly_in_bf16():
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for explainer in (explain.FullGrad(model), explain.XRAI(model, steps=2)):
            with pytest.warns(RuntimeWarning, match=rf"{explainer.method_name} ran in bfloat16 \(torch.autocast\)"):
                explainer.explain(x, target=1)
    model.layer4.to(torch.bfloat16)  # the first layers in float32, the last in bf16
    partly = nn.Sequential(model.conv1, model.bn1, model.relu, model.layer1, model.layer2, model.layer3,
                           ToBF16(), model.layer4, model.avgpool, nn.Flatten(), ToFloat(), model.fc)
    with pytest.warns(RuntimeWarning, match=r"Saliency ran in bfloat16 \(the model's dtype\)"):
        explain.Saliency(partly).explain(x, target=1)


class ToBF16(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.to(torch.bfloat16)


class ToFloat(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.float()


def test_smoothgrad_takes_a_numpy_seed_as_its_int():
    import numpy as np

    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3)).eval()
    x = torch.randn(1, 3, 8, 8)
    numpy_seeded = explain.SmoothGrad(model, samples=2, seed=np.int64(3)).explain(x, target=0).raw_maps
    torch.testing.assert_close(numpy_seeded, explain.SmoothGrad(model, samples=2, seed=3).explain(x, target=0).raw_maps)


def test_a_thin_maps_box_or_mask_is_never_guessed():
    import explain.metrics as metrics

    maps = torch.tensor([[[0.0, 0.1, 0.9, 0.2]]])  # one 1×4 map
    with pytest.raises(ValueError, match=r"could be boxes or one mask.*boxes_to_masks"):
        metrics.pointing_game(maps, torch.tensor([[0, 0, 3, 0]]))
    whole = metrics.boxes_to_masks(torch.tensor([[0, 0, 3, 0]]), (1, 4))
    assert metrics.pointing_game(maps, whole).tolist() == [1.0]
    assert metrics.relevance_mass_accuracy(maps, whole).tolist() == [1.0]
    left = metrics.boxes_to_masks(torch.tensor([[0, 0, 1, 0]]), (1, 4))
    torch.testing.assert_close(metrics.relevance_mass_accuracy(maps, left), torch.tensor([0.1 / 1.2]))


def test_pointing_game_tolerance_beyond_the_maps_diagonal_is_the_whole_map_and_cheap():
    import time

    import explain.metrics as metrics

    maps = torch.zeros(1, 8, 8)
    maps[0, 7, 7] = 1.0
    mask = torch.zeros(1, 8, 8, dtype=torch.bool)
    mask[0, 0, 0] = True
    started = time.perf_counter()
    assert metrics.pointing_game(maps, mask, tolerance=1e9).tolist() == [1.0]  # every pixel within 1e9 px
    assert time.perf_counter() - started < 5  # was a (2·10⁹ + 1)² disk
    assert metrics.pointing_game(maps, mask, tolerance=9.8).tolist() == [0.0]  # 7·√2 ≈ 9.9 px away
    assert metrics.pointing_game(maps, mask, tolerance=9.9).tolist() == [1.0]


def test_faithfulness_metrics_score_a_huggingface_classifier_output():
    import explain.metrics as metrics

    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, num_labels=3)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config).eval()
    x, heat = torch.randn(1, 3, 16, 16), torch.rand(1, 16, 16)
    curve = metrics.deletion(model, x, heat, target=2, steps=2)
    ranks = heat.flatten().argsort(descending=True)
    expected = []
    for count in (0, 128, 256):
        removed = torch.zeros(256, dtype=torch.bool)
        removed[ranks[:count]] = True
        image = torch.where(removed.view(1, 1, 16, 16), torch.zeros_like(x), x)
        with torch.no_grad():
            expected.append(model(pixel_values=image).logits.softmax(dim=1)[0, 2])
    torch.testing.assert_close(curve.curves[0], torch.stack(expected), rtol=1e-5, atol=1e-6)
    dropped = metrics.confidence_change(model, x, heat, target=2, output="logits")
    with torch.no_grad():
        before = model(pixel_values=x).logits.softmax(dim=1)[0, 2]
        after = model(pixel_values=x * heat[:, None]).logits.softmax(dim=1)[0, 2]
    torch.testing.assert_close(dropped.drop, ((before - after).clamp_min(0) / before)[None], rtol=1e-5, atol=1e-6)


def test_integrated_gradients_with_a_tolerance_gives_each_image_what_it_gets_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).double().eval()
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    images[0] *= 6  # a curved path for image 0: more steps than image 1 needs
    explainer = explain.IntegratedGradients(model, steps=2, tolerance=1e-3, normalize=None)
    together = explainer.explain(images, target=[0, 1])
    steps = together.diagnostics["steps"].tolist()
    assert steps[0] > steps[1]
    for image in range(2):
        alone = explainer.explain(images[image : image + 1], target=[0, 1][image])
        assert alone.diagnostics["steps"].tolist() == [steps[image]]
        torch.testing.assert_close(together.attributions[image], alone.attributions[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(together[image].raw_maps, alone.raw_maps)


def test_gradient_shap_with_references_equal_to_the_image_names_the_empty_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3)).eval()
    x = torch.randn(1, 3, 8, 8)
    with pytest.warns(RuntimeWarning, match=r"\(0, 0\): the baseline equals the image"):
        result = explain.GradientShap(model, baselines=x.clone(), samples=3).explain(x, target=1)
    assert result.attributions.eq(0).all()


def test_xrai_shows_one_bar_of_its_own_and_none_of_its_integrated_gradients(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 16 * 16, 3)).eval()
    x = torch.randn(1, 3, 16, 16)
    explain.XRAI(model, steps=4, progress=True).explain(x, target=0)
    shown = capsys.readouterr().err
    assert "XRAI:" in shown and "/2 " in shown and "IntegratedGradients" not in shown
    explain.XRAI(model, steps=200, batch_size=8, progress=False).explain(x, target=0)  # 50 passes: still quiet
    assert capsys.readouterr().err == ""


def test_small_things_the_attack_found():
    import explain.metrics as metrics

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 8 * 8, 3)).eval()
    x = torch.randn(2, 3, 8, 8)
    result = explain.Saliency(model).explain(x, target=[0, 1])
    assert len(result[[]]) == 0 and result[[]].maps.shape == (0, 8, 8)
    generated = metrics.road(model, x, result, percentages=(share for share in (0.2, 0.5)), noise=0.0)
    listed = metrics.road(model, x, result, percentages=[0.2, 0.5], noise=0.0)
    torch.testing.assert_close(generated.curves, listed.curves)
    with pytest.raises(ValueError, match=r"percentages must be a sequence of shares"):
        metrics.road(model, x, result, percentages="0.5")
    with pytest.raises(TypeError, match=r"class_names must be a list of names.*got str"):
        explain.Saliency(model, class_names="cat dog bird")


class AuxiliaryHead(nn.Module):
    """Two heads on one trunk, as training-time auxiliary heads are: {"out": main, "aux": auxiliary}."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.main = nn.Conv2d(4, 3, 1)
        self.aux_head = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 3, 1))  # runs last

    def forward(self, x: Tensor) -> dict:
        features = self.trunk(x)
        return {"out": self.main(features).mean(dim=(2, 3)), "aux": self.aux_head(features).mean(dim=(2, 3))}


def test_the_automatic_layer_reaches_the_output_explained_not_an_auxiliary_head():
    import torchvision

    for seed in range(8):  # a random head can hold only evidence against the target (a zero map): seeded, the first
        torch.manual_seed(seed)  # whose map is not zero, so that the test does not depend on the tests run before it
        x = torch.randn(1, 3, 32, 32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            chosen = explain.GradCAM(AuxiliaryHead().eval(), output="out").explain(x, target=1)
        if chosen.raw_maps.abs().sum() > 0:
            break
    assert chosen.layer == "main"  # the last layer whose output the score depends on; not aux_head's
    assert chosen.raw_maps.abs().sum() > 0
    torch.manual_seed(0)
    deeplab = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=3,
                                                                 aux_loss=True).eval()
    assert explain.GradCAM(deeplab).explain(x, target=explain.SegmentationTarget(0, mask=torch.ones(32, 32))).layer \
        == "backbone.layer4"  # the last backbone stage (the head's output is the logits themselves), never aux's


# ---------------------------------------------------------------- found by reviewing the change


def test_a_model_compiled_in_place_is_refused_only_by_methods_that_record_its_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3)).eval()
    x = torch.randn(1, 3, 8, 8)
    eager = {name: explain.get_method(name)(model).explain(x, target=1).raw_maps
             for name in ("saliency", "integratedgradients")}
    model.compile(backend="eager")
    for name, expected in eager.items():  # only the output is differentiated: compiled code serves as well
        torch.testing.assert_close(explain.get_method(name)(model).explain(x, target=1).raw_maps, expected)
    for name in ("guidedbackprop", "deeplift"):  # rules on the forward's functions: compiled code would skip them
        with pytest.raises(TypeError, match=r"cannot look inside code that torch.compile runs"):
            explain.get_method(name)(model)


def test_guided_ig_shows_one_bar_over_its_steps(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3)).eval()
    explain.GuidedIG(model, steps=12, progress=True).explain(torch.randn(1, 3, 8, 8), target=0)
    shown = capsys.readouterr().err
    assert "GuidedIG:" in shown and "/12 " in shown and "row" not in shown
    explain.GuidedIG(model, steps=12).explain(torch.randn(1, 3, 8, 8), target=0)  # 12 passes > 8: shown
    assert "/12 " in capsys.readouterr().err


def test_xrai_over_a_cam_does_not_warn_about_precision_and_batch_sizes_are_checked(recwarn):
    import numpy as np

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16 * 16, 3)).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explain.XRAI(explain.GradCAM(model, "1")).explain(torch.randn(1, 3, 16, 16), target=0)
    assert not [w for w in recwarn if "significant bits" in str(w.message)]
    for cls in (explain.ScoreCAM, explain.AblationCAM):
        with pytest.raises(ValueError, match=r"batch_size must be an int of at least 1; got 2.5"):
            cls(model, "1", batch_size=2.5)
    assert explain.IntegratedGradients(model, batch_size=np.int64(4)).batch_size == 4


def test_class_names_come_from_classifiers_only_and_the_command_line_resolves_them_as_python_does():
    from explain.cli import parse_target

    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32,
                                    id2label={0: "animal0", 1: "animal1", 2: "animal2"})
    backbone = transformers.ViTModel(config).eval()  # its features are not classes
    assert explain.Saliency(backbone, output="pooler_output").class_names is None
    assert explain.Saliency(transformers.ViTForImageClassification(config)).class_names[2] == "animal2"
    names = ["tench", "tabby, tabby cat", "cardigan", "Cardigan, Cardigan Welsh corgi"]
    assert parse_target("tabby", names) == 1
    assert parse_target("3", names) == 3
    with pytest.raises(ValueError, match=r"'cardigan' matches 2 classes"):
        parse_target("cardigan", names)
    with pytest.raises(ValueError, match=r"class names are not known: give an index, or the names with --class-names"):
        parse_target("tabby", None)
