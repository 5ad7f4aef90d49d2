"""Transformer attribution (explain.TransformerAttribution, Chefer, Gur & Wolf 2021a) against

1. the method computed here from the paper's equations, on random-weight timm ViTs of several depths: the forward
   pass redone from the weights, the relevance of every layer by the authors' rules (eqs. 1-2 with α = 1, β = 0 for
   linear layers without their bias; eqs. 4-6, the normalised rule, for the residual sums; for the two products of
   attention, eq. 6 gives each operand half of its LRP-0 share, as their code's ``/= 2`` does; the identity for
   softmax, GELU and LayerNorm), ∇A by autograd, and the rollout Ā_b = E_h[(∇A_b ⊙ R_Ab)⁺], (I + Ā_B)⋯(I + Ā_s)
   multiplied as their code does (later blocks on the left), read at the class token's row;
2. its variant AttnLRPRollout (AttnLRP's relevance of the attention, rolled out the same way) worked out by hand on a
   tiny transformer, in Python floats;
3. the model families (timm, torchvision, HuggingFace; ViT, DeiT, DINOv2 with registers, CLIP, SigLIP): a batch
   equals its images alone (also where the images must be propagated one at a time), fused and eager attention
   agree; Swin's window attention gets a map where the rollouts refuse it (its maps against whole matrices:
   tests/test_swin_windows.py);
4. a model whose forward differs between the two passes the method makes.
(The caller's contexts, threads and the model's state: tests/test_attnlrp.py, for both methods. The authors' own
code, hila-chefer/Transformer-Explainability, run outside the repository on timm ViTs with 3 and 5 blocks, gives
maps that correlate with these at 1.000000 per image in float64, the largest difference 2e-4 of a map's maximum,
1e-15 once their ε in two pass-through rules is removed: benchmarks/RESULTS.md, "Transformer attribution against the
authors' code".)
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_attnlrp import FAMILIES, FUSED_AND_EAGER, TinyViT, clip_with_prompts, relevance_by_hand, timm_vit, tiny_vit
from torch import Tensor, nn

import explain

timm = pytest.importorskip("timm")


# ------------------------------------------------------------------ 1. the method from the paper's equations


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """The authors' division: numerator / (denominator + 1e-9), 0 where the denominator is 0."""
    return numerator / (denominator + 1e-9) * (denominator != 0)


def alpha1beta0(x: Tensor, weight: Tensor, relevance: Tensor) -> Tensor:
    """Eq. 2 with α = 1, β = 0: R_i = Σ_j (x_i w_ji)⁺ / Σ_i' (x_i' w_ji')⁺ · R_j, for rows x (T, in), weight
    (out, in), relevance (T, out); the bias takes no share."""
    contributions = (x[:, None, :] * weight[None, :, :]).clamp(min=0)  # (T, out, in): (x_i w_ji)⁺
    return (contributions * safe_divide(relevance, contributions.sum(dim=2))[:, :, None]).sum(dim=1)


def normalised_sum(a: Tensor, b: Tensor, relevance: Tensor) -> tuple[Tensor, Tensor]:
    """Eqs. 4-6 for u + v: LRP-0 shares R^u = u ⊙ R / (u + v), each rescaled to Σ R · |Σ R^u| / (|Σ R^u| + |Σ R^v|)."""
    shares = [a * safe_divide(relevance, a + b), b * safe_divide(relevance, a + b)]
    totals = [share.sum() for share in shares]
    magnitude = totals[0].abs() + totals[1].abs()
    return tuple(share * safe_divide(safe_divide(total.abs(), magnitude) * relevance.sum(), total)  # type: ignore
                 for share, total in zip(shares, totals))


