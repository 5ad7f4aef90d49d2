"""Transformer attribution (explain.TransformerAttribution, Chefer, Gur & Wolf 2021a) against

1. the method worked out by hand on a tiny transformer: per block the relevance of the attention probabilities R_A
   propagated in relevance space (tests/test_attnlrp.py), divided by the score, ∇A by autograd, and the rollout
   R ← R + E_heads[(∇A ⊙ R_A)⁺] R written as loops;
2. the model families (timm, torchvision, HuggingFace; ViT, DeiT, DINOv2 with registers, CLIP, SigLIP): a batch
   equals its images alone, fused and eager attention agree; Swin's window attention gets a map where the rollouts
   refuse it (its maps against whole matrices: tests/test_swin_windows.py);
3. a model whose forward differs between the two passes the method makes.
(The caller's contexts, threads and the model's state: tests/test_attnlrp.py, for both methods.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_attnlrp import FAMILIES, FUSED_AND_EAGER, TinyViT, clip_with_prompts, relevance_by_hand, timm_vit, tiny_vit
from torch import Tensor, nn

import explain


def by_hand(model: TinyViT, image: Tensor, target: int, start_block: int = 0) -> Tensor:
    """The (grid, grid) map of one image, by Chefer et al.'s recipe written out."""
    stash: list[Tensor] = []
    for block in model.blocks:
        block.attn.stash = stash
    try:
        score = model(image[None])[0, target]
        score.backward()
    finally:
        for block in model.blocks:
            block.attn.stash = None
    model.zero_grad(set_to_none=True)
    relevance = relevance_by_hand(model, image, target)
    lrp_score, attention_relevance = relevance.score, relevance.attention
    assert abs(lrp_score - score.item()) <= 1e-9 * abs(score.item())
    tokens = stash[0].shape[-1]
    rollout = [[float(i == j) for j in range(tokens)] for i in range(tokens)]
    for attention, relevance in list(zip(stash, attention_relevance))[start_block:]:
        gradient, heads = attention.grad[0].tolist(), len(relevance)
        unit = abs(lrp_score)  # relevance of size 1 at the score (a negative score's signs not flipped)
        weighted = [[sum(max(0.0, gradient[h][i][j] * relevance[h][i][j] / unit) for h in range(heads)) / heads
                     for j in range(tokens)] for i in range(tokens)]
        rollout = [[rollout[i][j] + sum(weighted[i][m] * rollout[m][j] for m in range(tokens))
                    for j in range(tokens)] for i in range(tokens)]
    prefix = 1 if model.cls_token is not None else 0
    if prefix:  # the head reads the class token: its row
        row = rollout[0][prefix:]
    else:  # the head reads the mean of the tokens: the mean of their rows
        row = [sum(rollout[i][j] for i in range(tokens)) / tokens for j in range(tokens)]
    return torch.tensor(row, dtype=torch.float64).reshape(model.grid, model.grid)


@pytest.mark.parametrize("start_block", [0, 1])
@pytest.mark.parametrize("options", [{}, {"class_token": False, "positions": False}], ids=["class-token", "mean"])
def test_maps_equal_the_method_worked_out_by_hand(options, start_block):
    model = tiny_vit(**options)
    torch.manual_seed(1)
    x, targets = torch.randn(3, 3, 12, 12, dtype=torch.float64), [2, 0, 1]
    explanation = explain.TransformerAttribution(model, start_block=start_block).explain(x, target=targets)
    assert explanation.diagnostics["attention_blocks"] == [f"blocks.{b}.attn" for b in range(start_block, 2)]
    maps = explanation.low_res_maps[0]  # (N, K, h, w): the row of the rollout on the patch grid
    for n, target in enumerate(targets):
        expected = by_hand(model, x[n], target, start_block)
        assert expected.abs().amax() > 0
        torch.testing.assert_close(maps[n, 0].double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().amax().item())


NOT_WINDOWED = [name for name, family in FAMILIES.items() if not family.windows]
BLOCKS = {"hf-siglip-vision": "encoder"}  # not the attention-pooling head, whose query is learned


@pytest.mark.parametrize("name", NOT_WINDOWED)
def test_every_family_a_batch_equals_its_images_alone(name):
    family = FAMILIES[name]
    model = family.model()
    x, targets, alone = family.inputs(model)
    explainer = explain.TransformerAttribution(model, output=family.output, blocks=BLOCKS.get(name))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # e.g. a zero map
        together = explainer.explain(x, target=targets)
    assert len(together.diagnostics["attention_blocks"]) == 2
    maps = together.low_res_maps[0]
    for i in range(len(x)):
        single = explainer.explain(x[i : i + 1], target=alone(i)).low_res_maps[0]
        torch.testing.assert_close(maps[i], single[0], rtol=1e-6, atol=1e-9 * single.abs().amax().item())


