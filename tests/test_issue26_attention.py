"""Issue 26, items 4, 5, 9 and 12: token layouts and the attention methods.

- 4: the token layout (class, distillation and register tokens, patch grid) is read from the
  model where it states it, the same way for CAMs and attention methods, also on tiny grids where
  the token count alone is ambiguous; rollouts read the row the head reads (a register-token ViT
  without a class token averages its patch tokens). Checked against rollouts by hand.
- 5: a softmax that is not attention (not over QKᵀ scores) is not rolled out.
- 9: a torch.compile'd ViT is explained through the module it wraps; compiled code is refused.
- 12: reshape=(h, w) that does not fit the tokens is an error listing the grids that fit.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import explain
from explain.core.layouts import infer_layout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def timm_model(name: str, size: int, **options) -> nn.Module:
    """A tiny timm model of the named architecture (random weights, float64)."""
    torch.manual_seed(0)
    options = {"depth": 2, "embed_dim": 32, "num_heads": 2, "num_classes": 5, "img_size": size, **options}
    return timm.create_model(name, pretrained=False, **options).eval().double()


def attention_by_hand(model: nn.Module, x: torch.Tensor, target: int):
    """Each timm block's attention A = softmax(QKᵀ/√d), (N, heads, T, T), computed by hand from the
    block's own projections in forward hooks (the hooks return the by-hand output, so the gradient
    of the target's score reaches these A), with A.grad = ∂score/∂A."""
    stash = []

    def by_hand(module, args, output):
        tokens = args[0]
        count, length, dim = tokens.shape
        q, k, v = module.qkv(tokens).reshape(count, length, 3, module.num_heads, -1).permute(2, 0, 3, 1, 4)
        probabilities = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        probabilities.retain_grad()
        stash.append(probabilities)
        return module.proj((probabilities @ v).transpose(1, 2).reshape(count, length, dim))

    handles = [block.attn.register_forward_hook(by_hand) for block in model.blocks]
    try:
        output = model(x)
    finally:
        for handle in handles:
            handle.remove()
    output[:, target].sum().backward()
    return stash


def rollouts_by_hand(blocks, prefix: int, row: str, grid):
    """(rollout, gradient rollout) maps (N, h, w), by the papers' formulas, image by image: the row
    the head reads ("class": token 0's; "mean": the mean of the patch tokens' rows) over the patches."""
    count, heads, tokens, _ = blocks[0].shape
    maps = ([], [])
    for image in range(count):
        rollout, weighted = torch.eye(tokens, dtype=torch.float64), torch.eye(tokens, dtype=torch.float64)
        for block in blocks:
            fused = sum(block[image, head] for head in range(heads)) / heads + torch.eye(tokens, dtype=torch.float64)
            rollout = (fused / fused.sum(dim=1, keepdim=True)) @ rollout
            gradient = sum((block.grad[image, head] * block[image, head]).clamp(min=0) for head in range(heads))
            weighted = weighted + (gradient / heads) @ weighted
        for found, relevance in zip(maps, (rollout, weighted)):
            read = relevance[0] if row == "class" else relevance[prefix:].mean(dim=0)
            found.append(read[prefix:].detach().reshape(grid))
    return torch.stack(maps[0]), torch.stack(maps[1])


# ------------------------------------------------------------------ item 4: what the head reads, on the model's grid

ROLLOUT_CASES = {
    # the model: 4 register tokens, no class token, global average pooling of the patch tokens
    "timm-reg4-gap": (lambda: timm_model("vit_base_patch16_reg4_gap_256", 64), 64, 4, "mean", (4, 4)),
    # 1 register token, no class token, 3 × 3 patches
    "timm-reg1-gap": (lambda: timm_model("vit_small_patch16_224", 48, class_token=False, reg_tokens=1,
                                         global_pool="avg"), 48, 1, "mean", (3, 3)),
    # class + 4 registers on a 2 × 2 grid: 9 tokens, which the count alone reads as 3 × 3 patches
    "timm-dinov2-reg4-2x2": (lambda: timm_model("vit_base_patch14_reg4_dinov2", 28), 28, 5, "class", (2, 2)),
    # a class token that the head does not read (global average pooling of the patches)
    "timm-class-token-avg-pool": (lambda: timm_model("vit_small_patch16_224", 48, global_pool="avg"), 48, 1, "mean",
                                  (3, 3)),
}