def chefer_by_hand(model: nn.Module, image: Tensor, target: int, start_block: int = 0) -> Tensor:
    """The (grid, grid) map of one image for a timm ViT (class token, pre-norm blocks, GELU MLP, the head on the
    class token), from the weights and the paper's equations; ∇A by autograd of the forward written here."""
    patch = model.patch_embed.proj
    tokens = patch(image[None]).flatten(2).transpose(1, 2)[0]
    x = torch.cat([model.cls_token[0], tokens]) + model.pos_embed[0]
    saved = []
    for block in model.blocks:
        attn = block.attn
        heads, count, dim = attn.num_heads, x.shape[0], x.shape[1]
        n1 = F.layer_norm(x, (dim,), block.norm1.weight, block.norm1.bias, block.norm1.eps)
        qkv = F.linear(n1, attn.qkv.weight, attn.qkv.bias)
        q, k, v = qkv.reshape(count, 3, heads, dim // heads).permute(1, 2, 0, 3)  # (heads, T, d) each
        products = q @ k.transpose(-2, -1)
        attention = (products * attn.scale).softmax(dim=-1)
        attention.retain_grad()
        o_heads = attention @ v
        o = o_heads.transpose(0, 1).reshape(count, dim)
        p = F.linear(o, attn.proj.weight, attn.proj.bias)
        h = x + p
        n2 = F.layer_norm(h, (dim,), block.norm2.weight, block.norm2.bias, block.norm2.eps)
        u = F.linear(n2, block.mlp.fc1.weight, block.mlp.fc1.bias)
        g = F.gelu(u)
        m = F.linear(g, block.mlp.fc2.weight, block.mlp.fc2.bias)
        saved.append(dict(x=x, n1=n1, q=q, k=k, v=v, products=products, attention=attention, o_heads=o_heads, o=o,
                          p=p, h=h, n2=n2, g=g, m=m))
        x = h + m
    normed = F.layer_norm(x, (x.shape[1],), model.norm.weight, model.norm.bias, model.norm.eps)
    logits = F.linear(normed[0], model.head.weight, model.head.bias)
    torch.testing.assert_close(logits, model(image[None])[0], rtol=1e-9, atol=1e-12)  # the forward, redone
    logits[target].backward()
    with torch.no_grad():
        relevance_logits = torch.zeros_like(logits)
        relevance_logits[target] = 1.0  # their one-hot vector
        relevance = torch.zeros_like(x)
        relevance[0] = alpha1beta0(normed[:1], model.head.weight, relevance_logits[None])[0]  # the class token
        # the final LayerNorm: the identity
        attention_relevance = []
        for block, values in reversed(list(zip(model.blocks, saved))):
            attn = block.attn
            relevance_h, relevance_m = normalised_sum(values["h"], values["m"], relevance)
            relevance_g = alpha1beta0(values["g"], block.mlp.fc2.weight, relevance_m)
            relevance_n2 = alpha1beta0(values["n2"], block.mlp.fc1.weight, relevance_g)  # GELU: the identity
            relevance_h = relevance_h + relevance_n2  # LayerNorm: the identity; h used twice: the two summed
            relevance_x, relevance_p = normalised_sum(values["x"], values["p"], relevance_h)
            relevance_o = alpha1beta0(values["o"], attn.proj.weight, relevance_p)
            heads, count = values["q"].shape[0], values["x"].shape[0]
            relevance_o_heads = relevance_o.reshape(count, heads, -1).transpose(0, 1)
            a, v, o_heads = values["attention"], values["v"], values["o_heads"]
            ratio = safe_divide(relevance_o_heads, o_heads)  # O = A·V: each operand half its LRP-0 share
            relevance_a = a * (ratio @ v.transpose(-2, -1)) / 2
            relevance_v = v * (a.transpose(-2, -1) @ ratio) / 2
            attention_relevance.insert(0, relevance_a)
            q, k, products = values["q"], values["k"], values["products"]
            ratio = safe_divide(relevance_a, products)  # softmax, scale: the identity; QKᵀ: halves again
            relevance_q, relevance_k = q * (ratio @ k) / 2, k * (ratio.transpose(-2, -1) @ q) / 2
            relevance_qkv = torch.stack([relevance_q, relevance_k, relevance_v]).permute(2, 0, 1, 3).reshape(count, -1)
            relevance = relevance_x + alpha1beta0(values["n1"], attn.qkv.weight, relevance_qkv)
        rollout = None
        for values, relevance_a in list(zip(saved, attention_relevance))[start_block:]:
            weighted = (values["attention"].grad * relevance_a).clamp(min=0).mean(dim=0)
            step = torch.eye(weighted.shape[0], dtype=weighted.dtype) + weighted
            rollout = step if rollout is None else step @ rollout  # later blocks on the left, as their code
    grid = model.patch_embed.grid_size
    return rollout[0, 1:].reshape(grid)


def realistic(model: nn.Module, seed: int) -> nn.Module:
    """Weights of a trained network's scale (timm's initialisation is near zero): N(0, 1/fan-in) matrices, norm
    weights in [0.5, 1.5], N(0, 0.1) biases, class token and positions."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 and "embed" not in name and "token" not in name:
                parameter.normal_(0, parameter[0].numel() ** -0.5, generator=generator)
            elif "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5, generator=generator)
            else:
                parameter.normal_(0, 0.1 if parameter.dim() < 2 else 0.5, generator=generator)
    return model


def chefer_vit(depth: int, fused: bool = True, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=depth,
                              num_heads=2, embed_dim=16, mlp_ratio=2, num_classes=5)
    for block in model.blocks:
        block.attn.fused_attn = fused
    return realistic(model, seed).double().eval()


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_maps_equal_the_method_computed_from_the_papers_equations_on_timm_vits(depth):
    model = chefer_vit(depth, seed=depth)
    torch.manual_seed(depth)
    x, targets = torch.randn(3, 3, 32, 32, dtype=torch.float64), [2, 0, 4]
    explanation = explain.TransformerAttribution(model).explain(x, target=targets)
    assert explanation.diagnostics["attention_blocks"] == [f"blocks.{b}.attn" for b in range(depth)]
    maps = explanation.low_res_maps[0]  # (N, K, h, w): the row of the rollout on the patch grid
    for n, target in enumerate(targets):
        expected = chefer_by_hand(model, x[n], target)
        assert expected.abs().amax() > 0
        torch.testing.assert_close(maps[n, 0].double(), expected, rtol=1e-6, atol=1e-9 * expected.abs().amax().item())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_start_block_and_a_class_scored_below_zero_follow_the_equations(fused):
    """start_block=s rolls out blocks s… only; the relevance starts at 1 whatever the score's sign (their one-hot
    vector), so a class the model scores below zero gets the same kind of map as one scored above."""
    model = chefer_vit(3, fused=fused, seed=11)
    torch.manual_seed(11)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    logits = model(x)
    lowest = logits.argmin(dim=1).tolist()
    assert (logits.amin(dim=1) < 0).all()
    explanation = explain.TransformerAttribution(model, start_block=1).explain(x, target=lowest)
    for n, target in enumerate(lowest):
        expected = chefer_by_hand(model, x[n], target, start_block=1)
        assert expected.amax() > 0
        torch.testing.assert_close(explanation.low_res_maps[0][n, 0].double(), expected, rtol=1e-6,
                                   atol=1e-9 * expected.abs().amax().item())


class SequenceFirst(nn.Module):
    """A transformer whose tokens are laid out (T, N, E), as nn.TransformerEncoderLayer(batch_first=False) takes
    them: a sum's images are not along its first dimension, so the method propagates each image alone."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Conv2d(3, 16, 8, stride=8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 16))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False,
                                                               norm_first=True) for _ in range(2))
        self.head = nn.Linear(16, 5)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(x).flatten(2).permute(2, 0, 1)  # (T, N, E)
        tokens = torch.cat([self.cls_token.expand(1, x.shape[0], -1), tokens])
        for block in self.blocks:
            tokens = block(tokens)
        return self.head(tokens[0])