def test_a_clip_model_scoring_images_against_prompts_a_batch_equals_its_images_alone():
    clip, pixels, call, inputs = clip_with_prompts()
    explainer = explain.TransformerAttribution(clip, blocks="vision_model", **call)
    together = explainer.explain(pixels, target=[[0, 1, 2], [2, 0, 1]], **inputs)
    assert together.diagnostics["attention_blocks"] == [f"vision_model.encoder.layers.{i}.self_attn" for i in (0, 1)]
    for i, targets in enumerate([[0, 1, 2], [2, 0, 1]]):
        alone = explainer.explain(pixels[i : i + 1], target=[targets], **inputs).low_res_maps[0]
        torch.testing.assert_close(together.low_res_maps[0][i], alone[0], rtol=1e-6, atol=1e-12)


def test_siglips_attention_pooling_head_is_refused_unless_the_blocks_are_chosen():
    family = FAMILIES["hf-siglip-vision"]
    model = family.model()
    x, targets, _ = family.inputs(model)
    with pytest.raises(ValueError, match=r"not self-attention over the same tokens.*choose the image's blocks"):
        explain.TransformerAttribution(model, output=family.output).explain(x, target=targets)


@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.windows])
def test_swin_gets_a_map_where_the_rollouts_refuse_its_window_attention(name):
    """Window attention is laid out on each stage's grid (tests/test_swin_windows.py checks the maps against whole
    matrices); the rollouts keep their error, which names the methods that read windows."""
    family = FAMILIES[name]
    model = family.model(torch.float32)
    x, targets, _ = family.inputs(model, dtype=torch.float32)
    explanation = explain.TransformerAttribution(model, output=family.output).explain(x, target=targets)
    assert explanation.low_res_maps[0].shape == (3, 1, 8, 8)  # the first stage's grid: 32 px in patches of 4
    assert len(explanation.diagnostics["attention_blocks"]) == 4
    messages = []
    for cls in (explain.GradientAttentionRollout, explain.AttentionRollout):
        with pytest.raises(ValueError, match=r"looks like window attention.*TransformerAttribution, AttnLRP or LeGrad"
                           ) as error:
            cls(model, output=family.output).explain(x, target=targets)
        messages.append(str(error.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("library", FUSED_AND_EAGER)
def test_fused_and_eager_attention_give_the_same_maps(library):
    """The relevance pass records the attention step by step inside a fused call: A's gradient must include A·V's
    uniform split, as it does when the model computes the products itself (else R_A doubles)."""
    *builders, output = FUSED_AND_EAGER[library]
    torch.manual_seed(1)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    explanations = [explain.TransformerAttribution(build().double().eval(), output=output).explain(x, target=[0, 3, 1])
                    for build in builders]
    assert explanations[0].diagnostics["attention_blocks"] == explanations[1].diagnostics["attention_blocks"]
    maps = [explanation.low_res_maps[0] for explanation in explanations]
    torch.testing.assert_close(maps[0], maps[1], rtol=1e-6, atol=1e-9 * maps[1].abs().amax().item())


def test_under_bf16_autocast_the_maps_are_float32_and_close_to_float32():
    model = timm_vit().eval()
    torch.manual_seed(1)
    x = torch.randn(3, 3, 32, 32)
    reference = explain.TransformerAttribution(model).explain(x, target=[0, 3, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = explain.TransformerAttribution(model).explain(x, target=[0, 3, 1])
    assert mixed.maps.dtype == torch.float32 and torch.isfinite(mixed.maps).all()
    assert torch.corrcoef(torch.stack([mixed.maps.flatten(), reference.maps.flatten()]))[0, 1] > 0.99


class Flaky(nn.Module):
    """Runs its second block on every other call only: the two passes of one explanation see different blocks."""

    def __init__(self):
        super().__init__()
        self.vit = tiny_vit().float()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        blocks = self.vit.blocks
        self.vit.blocks = blocks if self.calls % 2 else blocks[:1]
        try:
            return self.vit(x)
        finally:
            self.vit.blocks = blocks


def test_a_forward_that_differs_between_the_two_passes_is_an_error_saying_so():
    with pytest.raises(RuntimeError, match=r"the model's forward differs between two calls on the same input"):
        explain.TransformerAttribution(Flaky()).explain(torch.randn(2, 3, 12, 12), target=[0, 1])
