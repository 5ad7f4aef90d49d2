"""The new CAMs and options against pytorch-grad-cam 1.5.7, per image, on resnet18 and densenet121.

pytorch-grad-cam is an optional test dependency: it declares opencv-python, which would replace the
headless OpenCV the toolkit uses, so it is installed with ``pip install --no-deps grad-cam==1.5.7``
(its other needs, ttach and scikit-learn, are in the test extra). Without it these tests are skipped.

Where the peer computes the same map, the maps correlate ≥ 0.999 per image and target. Where they
differ, the test shows why, with the paper:
- the sign of a principal component is arbitrary; the toolkit turns it to follow Σ_k terms (the map
  without the projection), the peer keeps what numpy's SVD or scikit-learn's eigensolver returns, so
  some of its maps are the other sign's ReLU: those equal ours computed with the sign flipped;
- FEM: the peer swaps the paper's weights and maps (Σ_k mean(B_k) A_k instead of Σ_k μ_k B_k);
- on the CPU the peer stores a layer's output without copying it, so an in-place ReLU after the
  layer (densenet121's ``features``, followed by ``F.relu(inplace=True)``) rectifies what it stores.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import explain

pytest.importorskip("cv2")
pytest.importorskip("ttach")
pytest.importorskip("sklearn")
grad_cam = pytest.importorskip("pytorch_grad_cam")
from pytorch_grad_cam.utils.model_targets import ClassifierOutputReST, ClassifierOutputTarget  # noqa: E402

SIZE = 96  # 3 × 3 positions at the last stage: enough for principal components and the k-sigma rule
CASES = {"resnet18": "layer4", "densenet121": "features.denseblock4"}
FEM_LAYERS = {"resnet18": "layer4", "densenet121": "features.denseblock4.denselayer16.relu2"}  # after a ReLU


def randomised_batchnorm(model: nn.Module) -> nn.Module:
    """Running statistics and affine parameters as after training (the initial ones make every
    BatchNorm the identity, and FullGrad's BatchNorm biases zero)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                size = module.num_features
                module.running_mean.copy_(torch.randn(size, generator=generator) * 0.2)
                module.running_var.copy_(torch.rand(size, generator=generator) + 0.5)
                module.weight.copy_(torch.rand(size, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(size, generator=generator) * 0.2)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    torch.manual_seed(0)
    model = randomised_batchnorm(getattr(torchvision.models, request.param)(num_classes=10).eval())
    x = torch.randn(3, 3, SIZE, SIZE)
    with torch.no_grad():
        classes = model(x).topk(2, dim=1).indices  # (3, 2): two targets per image
    return request.param, model, x, classes


def peer_maps(method, model, layers, x, classes, target=ClassifierOutputTarget, **call) -> np.ndarray:
    """(N, K, H, W): the peer's maps, one call per target column."""
    modules = dict(model.named_modules())
    maps = []
    for column in range(classes.shape[1]):
        with warnings.catch_warnings(), method(model, [modules[name] for name in layers]) as cam:
            warnings.simplefilter("ignore")
            maps.append(cam(x, [target(int(c)) for c in classes[:, column]], **call))
    return np.stack(maps, axis=1)


def correlations(ours: torch.Tensor, peer: np.ndarray) -> np.ndarray:
    """(N, K) Pearson correlation per map; 1 where both maps are constant (empty), 0 where only one is."""
    ours = ours.detach().double().flatten(2).numpy()
    peer = peer.reshape(ours.shape).astype(np.float64)
    result = np.empty(ours.shape[:2])
    for index in np.ndindex(*ours.shape[:2]):
        a, b = ours[index] - ours[index].mean(), peer[index] - peer[index].mean()
        norms = np.linalg.norm(a) * np.linalg.norm(b)
        result[index] = (a @ b) / norms if norms > 0 else float(np.linalg.norm(a) == np.linalg.norm(b))
    return result


def explain_quietly(method, model, layer, x, classes, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # empty maps of a random network
        args = (model,) if layer is None else (model, layer)
        return method(*args, normalize=None, **options).explain(x, target=classes.tolist())


SAME = {  # name: (ours, our options, peer, peer call options)
    "gradcamelementwise": (explain.GradCAMElementWise, {}, grad_cam.GradCAMElementWise, {}),
    "aug_smooth (Grad-CAM)": (explain.GradCAM, {"smooth": "augment"}, grad_cam.GradCAM, {"aug_smooth": True}),
    "aug_smooth (Layer-CAM)": (explain.LayerCAM, {"smooth": "augment"}, grad_cam.LayerCAM, {"aug_smooth": True}),
}


@pytest.mark.parametrize("name", list(SAME))
def test_maps_equal_the_peer(name, case):
    model_name, model, x, classes = case
    ours, options, peer, call = SAME[name]
    if "smooth" in options:  # the peer averages min-max normalised maps
        options = {**options, "normalize": "minmax"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = ours(model, CASES[model_name], **{"normalize": None, **options}).explain(x, target=classes.tolist())
    agreement = correlations(result.raw_maps, peer_maps(peer, model, [CASES[model_name]], x, classes, **call))
    print(f"{model_name} {name}: correlation per image and target {np.round(agreement, 5).tolist()}")
    assert agreement.min() >= 0.999


def test_shapley_cam_equals_the_peer_with_its_rest_target(case):
    model_name, model, x, classes = case
    index = classes[:, 0]
    rows = torch.arange(len(index))

    def rest(output):  # the peer's ClassifierOutputReST: the logit plus its log-softmax
        return output[rows, index] + output.log_softmax(1)[rows, index]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = explain.ShapleyCAM(model, CASES[model_name], normalize=None).explain(x, target=rest)
        gradcam = explain.GradCAM(model, CASES[model_name], normalize=None).explain(x, target=rest)
    peer = peer_maps(grad_cam.ShapleyCAM, model, [CASES[model_name]], x, classes[:, :1], ClassifierOutputReST)
    agreement = correlations(result.raw_maps[:, None], peer)
    print(f"{model_name} ShapleyCAM: {np.round(agreement, 5).ravel().tolist()}; Grad-CAM against it "
          f"{np.round(correlations(gradcam.raw_maps[:, None], peer), 5).ravel().tolist()}")
    assert agreement.min() >= 0.999


def test_fullgrad_equals_the_peer(case):
    model_name, model, x, classes = case
    classes = classes[:, :1]  # the peer resizes every channel of every layer: one target per image
    result = explain_quietly(explain.FullGrad, model, None, x, classes)
    agreement = correlations(result.raw_maps[:, None], peer_maps(grad_cam.FullGrad, model, [], x, classes))
    print(f"{model_name} FullGrad: {np.round(agreement, 5).tolist()}, completeness error "
          f"{result.diagnostics['completeness_error'].abs().max():.2e}")
    assert agreement.min() >= 0.999


SIGNED = {  # principal components: the peer leaves the sign as its solver returns it
    "eigengradcam": (explain.EigenGradCAM, {}, grad_cam.EigenGradCAM, {}),
    "kpcacam": (explain.KernelPCACAM, {}, grad_cam.KPCA_CAM, {}),
    "eigen_smooth (Grad-CAM)": (explain.GradCAM, {"smooth": "eigen"}, grad_cam.GradCAM, {"eigen_smooth": True}),
    "eigen_smooth (Grad-CAM element-wise)": (explain.GradCAMElementWise, {"smooth": "eigen"},
                                             grad_cam.GradCAMElementWise, {"eigen_smooth": True}),
}


@pytest.mark.parametrize("name", list(SIGNED))
def test_principal_component_maps_equal_the_peer_up_to_its_arbitrary_sign(name, case):
    model_name, model, x, classes = case
    ours, options, peer, call = SIGNED[name]
    layer = CASES[model_name]
    result = explain_quietly(ours, model, layer, x, classes, **options)
    signed = explain_quietly(ours, model, layer, x, classes, relu=False, **options)
    flipped = F.interpolate(torch.relu(-signed.low_res_maps[0]), size=(SIZE, SIZE), mode="bilinear",
                            align_corners=False)
    peer = peer_maps(peer, model, [layer], x, classes, **call)
    same, other = correlations(result.raw_maps, peer), correlations(flipped, peer)
    print(f"{model_name} {name}: same sign {np.round(same, 5).tolist()}, other sign {np.round(other, 5).tolist()}; "
          f"the peer's sign differs for {int((same < 0.999).sum())} of {same.size} maps")
    assert (np.maximum(same, other) >= 0.999).all()


def test_fem_differs_from_the_peer_which_swaps_the_paper_s_weights_and_maps(case):
    model_name, model, x, classes = case
    layer = FEM_LAYERS[model_name]
    result = explain_quietly(explain.FEM, model, layer, x, classes[:, :1])
    peer = peer_maps(grad_cam.FEM, model, [layer], x, classes[:, :1])
    with explain.capture(model, layer) as captured, torch.no_grad():
        model(x)
    a = captured[layer].output.double()  # (N, C, h, w)
    means, stds = a.mean(dim=(2, 3), keepdim=True), a.std(dim=(2, 3), keepdim=True, correction=0)
    binary = (a > means + 2 * stds).double()
    swapped = torch.relu((binary.mean(dim=(2, 3), keepdim=True) * a).sum(1, keepdim=True))  # the peer's formula
    swapped = F.interpolate(swapped, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    against_peer = correlations(result.raw_maps[:, None], peer)
    print(f"{model_name} FEM: ours (Σ μ_k B_k, the paper) against the peer {np.round(against_peer, 3).ravel()}")
    assert correlations(swapped, peer).min() >= 0.999  # the peer computes Σ_k mean(B_k) A_k
    assert against_peer.min() < 0.99  # which is another map


def test_the_peer_stores_densenet_features_after_torchvision_s_in_place_relu():
    torch.manual_seed(0)
    model = randomised_batchnorm(torchvision.models.densenet121(num_classes=10).eval())
    x = torch.randn(3, 3, SIZE, SIZE)
    classes = torch.tensor([[1], [4], [7]])
    result = explain_quietly(explain.GradCAM, model, "features", x, classes)
    peer = peer_maps(grad_cam.GradCAM, model, ["features"], x, classes)
    stash = []

    def keep(module, args, output):
        stash.append(output)
        return output.clone()  # the in-place F.relu after the layer changes the clone

    handle = model.features.register_forward_hook(keep)
    try:
        output = model(x)
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(output[torch.arange(3), classes[:, 0]].sum(), stash[0])
    weights = gradient.mean(dim=(2, 3), keepdim=True)
    features = stash[0].detach()

    def cam(a):
        maps = torch.relu((weights * a).sum(1, keepdim=True)).detach()
        return F.interpolate(maps, size=(SIZE, SIZE), mode="bilinear", align_corners=False)

    assert correlations(cam(torch.relu(features)), peer).min() >= 0.999  # the peer's A is rectified
    assert correlations(result.raw_maps[:, None], cam(features).numpy()).min() >= 0.999  # ours is the true A
    against_peer = correlations(result.raw_maps[:, None], peer)
    print(f"densenet121 features, Grad-CAM against the peer: {np.round(against_peer, 4).ravel()}")