@pytest.mark.parametrize("name", list(ROLLOUT_CASES))
def test_rollouts_read_the_row_the_head_reads_on_the_models_patch_grid(name):
    build, size, prefix, row, grid = ROLLOUT_CASES[name]
    model = build()
    torch.manual_seed(1)
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    blocks = attention_by_hand(model, x.clone(), target=3)
    rollout, gradient = rollouts_by_hand(blocks, prefix, row, grid)
    found_rollout = explain.AttentionRollout(model, normalize=None).explain(x).low_res_maps[0][:, 0]
    found_gradient = explain.GradientAttentionRollout(model, normalize=None).explain(x, target=3).low_res_maps[0]
    torch.testing.assert_close(found_rollout.double(), rollout, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(found_gradient[:, 0].double(), gradient, rtol=1e-6, atol=1e-9)
    assert gradient.abs().sum() > 0
    explicit = explain.AttentionRollout(model, row="mean", normalize=None).explain(x).low_res_maps[0][:, 0]
    torch.testing.assert_close(explicit.double(), rollouts_by_hand(blocks, prefix, "mean", grid)[0], rtol=1e-6,
                               atol=1e-9)


def test_row_class_on_a_model_without_class_token_is_an_error():
    model = timm_model("vit_base_patch16_reg4_gap_256", 32)
    with pytest.raises(ValueError, match=r"row='class' needs a class token.*4 token\(s\).*row='mean'"):
        explain.AttentionRollout(model, row="class").explain(torch.randn(1, 3, 32, 32, dtype=torch.float64))


def hf_model(kind: str, size: int, patch: int, **options) -> nn.Module:
    torch.manual_seed(0)
    common = dict(image_size=size, patch_size=patch, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, num_labels=3, **options)
    classes = {"vit": (transformers.ViTConfig, transformers.ViTForImageClassification),
               "deit": (transformers.DeiTConfig, transformers.DeiTForImageClassificationWithTeacher),
               "dinov2-registers": (transformers.Dinov2WithRegistersConfig,
                                    transformers.Dinov2WithRegistersForImageClassification)}
    config, model = classes[kind]
    return model(config(**common)).eval()


def torchvision_vit(size: int, patch: int) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(image_size=size, patch_size=patch, num_layers=2, num_heads=2,
                                                hidden_dim=16, mlp_dim=16, num_classes=5).eval()


def first_block(model: nn.Module) -> nn.Module:
    """The first transformer block (timm, torchvision, HuggingFace)."""
    names = ("blocks.0", "encoder.layers.encoder_layer_0", "encoder.layer.0", "layers.0", "encoder.layers.0")
    modules = dict(model.named_modules())
    return next(module for name, module in modules.items() if any(name.endswith(end) for end in names))


LAYOUT_CASES = {
    # name: (model, input size, layer, expected (prefix, grid, class token, readout))
    "timm-class-token": (lambda: timm_model("vit_small_patch16_224", 64), 64, first_block, (1, (4, 4), True, "class")),
    "timm-non-square": (lambda: timm_model("vit_small_patch16_224", (32, 96)), (32, 96), first_block,
                        (1, (2, 6), True, "class")),
    "timm-no-class-token": (lambda: timm_model("vit_small_patch16_224", 48, class_token=False, global_pool="avg"), 48,
                            first_block, (0, (3, 3), False, "mean")),
    "timm-reg4-gap-2x2": (lambda: timm_model("vit_base_patch16_reg4_gap_256", 32), 32, first_block,
                          (4, (2, 2), False, "mean")),
    "timm-dinov2-reg4-2x2": (lambda: timm_model("vit_base_patch14_reg4_dinov2", 28), 28, first_block,
                             (5, (2, 2), True, "class")),
    "timm-dinov2-reg4-3x3": (lambda: timm_model("vit_base_patch14_reg4_dinov2", 42), 42, first_block,
                             (5, (3, 3), True, "class")),
    # the patch embedding's output has no prefix tokens: 9 tokens on the 3 × 3 grid, not 5 + 2 × 2
    "timm-dinov2-reg4-patch-embedding": (lambda: timm_model("vit_base_patch14_reg4_dinov2", 42), 42,
                                         lambda model: model.patch_embed, (0, (3, 3), False, "mean")),
    "timm-deit-distilled": (lambda: timm_model("deit_tiny_distilled_patch16_224", 64), 64, first_block,
                            (2, (4, 4), True, "class+distillation")),  # the head averages the two heads
    "torchvision-vit": (lambda: torchvision_vit(48, 8), 48, first_block, (1, (6, 6), True, "class")),
    "hf-vit": (lambda: hf_model("vit", 32, 8), 32, first_block, (1, (4, 4), True, "class")),
    "hf-deit": (lambda: hf_model("deit", 32, 8), 32, first_block, (2, (4, 4), True, "class+distillation")),
    "hf-dinov2-registers-2x2": (lambda: hf_model("dinov2-registers", 28, 14, num_register_tokens=4), 28, first_block,
                                (5, (2, 2), True, "class+mean")),  # class token and patch mean, concatenated
}


@pytest.mark.parametrize("name", list(LAYOUT_CASES))
def test_token_layouts_are_read_from_the_model(name):
    build, size, layer, (prefix, grid, class_token, readout) = LAYOUT_CASES[name]
    model = build().float()
    height, width = (size, size) if isinstance(size, int) else size
    outputs = []
    handle = layer(model).register_forward_hook(lambda module, args, output: outputs.append(
        output[0] if isinstance(output, tuple) else output))
    try:
        with torch.no_grad():
            model(torch.randn(2, 3, height, width))
    finally:
        handle.remove()
    tokens = outputs[0]
    assert tokens.shape[1] == prefix + grid[0] * grid[1]  # the case is what it says
    layout = infer_layout(tokens, (height, width), name="block", model=model)
    assert (layout.prefix, layout.grid, layout.class_token, layout.readout) == (prefix, grid, class_token, readout)
    # the maps: token prefix + row · w + column at (row, column), written out here
    maps = layout.apply(tokens)
    torch.testing.assert_close(maps[:, :, grid[0] - 1, 1], tokens[:, prefix + (grid[0] - 1) * grid[1] + 1])


def test_model_tokens_of_models_that_state_nothing_is_none_and_the_count_decides():
    from explain.core.layouts import model_tokens

    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    assert model_tokens(cnn) is None
    layout = infer_layout(torch.randn(1, 50, 8), (112, 112), model=cnn)
    assert (layout.prefix, layout.grid, layout.readout) == (1, (7, 7), "class")


# ------------------------------------------------------------------ item 5: a softmax that is not attention


class SpatialSoftmaxCNN(nn.Module):
    """A CNN with a softmax over the last axis of a square (N, C, 7, 7) feature map."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.AdaptiveAvgPool2d(7))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.features(x).softmax(dim=-1).mean(dim=(2, 3)))


class TokenSoftmaxCNN(nn.Module):
    """A (N, 16, 16) softmax over a (16 × 16) map, and a product of two activations of another shape
    (a Gram matrix of the channels) elsewhere in the model."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(16))
        self.head = nn.Linear(16 + 16, 5)

    def forward(self, x):
        maps = self.features(x)
        gram = maps.flatten(2) @ maps.flatten(2).transpose(1, 2)  # (N, 4, 4)
        spread = F.softmax(maps.mean(dim=1), dim=-1)  # (N, 16, 16)
        return self.head(torch.cat([spread.mean(dim=1), gram.flatten(1)], dim=1))


@pytest.mark.parametrize("build, seen", [(SpatialSoftmaxCNN, r"\(1, 8, 7, 7\)"), (TokenSoftmaxCNN, r"\(1, 16, 16\)")])
@pytest.mark.parametrize("method", [explain.AttentionRollout, explain.GradientAttentionRollout])
def test_a_softmax_that_is_not_attention_is_not_rolled_out(build, seen, method):
    model = build().eval()
    with pytest.raises(ValueError, match=rf"found no attention.*QKᵀ.*saw only a softmax over dim=-1 of a {seen}.*"
                                         r"not attention.*GradCAM"):
        method(model).explain(torch.randn(1, 3, 28, 28))
    with explain.capture_attention(model) as attention:
        model(torch.randn(1, 3, 28, 28))
    assert len(attention) == 0 and len(attention.skipped) == 1


class EinsumAttention(nn.Module):
    """Eager attention written as einsum scores, a bias added, and a softmax module beside them."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)
        self.bias = nn.Parameter(torch.zeros(heads, 1, 1))

    def forward(self, x):
        count, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(count, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("nhid,nhjd->nhij", q, k) * q.shape[-1] ** -0.5 + self.bias
        probabilities = self.softmax(scores)
        return self.proj((probabilities @ v).transpose(1, 2).reshape(count, tokens, dim))


class EinsumViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patches = nn.Conv2d(3, 16, 8, stride=8)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 16))
        self.blocks = nn.ModuleList([EinsumAttention(16, 2) for _ in range(2)])
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), self.patches(x).flatten(2).transpose(1, 2)], 1)
        for block in self.blocks:
            tokens = tokens + block(tokens)
        return self.head(tokens[:, 0])


def timm_eager() -> nn.Module:
    model = timm_model("vit_small_patch16_224", 32, patch_size=8).float()
    for block in model.blocks:
        block.attn.fused_attn = False
    return model


REAL_ATTENTION = {
    "timm-eager": (timm_eager, ["blocks.0.attn", "blocks.1.attn"], "softmax"),
    "timm-fused": (lambda: timm_model("vit_small_patch16_224", 32, patch_size=8).float(),
                   ["blocks.0.attn", "blocks.1.attn"], "scaled_dot_product_attention"),
    "hf-vit-eager": (lambda: transformers.ViTForImageClassification._from_config(
        transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=16), attn_implementation="eager").eval(),
        ["vit.layers.0.attention", "vit.layers.1.attention"], "softmax"),
    "torchvision": (lambda: torchvision_vit(32, 8), [f"encoder.layers.encoder_layer_{i}.self_attention"
                                                     for i in (0, 1)], "multi_head_attention_forward"),
    "einsum-and-softmax-module": (lambda: EinsumViT().eval(), ["blocks.0.softmax", "blocks.1.softmax"], "softmax"),
}


@pytest.mark.parametrize("name", list(REAL_ATTENTION))
def test_real_attention_is_still_found(name):
    build, modules, source = REAL_ATTENTION[name]
    model = build()
    x = torch.randn(2, 3, 32, 32)
    with explain.capture_attention(model) as attention:
        model(x)
    assert attention.modules == modules and {record.source for record in attention} == {source}
    assert all(p.shape == (2, 2, 17, 17) for p in attention.probabilities)
    maps = explain.AttentionRollout(model).explain(x).maps
    assert maps.shape == (2, 32, 32) and maps.amax(dim=(1, 2)).eq(1).all()


# ------------------------------------------------------------------ item 9: torch.compile


def compiled_timm_vit():
    model = timm_model("vit_small_patch16_224", 16, depth=1, embed_dim=16, patch_size=8, mlp_ratio=1).float()
    return model, torch.compile(model, backend="inductor")


@pytest.mark.parametrize("method", [explain.GradientAttentionRollout, explain.AttentionRollout])
def test_a_compiled_vit_is_explained_through_the_module_it_wraps(method):
    model, compiled = compiled_timm_vit()
    x = torch.randn(2, 3, 16, 16)
    eager = method(model, normalize=None).explain(x, target=[1, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning blaming the target
        found = method(compiled, normalize=None).explain(x, target=[1, 2])
    torch.testing.assert_close(found.raw_maps, eager.raw_maps, rtol=0, atol=0)
    assert found.raw_maps.abs().sum() > 0
    assert found.diagnostics["attention_blocks"] == ["blocks.0.attn"]
    assert method(compiled).model is model


def test_a_compiled_vit_that_already_ran_compiled_gets_the_eager_map_and_keeps_its_compiled_forward():
    model, compiled = compiled_timm_vit()
    x = torch.randn(1, 3, 16, 16)
    try:
        with torch.no_grad():
            before = compiled(x)
    except Exception as error:  # no C compiler, or inductor unavailable on this platform
        pytest.skip(f"torch.compile (inductor) is unavailable here: {type(error).__name__}")
    eager = explain.GradientAttentionRollout(model, normalize=None).explain(x, target=1).raw_maps
    found = explain.GradientAttentionRollout(compiled, normalize=None).explain(x, target=1).raw_maps
    torch.testing.assert_close(found, eager, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), before, rtol=0, atol=0)
    assert torch._C._len_torch_function_stack() == 0


def test_compiled_code_that_would_still_run_is_refused_naming_torch_compile():
    in_place = timm_model("vit_small_patch16_224", 16, patch_size=8).float()
    in_place.compile()
    with pytest.raises(TypeError, match=r"GradientAttentionRollout.*torch.compile.*'the model'.*_orig_mod"):
        explain.GradientAttentionRollout(in_place)
    inner = timm_model("vit_small_patch16_224", 16, patch_size=8).float()
    inner.blocks[1] = torch.compile(inner.blocks[1])
    with pytest.raises(TypeError, match=r"AttentionRollout.*torch.compile.*'blocks.1'"):
        explain.AttentionRollout(inner)
    model, compiled = compiled_timm_vit()
    with pytest.raises(TypeError, match=r"capture_attention.*torch.compile.*compiled._orig_mod"):
        explain.capture_attention(compiled)


# ------------------------------------------------------------------ item 12: a grid that does not fit the tokens


def test_a_grid_that_does_not_fit_the_tokens_is_an_error_listing_the_grids_that_fit():
    vit = torchvision_vit(48, 8)  # 37 tokens: a class token and 6 × 6 patches
    torch.nn.init.normal_(vit.heads.head.weight, std=0.5)
    x = torch.randn(1, 3, 48, 48)
    layer = "encoder.layers.encoder_layer_1.ln_1"
    explainers = (explain.AttentionRollout(vit, reshape=(5, 5)), explain.GradientAttentionRollout(vit, reshape=(5, 5)),
                  explain.GradCAM(vit, layer, reshape=(5, 5)))
    for explainer in explainers:
        with pytest.raises(ValueError, match=r"reshape=\(5, 5\) does not fit.*37 tokens.*Grids that fit: \(6, 6\)"):
            explainer.explain(x)
    for method in (explain.AttentionRollout, explain.GradientAttentionRollout):  # a grid that fits: as guessed
        torch.testing.assert_close(method(vit, reshape=(6, 6)).explain(x).raw_maps, method(vit).explain(x).raw_maps)
    for bad in [(0, 36), (6.5, 6), (6,), 6, "6x6"]:
        with pytest.raises(ValueError, match="two positive ints"):
            explain.AttentionRollout(vit, reshape=bad).explain(x)


def test_a_grid_must_leave_the_models_own_prefix_tokens():
    model = timm_model("vit_base_patch14_reg4_dinov2", 56).float()  # 21 tokens: class + 4 registers + 4 × 4
    x = torch.randn(1, 3, 56, 56)
    tokens = torch.randn(1, 21, 32)
    with pytest.raises(ValueError, match=r"reshape=\(4, 5\).*21 tokens are 5 class, distillation or register "
                                         r"token\(s\).*h·w must be 16 or 21.*\(4, 4\) after 5"):
        infer_layout(tokens, (56, 56), reshape=(4, 5), name="blocks.0", model=model)
    with pytest.raises(ValueError, match=r"h·w must be 16, not 20"):  # attention covers every token
        explain.AttentionRollout(model, reshape=(4, 5)).explain(x)
    layout = infer_layout(tokens, (56, 56), reshape=(2, 8), model=model)
    assert (layout.prefix, layout.grid) == (5, (2, 8))


# ------------------------------------------------------------------ the CAMs read the same layout, compile too


def test_gradcam_on_class_plus_four_registers_on_a_2x2_grid_reads_the_models_grid():
    """1 class + 4 register tokens + 2×2 patches = 9 tokens, which a count alone would read as a 3×3
    grid. By hand: Grad-CAM over the 4 patch tokens only, ReLU(Σ_c mean_t(∂y/∂A) · A) on the 2×2 grid."""
    model = timm_model("vit_base_patch14_reg4_dinov2", 28)
    x = torch.randn(1, 3, 28, 28, dtype=torch.float64)
    result = explain.GradCAM(model, "blocks.1.norm1", normalize=None).explain(x, target=2)
    assert tuple(result.low_res_maps[0].shape[-2:]) == (2, 2)
    recorded = {}
    handle = model.blocks[1].norm1.register_forward_hook(lambda module, args, output: recorded.update(a=output))
    try:
        score = model(x)[0, 2]
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(score, recorded["a"])
    tokens, gradients = recorded["a"][0, 5:], gradient[0, 5:]  # the patch tokens, after 1 + 4 prefix tokens
    weights = gradients.mean(dim=0)
    expected = torch.relu(tokens @ weights).view(2, 2)
    torch.testing.assert_close(result.low_res_maps[0][0, 0], expected.detach().float(), rtol=1e-5, atol=1e-7)


def test_every_method_explains_a_compiled_model_through_the_module_it_wraps():
    model, compiled = compiled_timm_vit()
    x = torch.randn(1, 3, 16, 16)
    for build in (lambda m, layer: explain.GradCAM(m, layer, normalize=None),
                  lambda m, layer: explain.IntegratedGradients(m, steps=4, normalize=None)):
        eager = build(model, "blocks.0.norm1").explain(x, target=1).raw_maps
        for layer in ("blocks.0.norm1", "_orig_mod.blocks.0.norm1"):
            torch.testing.assert_close(build(compiled, layer).explain(x, target=1).raw_maps, eager, rtol=0, atol=0)
