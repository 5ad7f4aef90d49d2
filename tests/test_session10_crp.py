"""CRP (ConceptRelevance, glocal_figure) attacked on transformer layers and with mismatched references (session 10)."""

from __future__ import annotations

import matplotlib
import pytest
import torch
from torch import nn

import explain
from explain.core.capture import ModelInputError
from explain.methods.concepts import concept_references, glocal_figure

matplotlib.use("Agg")


def _state(model: nn.Module) -> tuple[bool, list[bool], int]:
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    return model.training, [p.requires_grad for p in model.parameters()], hooks


def _tiny_hf_vit() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, num_labels=3)
    return transformers.ViTForImageClassification(config).eval()


def test_a_hugging_face_attention_returning_a_tuple_is_refused_naming_the_modules_inside_it_not_the_input():
    """HEAD: the refusal raised inside the forward came back as ModelInputError "the model failed on an input of shape
    … pass a preprocess that produces it", blaming the image. The module it names instead gives each concept's map as
    AttnLRP with that layer's relevance masked by hand."""
    model = _tiny_hf_vit()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    before = _state(model)
    crp = explain.ConceptRelevance(model, "vit.layers.0.attention", "attnlrp")
    with pytest.raises(ValueError, match="returns tuple, not a tensor of features.*inside it: .*o_proj") as raised:
        crp.explain(x, concepts=2)
    assert not isinstance(raised.value, ModelInputError) and "failed on an input" not in str(raised.value)
    assert _state(model) == before

    inside = explain.ConceptRelevance(model, "vit.layers.0.attention.o_proj", "attnlrp")
    e = inside.explain(x, target=[0, 2], concepts=[5], bypass=False)
    layer = dict(model.named_modules())["vit.layers.0.attention.o_proj"]
    mask = torch.zeros(16)
    mask[5] = 1

    def masked(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
        if output.requires_grad:  # AttnLRP carries gradients here: R = a ⊙ g, so masking g masks R
            output.register_hook(lambda gradient: gradient * mask)

    handle = layer.register_forward_hook(masked)
    try:
        by_hand = inside.explainer.explain(x, target=[0, 2]).attributions[:, 0]
    finally:
        handle.remove()
    torch.testing.assert_close(e.attributions[:, 0], by_hand, rtol=1e-5, atol=1e-7)
    assert float(by_hand.abs().max()) > 0
    assert _state(model) == before


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3)).eval()


def test_the_glocal_figure_refuses_references_of_another_layer():
    """HEAD: references of layer 0 were drawn as the patches of layer 2's channels of the same index (another
    feature), without a word."""
    model = _small_cnn()
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    e = explain.ConceptRelevance(model, "2").explain(x, concepts=[1, 4])
    other = concept_references(explain.ConceptRelevance(model, "0"), x, concepts=[1, 4], top=2)
    with pytest.raises(ValueError, match="references are of layer 0 but the explanation's concepts are of layer 2"):
        glocal_figure(e, other)
    same = concept_references(explain.ConceptRelevance(model, "2"), x, concepts=[1, 4], top=2)
    figure = glocal_figure(e, same, patches=2)
    drawn = [len(axis.images) for axis in figure.axes]
    assert drawn == [1, 2, 1, 1] * 2  # image, image + heatmap, two patches per row
    matplotlib.pyplot.close(figure)


def test_a_glocal_row_whose_concept_has_no_references_says_so():
    """HEAD: a concept missing from the references got a blank row, which reads as patches not drawn."""
    model = _small_cnn()
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    crp = explain.ConceptRelevance(model, "2")
    e = crp.explain(x, concepts=[1, 4])
    references = concept_references(crp, x, concepts=[4], top=2)
    figure = glocal_figure(e, references, patches=2)
    texts = [[text.get_text() for text in axis.texts] for axis in figure.axes]
    assert texts[2] == ["no references"]  # row 0 (concept 1), first patch column
    assert all(not row for index, row in enumerate(texts) if index != 2)
    assert [len(axis.images) for axis in figure.axes[4:]] == [1, 2, 1, 1]  # concept 4's row has its patches
    matplotlib.pyplot.close(figure)