def test_a_sequence_first_model_is_explained_one_image_at_a_time_and_a_batch_equals_its_images_alone():
    model = SequenceFirst().double().eval()
    torch.manual_seed(2)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)  # 17 tokens, 4 images: (17, 4, 16) sums
    explainer = explain.TransformerAttribution(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every call between the attention and the output ruled
        together = explainer.explain(x, target=[0, 1, 2, 3]).low_res_maps[0]
    for i in range(4):
        alone = explainer.explain(x[i : i + 1], target=i).low_res_maps[0]
        torch.testing.assert_close(together[i], alone[0], rtol=1e-9, atol=1e-12)
    assert together.abs().amax() > 0


class Unruled(nn.Module):
    """A ViT whose head reads the class token through ``torch.special.expit``, which no rule names."""

    def __init__(self):
        super().__init__()
        self.vit = chefer_vit(2)

    def forward(self, x: Tensor) -> Tensor:
        features = self.vit.forward_features(x)
        return self.vit.head(torch.special.expit(features[:, 0]))


def test_a_call_without_a_rule_after_the_attention_is_named_in_a_warning():
    with pytest.warns(RuntimeWarning, match=r"no rule of Chefer et al\. for model: special_expit between the atten"
                      ) as caught:
        explain.TransformerAttribution(Unruled()).explain(torch.randn(1, 3, 32, 32, dtype=torch.float64), target=0)
    assert caught[0].filename == __file__  # the caller's line


# ------------------------------------------------------------------ 2. the AttnLRP variant, by hand


def attnlrp_rollout_by_hand(model: TinyViT, image: Tensor, target: int, start_block: int = 0) -> Tensor:
    """The (grid, grid) map of one image for AttnLRPRollout: Chefer et al.'s rollout with AttnLRP's R_A."""
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
def test_the_attnlrp_variant_equals_its_rollout_worked_out_by_hand(options, start_block):
    model = tiny_vit(**options)
    torch.manual_seed(1)
    x, targets = torch.randn(3, 3, 12, 12, dtype=torch.float64), [2, 0, 1]
    explanation = explain.AttnLRPRollout(model, start_block=start_block).explain(x, target=targets)
    assert explanation.diagnostics["attention_blocks"] == [f"blocks.{b}.attn" for b in range(start_block, 2)]
    maps = explanation.low_res_maps[0]
    for n, target in enumerate(targets):
        expected = attnlrp_rollout_by_hand(model, x[n], target, start_block)
        assert expected.abs().amax() > 0
        torch.testing.assert_close(maps[n, 0].double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().amax().item())


def test_the_variant_differs_from_the_papers_method():
    """The two relevances of the attention differ (AttnLRP's rules against α1β0 and the normalised sums), and so do
    the maps: the variant is not a second name for the method."""
    model = chefer_vit(3, seed=5)
    torch.manual_seed(5)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    paper = explain.TransformerAttribution(model).explain(x, target=[0, 1, 2, 3]).low_res_maps[0].flatten(1)
    variant = explain.AttnLRPRollout(model).explain(x, target=[0, 1, 2, 3]).low_res_maps[0].flatten(1)
    correlations = [torch.corrcoef(torch.stack([paper[i], variant[i]]))[0, 1].item() for i in range(4)]
    assert min(correlations) < 0.95, correlations


# ------------------------------------------------------------------ 3. the model families


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


@pytest.mark.parametrize("method", [explain.TransformerAttribution, explain.AttnLRPRollout])
@pytest.mark.parametrize("library", FUSED_AND_EAGER)
def test_fused_and_eager_attention_give_the_same_maps(library, method):
    """The relevance pass computes the attention step by step inside a fused call: A's relevance must include A·V's
    split, as it does when the model computes the products itself (else R_A doubles)."""
    *builders, output = FUSED_AND_EAGER[library]
    torch.manual_seed(1)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    explanations = [method(realistic(build(), 0).double().eval(), output=output).explain(x, target=[0, 3, 1])
                    for build in builders]
    assert explanations[0].diagnostics["attention_blocks"] == explanations[1].diagnostics["attention_blocks"]
    maps = [explanation.low_res_maps[0] for explanation in explanations]
    assert maps[0].dtype == maps[1].dtype == torch.float64
    # HuggingFace's eager attention takes its softmax in float32 even in a float64 model (softmax(..., dtype=float32)
    # then a cast back): the eager model's own attention, and so the relevance that passes through the cast, carries
    # float32's rounding (2⁻²⁴ ≈ 6e-8 relative, a few times that after the rollout's products)
    rtol = 2e-5 if library == "huggingface" else 1e-6
    torch.testing.assert_close(maps[0], maps[1], rtol=rtol, atol=rtol * 1e-3 * maps[1].abs().amax().item())


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
