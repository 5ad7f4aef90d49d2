"""Concept Relevance Propagation (Achtibat et al. 2023) as specifications: a concept's conditional heatmap is LRP (or
AttnLRP) with the relevance at the layer kept on that concept's channel alone — computed here by hand with a tensor
hook that masks the relevance (LRP's backward carries relevance; AttnLRP's carries gradients, relevance being
activation × gradient, so masking either masks the relevance) — on small CNNs and a ViT; over all concepts of a layer
the conditional maps sum to the unconditional map; many conditions in one backward pass equal one each; the model is
left as found."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ResidualNet, assert_complete_basis_conserves, assert_state_equal, model_state
from torch import nn

import explain


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 5, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(5, 4)).eval()


def small_vit() -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=4).eval()


CASES = {
    "cnn-lrp": (small_cnn, "4", "lrp", {"composite": "epsilon_plus"}),
    "cnn-attnlrp": (small_cnn, "4", "attnlrp", {}),
    "vit-attnlrp": (small_vit, "blocks.0", "attnlrp", {}),
}


def masked_by_hand(model, layer: str, method: str, options: dict, image: torch.Tensor, label: int, concept: int,
                   channel_dim: int) -> torch.Tensor:
    """The method's input relevance (C, H, W) for ``label`` with a hook that zeroes the relevance (or, for AttnLRP,
    the gradient) reaching ``layer``'s output on every channel but ``concept`` (-1: on every channel)."""
    module = dict(model.named_modules())[layer]

    def on_output(_module, _args, output):
        if output.requires_grad:
            shape = [1] * output.dim()
            shape[channel_dim] = output.shape[channel_dim]
            keep = torch.zeros(output.shape[channel_dim])
            if concept >= 0:  # -1: every channel masked
                keep[concept] = 1
            output.register_hook(lambda flowing: flowing * keep.view(shape))

    # registered as the layer starts, after the method's hooks: AttnLRP hands on a rule's tensor for an activation's
    # output, which is the one the rest of the model reads
    added = []
    handle = module.register_forward_pre_hook(lambda _module, _args: added.append(
        module.register_forward_hook(on_output)) if not added else None)
    try:
        explanation = explain.get_method(method)(model, **options).explain(image[None], target=label)
    finally:
        handle.remove()
        for late in added:
            late.remove()
    return explanation.attributions[0, 0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_concepts_map_is_the_relevance_masked_to_it_by_hand(case):
    build, layer, method, options = CASES[case]
    model = build()
    size = 32 if case.startswith("vit") else 16
    x = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    before = model_state(model)
    e = explain.ConceptRelevance(model, layer, method, **options).explain(x, concepts=3)
    assert_state_equal(before, model_state(model))
    assert_each_map_masked_by_hand(e, model, layer, method, options, x, 2 if case.startswith("vit") else 1,
                                   atol=1e-5, rtol=1e-4)


def assert_each_map_masked_by_hand(e, model, layer: str, method: str, options: dict, x: torch.Tensor,
                                   channel_dim: int, atol: float, rtol: float) -> None:
    """Every conditional map of ``e`` equals ``masked_by_hand`` at ``layer`` of ``model`` for its concept's unit."""
    classes = e.diagnostics["explained_class"]
    for image in range(e.attributions.shape[0]):
        for m in range(e.attributions.shape[1]):
            expected = masked_by_hand(model, layer, method, options, x[image], int(classes[image]),
                                      int(e.class_indices[image, m]), channel_dim)
            scale = float(expected.abs().max()) or 1.0
            torch.testing.assert_close(e.attributions[image, m] / scale, expected / scale, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_maps_of_all_concepts_sum_to_the_unconditional_map(case):
    """The rules pass relevance on linearly, and the masks of all channels add up to 1: conservation over concepts
    (within float32 rounding)."""
    build, layer, method, options = CASES[case]
    model = build()
    size = 32 if case.startswith("vit") else 16
    x = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(2))
    e = explain.ConceptRelevance(model, layer, method, batch_size=64, **options).explain(x, concepts=None)
    unconditional = explain.get_method(method)(model, **options).explain(
        x, target=e.diagnostics["explained_class"].tolist())
    total = e.attributions.sum(dim=1)
    scale = float(unconditional.attributions.abs().max())
    torch.testing.assert_close(total / scale, unconditional.attributions[:, 0] / scale, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(e.diagnostics["unconditional_map"], unconditional.raw_map_grid[:, 0])


def test_the_concepts_are_ranked_by_their_relevance_at_the_layer_read_by_hand():
    """concepts=k: the k channels with the largest relevance R_c = Σ over the channel's positions of the relevance
    LRP passes to the layer's output (read here with a tensor hook), highest first; scores are those R_c."""
    model = small_cnn()
    x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    seen = {}

    def on_output(_module, _args, output):
        output.register_hook(lambda relevance: seen.update(r=relevance.detach().double().sum(dim=(2, 3))))

    handle = model[4].register_forward_hook(on_output)
    try:
        explain.LRP(model, composite="epsilon_plus").explain(x)
    finally:
        handle.remove()
    e = explain.ConceptRelevance(model, "4", composite="epsilon_plus").explain(x, concepts=4)
    torch.testing.assert_close(e.diagnostics["layer_relevance"], seen["r"])
    assert e.class_indices[0].tolist() == seen["r"][0].argsort(descending=True)[:4].tolist()
    torch.testing.assert_close(e.scores[0].double(), seen["r"][0, e.class_indices[0]], atol=1e-7, rtol=1e-5)
    assert e.title(0, 0) == f"concept ({int(e.class_indices[0, 0])}): {float(e.scores[0, 0]):.3g}"


def test_many_conditions_in_one_pass_equal_one_condition_per_pass():
    model = small_cnn()
    x = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    together = explain.ConceptRelevance(model, "4", composite="epsilon_plus", batch_size=64).explain(
        x, concepts=[[0, 1], [2, 3], [4, 5]])
    alone = explain.ConceptRelevance(model, "4", composite="epsilon_plus", batch_size=1).explain(
        x, concepts=[[0, 1], [2, 3], [4, 5]])
    torch.testing.assert_close(together.attributions, alone.attributions, atol=1e-7, rtol=1e-5)
    assert together.class_indices.tolist() == [[0, 1], [2, 3], [4, 5]]


def test_bad_requests_are_refused_and_leave_the_model_as_found():
    model = small_cnn()
    model.train()
    before = model_state(model)
    x = torch.rand(1, 3, 16, 16)
    crp = explain.ConceptRelevance(model, "4", composite="epsilon_plus")
    with pytest.raises(ValueError, match="0 … 5"):
        crp.explain(x, concepts=[9])
    with pytest.raises(ValueError, match="1 to 6"):
        crp.explain(x, concepts=7)
    assert_state_equal(before, model_state(model))
    assert not any(module._forward_hooks for module in model.modules())
    with pytest.raises(ValueError, match="LRP or AttnLRP"):
        explain.ConceptRelevance(model, "4", explain.GradCAM(model, "4"))
    with pytest.raises(ValueError, match="not on the path"):  # a branch the prediction does not read

        class SideBranch(nn.Module):
            def __init__(self):
                super().__init__()
                self.main, self.side = small_cnn(), nn.Conv2d(3, 2, 1)

            def forward(self, images):
                self.side(images)
                return self.main(images)

        explain.ConceptRelevance(SideBranch().eval(), "side", composite="epsilon_plus").explain(x)


# ------------------------------------------------------------------ references and the glocal figure


def test_relevance_references_are_the_images_where_each_concept_carried_most_relevance():
    """concept_references(mode="relevance"): per concept, the images with the largest R_c for their own predicted
    class, as ConceptRelevance reports R_c image by image; mode="activation": the largest activation, by hand."""
    from explain.methods.concepts import concept_references

    model = small_cnn()
    images = torch.rand(7, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    crp = explain.ConceptRelevance(model, "4", composite="epsilon_plus")
    references = concept_references(crp, list(images), concepts=[1, 4], top=3, batch_size=3)
    per_image = torch.cat([crp.explain(images[i:i + 1], concepts=None).diagnostics["layer_relevance"]
                           for i in range(7)])
    for row, concept in enumerate([1, 4]):
        expected = per_image[:, concept].topk(3)
        assert references.images[row].tolist() == expected.indices.tolist()
        torch.testing.assert_close(references.values[row].double(), expected.values, atol=1e-7, rtol=1e-5)
        assert len(references.of(concept)) == 3 and all(patch.dtype.name == "uint8" for patch in references.of(concept))
    activations = concept_references(crp, list(images), concepts=[2], top=2, mode="activation")
    with torch.no_grad():
        largest = model[:5](images)[:, 2].flatten(1).amax(1)
    assert activations.images[0].tolist() == largest.topk(2).indices.tolist()


def test_the_watermark_models_top_concept_for_tagged_squares_looks_at_the_tag_in_its_references():
    """demo-watermark: for tagged "square" images, the most relevant channel of layer3 (CRP) has reference images
    (relevance maximisation over held-out images) whose conditional relevance sits on the tag: more than half of its
    positive relevance inside the tag's box, in every reference that carries the tag, and most references carry
    it."""
    from explain.data.demo_watermark import load_watermark_demo, watermark_held_out
    from explain.methods.concepts import concept_references

    model = load_watermark_demo()
    data = watermark_held_out(48)
    crp = explain.ConceptRelevance(model, "layer3")
    tagged = [image for image, flag in zip(data.images, data.watermarked) if flag][:4]
    top = crp.explain(tagged, concepts=1)
    concept = int(torch.mode(top.class_indices[:, 0]).values)
    references = concept_references(crp, list(data.images), concepts=[concept], top=5)
    tag_pixels = torch.from_numpy((data.images != data.clean_images).any(axis=-1))  # (N, H, W)
    carrying = [int(index) for index in references.images[0] if bool(tag_pixels[int(index)].any())]
    assert len(carrying) >= 4
    explanation = crp.explain([data.images[index] for index in carrying], concepts=[concept])
    # the share of each map's positive relevance inside the tag's bounding box
    assert bool((explain.metrics.energy_pointing_game(explanation.raw_maps[:, 0], tag_pixels[carrying]) > 0.5).all())


def test_the_glocal_figure_shows_each_concept_with_its_map_and_references():
    import matplotlib

    matplotlib.use("Agg")
    from explain.methods.concepts import concept_references, glocal_figure

    model = small_cnn()
    images = torch.rand(5, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    crp = explain.ConceptRelevance(model, "4", composite="epsilon_plus")
    explanation = crp.explain(images[:1], concepts=2)
    references = concept_references(crp, list(images), concepts=explanation.class_indices[0].tolist(), top=3)
    figure = glocal_figure(explanation, references, patches=3)
    axes = figure.axes
    assert len(axes) == 2 * (2 + 3)
    titles = [axis.get_title() for axis in axes]
    for row in range(2):
        concept = int(explanation.class_indices[0, row])
        assert f"concept {concept}: {float(explanation.scores[0, row]):.3g}" in titles
        assert len(axes[row * 5 + 4].images) == 1  # the third reference patch is drawn
    import matplotlib.pyplot as plt

    plt.close(figure)


def test_the_command_line_writes_each_images_glocal_figure_with_the_concepts_python_finds(tmp_path, capsys):
    from PIL import Image

    from explain.cli import main
    from explain.data.demo_watermark import load_watermark_demo, watermark_held_out

    data = watermark_held_out(12)
    references = tmp_path / "references"
    references.mkdir()
    for index, image in enumerate(data.images):
        Image.fromarray(image).save(references / f"{index:02d}.png")
    images = [str(references / "00.png"), str(references / "01.png")]
    code = main(["concepts", *images, "--model", "demo-watermark", "--layer", "layer3", "--concepts", "2",
                 "--references", str(references), "--top", "2", "--out", str(tmp_path / "glocal.png")])
    assert code == 0
    assert (tmp_path / "glocal-1.png").stat().st_size > 0 and (tmp_path / "glocal-2.png").stat().st_size > 0
    printed = capsys.readouterr().out.splitlines()
    crp = explain.ConceptRelevance(load_watermark_demo(), "layer3")
    for line, image in zip(printed, images):
        expected = crp.explain(image, concepts=2)
        for concept in expected.class_indices[0].tolist():
            assert f" {concept} (" in line
    assert main(["concepts", images[0], "--model", "demo-watermark", "--layer", "layer3", "--method",
                 "gradcam"]) == 2
    assert main(["concepts", images[0], "--model", "demo-watermark"]) == 2
    assert "--layer" in capsys.readouterr().err


def test_a_layer_that_runs_twice_is_refused_and_the_model_left_as_found():
    class SharedBlock(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.stem, self.block = nn.Conv2d(3, 4, 3, padding=1), nn.Sequential(nn.Conv2d(4, 4, 3, padding=1),
                                                                              nn.ReLU())
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

        def forward(self, x):
            return self.head(self.block(self.block(self.stem(x))))

    model = SharedBlock().eval()
    before = model_state(model)
    with pytest.raises(ValueError, match="runs 2 times"):
        explain.ConceptRelevance(model, "block", composite="epsilon_plus").explain(torch.rand(1, 3, 8, 8))
    assert_state_equal(before, model_state(model))
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())


def test_the_callers_grad_mode_and_another_threads_inference_change_nothing():
    """Inside inference_mode() or no_grad() the maps are those outside; another thread running the model meanwhile
    gets the plain model's output and leaves the maps as they are; a layer returning a tuple is refused."""
    import threading

    model = small_cnn()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(8))
    crp = explain.ConceptRelevance(model, "4", composite="epsilon_plus")
    expected = crp.explain(x, concepts=3)
    for context in (torch.inference_mode, torch.no_grad):
        with context():
            torch.testing.assert_close(crp.explain(x, concepts=3).raw_maps, expected.raw_maps)
    with torch.no_grad():
        plain = model(x)
    outputs, stop = [], threading.Event()

    def other_thread():
        while not stop.is_set():
            with torch.no_grad():
                outputs.append(model(x))

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        during = crp.explain(x, concepts=3)
    finally:
        stop.set()
        thread.join()
    torch.testing.assert_close(during.raw_maps, expected.raw_maps)
    assert outputs and all(torch.equal(output, plain) for output in outputs)

    class Pair(nn.Module):
        def __init__(self, module: nn.Module):
            super().__init__()
            self.module = module

        def forward(self, images):
            return self.module(images), None

    class TupleLayer(nn.Module):
        def __init__(self):
            super().__init__()
            inner = small_cnn()
            self.features, self.rest = Pair(inner[:5]), inner[5:]

        def forward(self, images):
            return self.rest(self.features(images)[0])

    with pytest.raises((ValueError, RuntimeError), match="returns tuple, not a tensor"):  # through the model call
        explain.ConceptRelevance(TupleLayer().eval(), "features", composite="epsilon_plus").explain(x)


# ------------------------------------------------------------------ directions as concepts (virtual inspection layers)


def random_basis(size: int, seed: int) -> torch.Tensor:
    """A random orthonormal basis (size, size), one direction per row."""
    matrix = torch.randn(size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.linalg.qr(matrix).Q.T.contiguous()


class VirtualInspection(nn.Module):
    """The virtual inspection layer of Vielhaben et al. (2024) after ``module``: h = U a, then a = Uᵀ h (the identity,
    up to rounding), as two bias-free linear maps over the channel dimension ``dim``; LRP through them (LRP-0 / ε) and a
    channel mask on h is the relevance of direction k, written from the paper's construction."""

    def __init__(self, module: nn.Module, basis: torch.Tensor, dim: int):
        super().__init__()
        size = basis.shape[0]
        self.module, self.dim = module, dim
        self.encode, self.decode = nn.Linear(size, size, bias=False), nn.Linear(size, size, bias=False)
        with torch.no_grad():
            self.encode.weight.copy_(basis.float())
            self.decode.weight.copy_(basis.T.float())

    def forward(self, *args):
        features = self.module(*args).movedim(self.dim, -1)
        return self.decode(self.encode(features)).movedim(-1, self.dim)


def vit_with_directions():
    model = small_vit()
    basis = random_basis(16, seed=5)
    virtual = small_vit()
    virtual.blocks[0] = VirtualInspection(virtual.blocks[0], basis, dim=-1)
    return model, "blocks.0", virtual, "blocks.0.encode", basis, 2, "attnlrp", {}


def cnn_head_with_directions():
    """A CNN whose concept layer is a hidden fully connected layer (N, 8), before its ReLU. The virtual layer is LRP-0
    in the paper's construction: here the ε rule with ε = 1e-12 in float64 (ε = 1e-6 would shift units with
    activations ~1e-4 by 1 %). At a unit whose activation is 0 LRP-0's share is 0 / 0, and the virtual layer's
    reconstruction Uᵀ U a leaves rounding there instead of 0: a layer whose units are never exactly 0 is tested."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                          nn.Linear(24, 8), nn.ReLU(), nn.Linear(8, 4)).eval().double()
    basis = random_basis(8, seed=6)
    virtual = nn.Sequential(*copy.deepcopy(model)[:4], VirtualInspection(copy.deepcopy(model[4]), basis, dim=1),
                            *copy.deepcopy(model)[5:]).eval().double()
    return model, "4", virtual, "4.encode", basis, 1, "lrp", {"composite": "epsilon_plus", "epsilon": 1e-12}


DIRECTION_CASES = {"vit-attnlrp": vit_with_directions, "cnn-lrp": cnn_head_with_directions}


@pytest.mark.parametrize("case", sorted(DIRECTION_CASES))
def test_a_directions_map_is_the_virtual_inspection_layers_channel_masked_by_hand(case):
    """Directions (K, C) as concepts: each map equals the relevance through a virtual inspection layer h = U a,
    a = Uᵀ h inserted after the layer, with the relevance at h masked to the direction's unit by hand; R_k equals the
    relevance h_k receives there."""
    model, layer, virtual, encode, basis, dim, method, options = DIRECTION_CASES[case]()
    size = 32 if case.startswith("vit") else 8
    x = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(9))
    before = model_state(model)
    chosen = basis[:5]
    e = explain.ConceptRelevance(model, layer, method, directions=chosen, **options).explain(x, concepts=3)
    assert_state_equal(before, model_state(model))
    at_h = explain.ConceptRelevance(virtual, encode, method, channel_dim=dim, **options).explain(x, concepts=1)
    torch.testing.assert_close(e.diagnostics["layer_relevance"], at_h.diagnostics["layer_relevance"][:, :5],
                               atol=1e-5 * float(at_h.diagnostics["layer_relevance"].abs().max()), rtol=1e-4)
    assert torch.equal(e.diagnostics["explained_class"], at_h.diagnostics["explained_class"])
    assert_each_map_masked_by_hand(e, virtual, encode, method, options, x, dim, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("case", sorted(DIRECTION_CASES))
def test_the_maps_of_a_complete_basis_of_directions_sum_to_the_unconditional_map(case):
    model, layer, _, _, basis, _, method, options = DIRECTION_CASES[case]()
    size = 32 if case.startswith("vit") else 8
    x = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(10))
    assert_complete_basis_conserves(model, layer, method, options, x, basis)


def test_the_identity_basis_is_the_channels_and_bad_directions_are_refused():
    model = small_cnn()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(11))
    channels = explain.ConceptRelevance(model, "4", composite="epsilon_plus").explain(x, concepts=3)
    identity = explain.ConceptRelevance(model, "4", composite="epsilon_plus", directions=torch.eye(6)).explain(
        x, concepts=3)
    assert torch.equal(identity.class_indices, channels.class_indices)
    torch.testing.assert_close(identity.attributions, channels.attributions, atol=1e-7, rtol=1e-5)
    before = model_state(model)
    with pytest.raises(ValueError, match="orthonormal"):
        explain.ConceptRelevance(model, "4", composite="epsilon_plus", directions=torch.ones(2, 6))
    with pytest.raises(ValueError, match="1 ≤ K ≤ C"):
        explain.ConceptRelevance(model, "4", composite="epsilon_plus", directions=torch.eye(7, 6))
    with pytest.raises(TypeError, match="6 channels"):  # LayerOutputError, through the model call unchanged
        explain.ConceptRelevance(model, "4", composite="epsilon_plus", directions=torch.eye(5)).explain(x)
    with pytest.raises(ValueError, match="0 … 1"):
        explain.ConceptRelevance(model, "4", composite="epsilon_plus", directions=torch.eye(6)[:2]).explain(
            x, concepts=[3])
    assert_state_equal(before, model_state(model))
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    one = torch.randn(6, generator=torch.Generator().manual_seed(12))  # a single direction, e.g. a CAV
    single = explain.ConceptRelevance(model, "4", composite="epsilon_plus", directions=one / one.norm()).explain(
        x, concepts=1)
    assert single.class_indices.tolist() == [[0], [0]]


def test_principal_directions_are_the_svd_of_the_centred_token_features_and_serve_as_concepts():
    """principal_directions: the right singular vectors of the centred (images × tokens, D) features of the layer,
    by hand with numpy; used as CRP directions on a ViT block, their maps are conditional maps like any other."""
    import numpy as np

    from explain.methods.concepts import principal_directions

    model = small_vit()
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(13))
    before = model_state(model)
    directions = principal_directions(model, "blocks.1", x, count=4)
    assert_state_equal(before, model_state(model))
    seen = {}
    handle = model.blocks[1].register_forward_hook(lambda _m, _a, output: seen.update(out=output.detach()))
    with torch.no_grad():
        model(x)
    handle.remove()
    features = seen["out"].reshape(-1, 16).double().numpy()
    _, _, right = np.linalg.svd(features - features.mean(axis=0), full_matrices=False)
    for k in range(4):  # equal up to the sign, which is fixed so that the mean feature projects positively
        expected = right[k] * (1 if features.mean(axis=0) @ right[k] >= 0 else -1)
        np.testing.assert_allclose(directions[k].numpy(), expected, atol=1e-6)
    torch.testing.assert_close(directions @ directions.T, torch.eye(4, dtype=torch.float64), atol=1e-10, rtol=0)
    e = explain.ConceptRelevance(model, "blocks.1", "attnlrp", directions=directions).explain(x, concepts=2)
    assert e.class_indices.shape == (3, 2) and bool((e.scores[:, 0] >= e.scores[:, 1]).all())
    with pytest.raises(ValueError, match="count must be 1 to 16"):
        principal_directions(model, "blocks.1", x, count=17)


@pytest.mark.parametrize("interrupted_call", [1, 2, 3])
def test_ctrl_c_mid_call_leaves_the_model_as_found_and_the_next_call_unchanged(interrupted_call):
    """KeyboardInterrupt in the model's forward during CRP's unconditional pass (1) or a conditional pass (2, 3;
    batch_size 2, so three passes in all), and in the relevance references' passes: the model is left as found
    (hooks, modes, flags, tensors) and the next call gives the maps of an uninterrupted one."""
    from explain.methods.concepts import concept_references

    model = small_cnn()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(14))
    crp = explain.ConceptRelevance(model, "4", composite="epsilon_plus", batch_size=2)
    expected = crp.explain(x, concepts=2)
    calls = [0]

    def interrupt(_module, _args, _output):
        calls[0] += 1
        if calls[0] == interrupted_call:
            raise KeyboardInterrupt

    handle = model[6].register_forward_hook(interrupt)
    before = model_state(model)
    try:
        with pytest.raises(KeyboardInterrupt):
            crp.explain(x, concepts=2)
        assert_state_equal(before, model_state(model))
        calls[0] = 0
        with pytest.raises(KeyboardInterrupt):
            concept_references(crp, list(x), concepts=[0, 1], top=1)
        assert_state_equal(before, model_state(model))
    finally:
        handle.remove()
    torch.testing.assert_close(crp.explain(x, concepts=2).attributions, expected.attributions)


def test_relevance_around_a_layer_in_a_residual_branch_is_given_and_warned_of():
    """A layer inside a residual branch: with every concept masked, relevance still reaches the input through the
    skip connection. diagnostics["bypass_map"] is that relevance (LRP with the layer's relevance zeroed by hand);
    each conditional map includes it once, so Σ_c (map_c − bypass) + bypass is the unconditional map; a warning says
    so. After the sum (every path goes through ``merge``) the bypass is 0 and nothing is warned."""
    import warnings

    model = ResidualNet().eval()
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(15))
    options = {"composite": "epsilon_plus"}
    crp = explain.ConceptRelevance(model, "branch.0", **options)
    with pytest.warns(RuntimeWarning, match="branch.0 does not carry all the relevance") as caught:
        e = crp.explain(x, concepts=None)
    assert [warning.filename for warning in caught] == [__file__]  # the caller's line
    classes = e.diagnostics["explained_class"]
    for image in range(2):
        expected = masked_by_hand(model, "branch.0", "lrp", options, x[image], int(classes[image]), -1, 1)
        assert float(expected.abs().max()) > 0
        by_hand_map = expected.abs().sum(dim=0)  # LRP's default reduction of (C, H, W): sum of |R| over channels
        torch.testing.assert_close(e.diagnostics["bypass_map"][image], by_hand_map, atol=1e-6, rtol=1e-5)
    unconditional = explain.LRP(model, **options).explain(x, target=classes.tolist())
    bypass = torch.stack([masked_by_hand(model, "branch.0", "lrp", options, x[image], int(classes[image]), -1, 1)
                          for image in range(2)])
    total = (e.attributions - bypass[:, None]).sum(dim=1) + bypass
    scale = float(unconditional.attributions.abs().max())
    torch.testing.assert_close(total / scale, unconditional.attributions[:, 0] / scale, atol=1e-5, rtol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = explain.ConceptRelevance(model, "merge", **options).explain(x, concepts=2)
    assert float(after.diagnostics["bypass_map"].abs().max()) == 0.0
