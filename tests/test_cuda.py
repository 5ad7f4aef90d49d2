"""On a CUDA GPU (skipped without one): every kind of method gives the CPU's maps, keeps its tensors on the
model's device, holds no GPU memory once a call returns, and works under float16 autocast and on a
float16 model. TF32 is switched off here so that CUDA and CPU compute the same float32 products."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torchvision

import explain
from explain.data import load_demo_vit, make_dataset
from explain.data.train import to_model_input

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

METHODS = {
    "gradcam": {}, "hirescam": {}, "gradcam++": {}, "scorecam": {"progress": False}, "ablationcam": {"progress": False},
    "saliency": {}, "integratedgradients": {"steps": 8}, "guidedbackprop": {}, "guidedgradcam": {},
    "deeplift": {}, "gradientshap": {"samples": 4}, "lrp": {"composite": "epsilon_plus"},
    "layerintegratedgradients": {"steps": 8}, "layerconductance": {"steps": 8}, "fullgrad": {},
    "smoothgrad": {"samples": 4, "noise": 0.0},  # noise is drawn on the batch's device: see the test below
}


@pytest.fixture(scope="module")
def exact_float32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def build(name: str, model: torch.nn.Module, layer: str = "layer4") -> explain.Explainer:
    cls = explain.get_method(name)
    return cls(model, layer, **METHODS[name]) if cls.needs_layer else cls(model, **METHODS[name])


@pytest.mark.parametrize("name", list(METHODS))
def test_cuda_maps_equal_the_cpu_maps_and_stay_on_the_gpu(name, exact_float32):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(3, 3, 64, 64)
    targets = [1, 4, 7]
    on_cpu = build(name, model).explain(x, target=targets)
    model.cuda()
    on_gpu = build(name, model).explain(x.cuda(), target=targets)
    assert on_gpu.maps.device.type == "cuda" and on_gpu.scores.device.type == "cuda"
    if on_gpu.attributions is not None:
        assert on_gpu.attributions.device.type == "cuda"
    torch.testing.assert_close(on_gpu.maps.cpu(), on_cpu.maps, rtol=1e-3, atol=2e-3)


def test_smoothgrad_draws_its_noise_on_the_gpu_sample_by_sample_from_its_seed(exact_float32):
    """By hand: the mean over samples of ∂y/∂x at x + ε·0.15·(max − min), ε from a CUDA generator seeded
    with the seed, one (N, C, H, W) draw per sample; then max |·| over the colour channels."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval().cuda()
    x, targets = torch.randn(2, 3, 64, 64, device="cuda"), torch.tensor([1, 4], device="cuda")
    result = explain.SmoothGrad(model, samples=4, seed=3, normalize=None).explain(x, target=targets.tolist())
    generator = torch.Generator(device="cuda").manual_seed(3)
    spread = (x.amax(dim=(1, 2, 3)) - x.amin(dim=(1, 2, 3))).view(-1, 1, 1, 1) * 0.15
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(4):
        noisy = (x + torch.randn(x.shape, generator=generator, device="cuda") * spread).requires_grad_(True)
        (gradient,) = torch.autograd.grad(model(noisy).gather(1, targets[:, None]).sum(), noisy)
        total += gradient.double()
    expected = (total / 4).abs().amax(dim=1).float()
    torch.testing.assert_close(result.raw_maps, expected, rtol=1e-4, atol=1e-6)


def test_no_gpu_memory_is_held_once_calls_return(exact_float32):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval().cuda()
    x = torch.randn(4, 3, 64, 64, device="cuda")
    explainers = [build(name, model) for name in ("gradcam", "integratedgradients", "lrp", "guidedbackprop")]
    for explainer in explainers:  # warm-up: cuDNN workspaces, lazy modules
        explainer.explain(x).maps.sum().item()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(10):
        for explainer in explainers:
            explainer.explain(x).maps.sum().item()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.filterwarnings("ignore:.*zero everywhere:RuntimeWarning")  # a class with only negative evidence
def test_float16_autocast_and_a_float16_model_give_float32_maps_close_to_float32():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval().cuda()
    x = torch.randn(2, 3, 96, 96, device="cuda")
    reference = explain.GradCAM(model, "layer4").explain(x, target=[1, 2]).maps
    with torch.autocast("cuda", dtype=torch.float16):
        mixed = explain.GradCAM(model, "layer4").explain(x, target=[1, 2]).maps
    assert mixed.dtype == torch.float32
    assert (mixed - reference).abs().max() < 0.05
    full = explain.GuidedGradCAM(model, "layer4").explain(x, target=[1, 2]).maps
    guided = explain.GuidedGradCAM(model.half(), "layer4").explain(x.half(), target=[1, 2])
    assert guided.maps.dtype == torch.float32 and torch.isfinite(guided.maps).all()
    # the model's float16 backward rounds its per-pixel gradients (measured on an H100: 0.107 of the
    # maximum), said by a warning; products and normalisation in float32: no underflow to 0
    assert (guided.maps - full).abs().max() < 0.2
    with pytest.warns(RuntimeWarning, match=r"GuidedGradCAM ran in float16 \(the model's dtype\)"):
        explain.GuidedGradCAM(model, "layer4").explain(x.half(), target=[1, 2])
    assert torch.equal(guided.maps.flatten(1).amax(1) > 0, full.flatten(1).amax(1) > 0)


