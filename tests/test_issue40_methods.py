"""Issue 40, per-call overhead of the methods: a call does only the work its method's definition needs, and what it
gives back is what the slower code gave. Noise drawn for many samples at once equals the same samples drawn one at a
time (so a seed gives the same SmoothGrad maps as before), the cheaper normalisation and target selection give the
same values, and a call dispatches only a handful of operations beyond the model's own forward and backward."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import explain
from explain.core.targets import select_targets
from explain.methods.maps import map_extremes, normalize_maps
from explain.methods.smoothing import noise_source


class CountOperations(TorchDispatchMode):
    """Counts the ATen operations dispatched while active (as benchmarks/overhead.py counts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def operations(call: Callable[[], Any]) -> int:
    call()  # lazy initialisation is not per call
    with CountOperations() as counter:
        call()
    return counter.count


def small_cnn(classes: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes)).eval()


def small_mlp(classes: int = 3) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 5 * 5, 6), nn.Tanh(), nn.Linear(6, classes)).eval()


def one_at_a_time(seed: int, shape: tuple[int, ...], samples: int) -> torch.Tensor:
    """The noise as the code before issue 40 drew it: one standard normal draw of the batch's shape per sample, in
    order, from a CPU generator seeded with ``seed``; (samples · N, C, H, W)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(shape, generator=generator) for _ in range(samples)])


@pytest.mark.parametrize("shape", [(1, 3, 8, 8), (2, 3, 4, 4), (1, 3, 5, 5)],
                         ids=["one image, 192 values", "two images, 96 values", "75 values, drawn one by one"])
def test_one_draw_of_many_samples_equals_the_samples_drawn_one_at_a_time(shape):
    batch = torch.zeros(shape)
    expected = one_at_a_time(7, shape, 6)
    noise_of = noise_source(7, batch)
    torch.testing.assert_close(noise_of(range(0, 6)), expected, rtol=0, atol=0)
    # passes of their own, a pass run again (after running out of memory) and a pass that begins inside a sample
    noise_of = noise_source(7, batch)
    count = shape[0]
    torch.testing.assert_close(noise_of(range(0, 2)), expected[: 2 * count], rtol=0, atol=0)
    torch.testing.assert_close(noise_of(range(2, 4)), expected[2 * count: 4 * count], rtol=0, atol=0)
    torch.testing.assert_close(noise_of(range(2, 4)), expected[2 * count: 4 * count], rtol=0, atol=0)
    torch.testing.assert_close(noise_of(range(3, 6)), expected[3 * count:], rtol=0, atol=0)


@pytest.mark.parametrize("build, shape", [(small_cnn, (1, 3, 8, 8)), (small_mlp, (2, 3, 5, 5))],
                         ids=["cnn, one image", "mlp, two images"])
def test_smoothgrad_with_a_seed_is_the_mean_gradient_over_noise_drawn_sample_by_sample(build, shape):
    model = build().double()
    torch.manual_seed(3)
    images = torch.randn(shape, dtype=torch.float64)
    targets = [1] * shape[0]
    samples, noise_std = 5, 0.3
    result = explain.SmoothGrad(model, samples=samples, noise_std=noise_std, seed=11, normalize=None,
                                batch_size=2).explain(images, target=targets)
    # one draw of one image's shape per sample, shared by the batch's images (an image's map does not depend on
    # the rest of its batch); the generator draws float32 noise, cast to the batch
    noise = one_at_a_time(11, (1, *shape[1:]), samples).double()
    expected = torch.zeros_like(images)
    for sample in range(samples):
        noisy = (images + noise[sample: sample + 1] * noise_std).requires_grad_(True)
        (gradient,) = torch.autograd.grad(model(noisy)[:, 1].sum(), noisy)
        expected += gradient
    expected /= samples
    torch.testing.assert_close(result.attributions[:, 0], expected, rtol=1e-10, atol=1e-12)  # the model's float64
    torch.testing.assert_close(result.raw_map_grid[:, 0], expected.abs().amax(dim=1).float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("maps", [
    torch.tensor([[[[0.0, 2.0], [-4.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]]]),
    torch.rand(3, 2, 5, 7),
], ids=["signed and all-zero maps", "non-negative maps"])
def test_max_normalisation_divides_each_map_by_its_largest_magnitude(maps):
    expected = torch.stack([torch.stack([one / one.abs().max() if one.abs().max() > 0 else one for one in image])
                            for image in maps])
    torch.testing.assert_close(normalize_maps(maps, "max"), expected, rtol=0, atol=0)
    torch.testing.assert_close(map_extremes(maps, "max"), maps.abs().flatten(2).amax(dim=2), rtol=0, atol=0)
    if bool((maps >= 0).all()):
        torch.testing.assert_close(map_extremes(maps, "max", nonnegative=True), map_extremes(maps, "max"), rtol=0,
                                   atol=0)
    kept = map_extremes(maps, "max", keepdim=True)  # (N, K, 1, 1), as an explainer call divides by them
    torch.testing.assert_close(kept, maps.abs().flatten(2).amax(dim=2)[..., None, None], rtol=0, atol=0)
    torch.testing.assert_close(normalize_maps(maps, "max", kept), expected, rtol=0, atol=0)


def test_a_list_of_class_indices_selects_the_same_targets_as_a_tensor_of_them():
    output = torch.randn(3, 6)
    from_list = select_targets(output, [5, 0, 2], batch_size=3)
    from_tensor = select_targets(output, torch.tensor([5, 0, 2]), batch_size=3)
    assert torch.equal(from_list.class_indices, torch.tensor([[5], [0], [2]]))
    assert torch.equal(from_list.class_indices, from_tensor.class_indices)
    assert torch.equal(from_list.scores, output[[0, 1, 2], [5, 0, 2]][:, None])
    torch.testing.assert_close(from_list.probabilities, output.softmax(dim=1)[[0, 1, 2], [5, 0, 2]][:, None])
    assert not from_list.keep_target_dim
    with torch.inference_mode():  # made in the caller's inference mode: still usable by autograd afterwards
        indices = select_targets(output, (1, 2, 3), batch_size=3).class_indices
    assert indices is not None and not indices.is_inference()
    with pytest.raises(TypeError, match="class targets must be integers"):
        select_targets(output, [True, False, True], batch_size=3)
    with pytest.raises(ValueError, match="2 targets were given for a batch of 3 images"):
        select_targets(output, [1, 2], batch_size=3)
    with pytest.raises(ValueError, match="class index 6 is out of range"):
        select_targets(output, [1, 6, 2], batch_size=3)
    with pytest.raises(ValueError, match="class index 7 is out of range"):  # the first one out of range, in order
        select_targets(output, torch.tensor([[1, 7], [-1, 2], [0, 0]]), batch_size=3)


@pytest.mark.parametrize("method, options, slack", [
    ("saliency", {}, 16),
    ("integratedgradients", {"steps": 8}, 80),
    ("smoothgrad", {"samples": 4, "seed": 0}, 48),
], ids=["saliency", "integrated gradients", "smoothgrad"])
@pytest.mark.parametrize("build, shape", [(small_cnn, (1, 3, 8, 8)), (small_mlp, (1, 3, 5, 5))], ids=["cnn", "mlp"])
def test_a_call_dispatches_few_operations_beyond_one_forward_and_backward_of_its_rows(method, options, slack, build,
                                                                                       shape):
    """A call's own work (inputs, targets, checks, reduction, normalisation, the explanation) is a handful of
    operations, whatever the model: those of one forward and one backward of all its rows (the image and its 8
    path points, or its 4 noisy copies, in one pass), as a bare autograd loop makes them, plus at most ``slack``."""
    model = build()
    torch.manual_seed(2)
    image = torch.randn(shape)
    rows = {"saliency": 1, "integratedgradients": 8, "smoothgrad": 4 + 1}[method]  # SmoothGrad: the clean image too
    explainer = explain.get_method(method)(model, **options)

    def bare() -> torch.Tensor:
        inputs = image.expand(rows, *shape[1:]).clone().requires_grad_(True)
        return torch.autograd.grad(model(inputs)[:, 1].sum(), inputs)[0]

    ours = operations(lambda: explainer.explain(image, target=[1]).maps)
    assert ours <= operations(bare) + slack


@pytest.mark.parametrize("build", [small_cnn, lambda: small_cnn().double()], ids=["float32", "float64"])
def test_smoothgrad_of_a_hidden_unit_reads_the_unit_on_the_noisy_copies_alone(build):
    """A hidden unit's value is read from its layer in the forward pass, not from the output: the clean images'
    rows, which a call folds into its first pass for class targets, never join that forward (the unit would have
    more values than the copies). SmoothGrad of channel 2 of the first convolution equals the mean gradient of its
    spatial mean over the noisy copies, worked by hand."""
    model = build()
    dtype = next(model.parameters()).dtype
    torch.manual_seed(4)
    images = torch.randn(2, 3, 6, 6, dtype=dtype)
    result = explain.SmoothGrad(model, samples=3, noise_std=0.2, seed=5, normalize=None).explain(
        images, target=explain.Channel("0", 2))
    noise = one_at_a_time(5, (1, *images.shape[1:]), 3).to(dtype)  # one draw per sample, shared by the images
    expected = torch.zeros_like(images)
    for sample in range(3):
        noisy = (images + noise[sample: sample + 1] * 0.2).requires_grad_(True)
        (gradient,) = torch.autograd.grad(model[0](noisy)[:, 2].mean(dim=(1, 2)).sum(), noisy)
        expected += gradient / 3
    torch.testing.assert_close(result.attributions[:, 0], expected, rtol=1e-5, atol=1e-6)  # in the model's dtype
