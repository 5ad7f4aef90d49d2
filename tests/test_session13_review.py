"""Session 13, review: what the helpers' reports pointed at outside their files."""

from __future__ import annotations

import warnings

import pytest
import torch
from torchvision.models import resnet18

import explain
from explain.methods.concepts import relevance_method_for


def test_the_cam_base_class_is_refused_naming_the_cam_method_and_leaves_the_model_as_found():
    """Before, ``explain.CAM(model)`` (a user after Zhou et al.'s CAM) was built, and its call failed with "CAM
    defines neither channel_terms, layer_map nor layer_maps"."""
    model = resnet18(num_classes=3).train()
    flags = [parameter.requires_grad for parameter in model.parameters()]
    with pytest.raises(TypeError, match=r"explain\.CAM is the base class .* use explain\.ClassActivationMapping"):
        explain.CAM(model, "layer4")
    assert model.training and flags == [parameter.requires_grad for parameter in model.parameters()]
    assert not any(module._forward_hooks or module._backward_hooks for module in model.modules())


def tiny_vit():
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32, patch_size=8,
                             depth=2).eval()


def test_concept_relevance_of_a_transformer_uses_attnlrp_unless_told_and_its_concepts_add_up_to_attnlrps_map():
    """Before, the default was LRP on every model: on a ViT, LRP has no rule for its layer norms and attention, so
    the conditional maps were not LRP (a warning said so) and summed to a map 1e23 away from AttnLRP's. Now "auto"
    picks AttnLRP for a model with layer norms or attention, LRP for a CNN."""
    vit = tiny_vit()
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "LRP has no rule for layer_norm" warning
        crp = explain.ConceptRelevance(vit, "blocks.1")
        every = crp.explain(image, target=1, concepts=None)
    assert isinstance(crp.explainer, explain.AttnLRP)
    unconditional = explain.AttnLRP(vit).explain(image, target=1).attributions[:, 0]
    largest = float(unconditional.abs().max())
    torch.testing.assert_close(every.attributions.sum(dim=1), unconditional, rtol=0, atol=1e-5 * largest)
    told = explain.ConceptRelevance(vit, "blocks.1", "attnlrp").explain(image, target=1, concepts=3)
    torch.testing.assert_close(every.attributions[:, told.class_indices[0]], told.attributions)
    assert relevance_method_for(resnet18(num_classes=3)) == "lrp"
    assert isinstance(explain.ConceptRelevance(resnet18(num_classes=3), "layer3").explainer, explain.LRP)
    with pytest.warns(RuntimeWarning, match="no rule for"):  # told LRP, it is LRP, and still says what it lacks
        explain.ConceptRelevance(vit, "blocks.1", "lrp").explain(image, target=1, concepts=2)


def test_a_resume_says_which_images_of_its_index_are_no_longer_in_the_folder_and_keeps_them(tmp_path, monkeypatch):
    """Before, a resume after an image was removed from the folder said "2 already done" and nothing else, while
    the index, the report and the strategies kept showing 3 images."""
    from PIL import Image

    from explain.cli import main
    from explain.data import make_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for number, image in enumerate(make_dataset(3, seed=1).images):
        Image.fromarray(image).save(tmp_path / "data" / f"{number}.png")
    arguments = ["batch", "data", "--model", "demo", "--out", "out", "--no-progress", "--workers", "0"]
    assert main(arguments) == 0
    rows = (tmp_path / "out" / "index.csv").read_bytes()
    (tmp_path / "data" / "1.png").unlink()
    with pytest.warns(UserWarning, match=r"1 image\(s\) of out/index.csv are no longer in data \(e\.g\. data/1\.png\): "
                                         r"their rows and maps are kept"):
        assert main(arguments) == 0
    assert (tmp_path / "out" / "index.csv").read_bytes() == rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next resume says it again, and nothing else
        with pytest.raises(UserWarning, match=r"1 image\(s\) of out/index.csv are no longer in data"):
            main(arguments)