def test_the_demo_transformers_attention_methods_on_the_gpu_equal_the_cpu(exact_float32):
    model = load_demo_vit()
    batch = to_model_input(make_dataset(4, seed=3).images)
    for name in ("attentionrollout", "gradientrollout"):
        on_cpu = explain.get_method(name)(model).explain(batch, topk=2)
        on_gpu = explain.get_method(name)(model.cuda()).explain(batch.cuda(), topk=2)
        model.cpu()
        torch.testing.assert_close(on_gpu.maps.cpu(), on_cpu.maps, rtol=1e-3, atol=1e-3)


def test_a_pass_too_large_for_the_gpu_is_run_again_in_halves(exact_float32):
    """Integrated Gradients' 256 rows in one pass (resnet18, 224 px: about 5 GB) under a 2 GiB cap:
    the pass is halved until it fits, the map equals 32-row passes', and the size is kept."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval().cuda()
    x = torch.randn(4, 3, 224, 224, device="cuda")
    expected = explain.IntegratedGradients(model, steps=64, batch_size=32).explain(x, target=[1, 2, 3, 4])
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total)
    try:
        explainer = explain.IntegratedGradients(model, steps=64)
        result = explainer.explain(x, target=[1, 2, 3, 4])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert explainer.rows_that_fit[str(x.device)] < 256
    torch.testing.assert_close(result.maps, expected.maps, rtol=1e-3, atol=2e-3)


RANDOM_ON_THE_DEVICE = {"efficient_mprt", "cascading_randomization", "smooth_mprt"}
"""Metrics that re-initialise layers on the model's device: CUDA's random stream is not the CPU's, so their
values are compared for being finite and in range only."""
ORDERED_BY_ROUNDING = {"monotonicity_correlation"}
"""Metrics that rank score changes which float32 cannot tell apart: monotonicity correlation's groups change the
probability by 1e-9 and its Spearman correlation orders changes 1e-4 apart (relative), so its float32 value is one of
several that rounding decides (on the CPU alone, float32 gives 0.638 and float64 0.650 for one of these images:
tests/test_metrics_breadth.py). Compared in float64 on both devices, where rounding decides nothing."""


def metric_values_on(device: str, model: torch.nn.Module, method: str, x: torch.Tensor, y: torch.Tensor,
                     masks: torch.Tensor, cpu_explanation: explain.Explanation,
                     only: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
    """Every registered metric of ``evaluation.METRICS`` (or those named in ``only``) for ``method`` on ``device``,
    each given the CPU's maps (moved there): so that a metric that ranks pixels ranks the same values on both
    devices."""
    import copy
    import dataclasses

    from explain.dataset_tools.evaluation import METRICS, MetricInput

    placed = copy.deepcopy(model).to(device)
    explainer = explain.get_method(method)(placed)
    moved = dataclasses.replace(cpu_explanation, **{
        name: getattr(cpu_explanation, name).to(device)
        for name in ("map_grid", "raw_map_grid", "scores", "class_indices", "probabilities", "attributions")
        if getattr(cpu_explanation, name) is not None})
    given = MetricInput(placed, explainer, x.to(device), moved, y.to(device), masks.to(device))
    return {name: metric.compute(given) for name, metric in METRICS.items()
            if metric.applies(cpu_explanation) and (only is None or name in only)}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("method", ["saliency", "gradcam"])
def test_every_registered_metric_on_the_gpu_equals_the_cpu(method, exact_float32):
    """The 41 metrics of ``explain.evaluate`` on the GPU: the CPU's values (the same draws: metrics draw from CPU
    generators), and no error from a tensor left on the other device."""
    from conftest import SmallCNN

    torch.manual_seed(0)
    model = SmallCNN().eval()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.rand(2, 3, 32, 32, generator=generator), torch.tensor([1, 3])
    masks = torch.zeros(2, 32, 32, dtype=torch.bool)
    masks[0, 4:14, 6:20], masks[1, 18:30, 10:28] = True, True
    explanation = explain.get_method(method)(model).explain(x, y)
    on_cpu = metric_values_on("cpu", model, method, x, y, masks, explanation)
    on_gpu = metric_values_on("cuda", model, method, x, y, masks, explanation)
    assert on_gpu.keys() == on_cpu.keys()
    wide = [name for name in ORDERED_BY_ROUNDING if name in on_cpu]
    on_cpu.update(metric_values_on("cpu", model.double(), method, x.double(), y, masks, explanation, wide))
    on_gpu.update(metric_values_on("cuda", model.double(), method, x.double(), y, masks, explanation, wide))
    for name, values in on_cpu.items():
        if name in RANDOM_ON_THE_DEVICE:
            assert on_gpu[name].shape == values.shape and torch.isfinite(on_gpu[name]).all(), name
            continue
        torch.testing.assert_close(on_gpu[name].cpu(), values, rtol=1e-3, atol=1e-4, equal_nan=True, msg=name)
