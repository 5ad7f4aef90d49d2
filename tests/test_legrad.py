"""LeGrad: each layer's score's gradient with respect to that layer's attention, against a slow
implementation by hand (one forward and one backward per layer and target, the attention written
out in the test), against legrad-torch on an OpenCLIP ViT, and on the model families users have
(timm, torchvision, HuggingFace ViT, DINOv2 with registers, CLIP, SigLIP), all with random weights."""

from __future__ import annotations

import contextlib
import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import SmallViT, assert_state_equal, model_state
from torch import Tensor, nn

import explain

# ------------------------------------------------------------------ a tiny transformer, worked out by hand


class TinyBlock(nn.Module):
    """A pre-norm transformer block whose attention is written out: softmax(QKᵀ/√d) over heads."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def attention(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(N, T, D) → (attention output (N, T, D), probabilities (N, heads, T, T))."""
        count, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(count, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        probabilities = (q @ k.transpose(-2, -1) / math.sqrt(dim // self.heads)).softmax(dim=-1)
        return self.proj((probabilities @ v).transpose(1, 2).reshape(count, tokens, dim)), probabilities

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """4 × 4 patches of a 12 × 12 input (a 3 × 3 grid), a class token, 3 blocks, a head on the class token."""

    def __init__(self, dim: int = 16, heads: int = 2, depth: int = 3, classes: int = 5):
        super().__init__()
        self.patches = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.position = nn.Parameter(torch.randn(1, 10, dim) * 0.5)
        self.blocks = nn.ModuleList([TinyBlock(dim, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def embed(self, x: Tensor) -> Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(len(x), -1, -1), tokens], dim=1) + self.position

    def readout(self, tokens: Tensor) -> Tensor:
        return self.head(self.norm(tokens)[:, 0])

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(x)
        for block in self.blocks:
            tokens = block(tokens)
        return self.readout(tokens)


def tiny_vit() -> TinyViT:
    torch.manual_seed(0)
    return TinyViT().eval()


def legrad_of_tiny_vit(model: TinyViT, image: Tensor, target: int, start: int = 0, row: str = "all",
                       pool: str = "model", layers=None) -> Tensor:
    """One image's (3, 3) LeGrad map, slowly: for each layer l, a fresh forward through blocks 0..l
    with the attention computed here, the head applied to layer l's tokens (their mean in every
    token's place for pool="mean"), s_l's gradient with respect to A_l alone, its positive part
    averaged over heads and query rows, the class token's column dropped; summed over the layers."""
    depth = len(model.blocks)
    layers = range(start % depth, depth) if layers is None else layers
    total = torch.zeros(10)
    for layer in layers:
        tokens = model.embed(image[None])
        for block in model.blocks[: layer + 1]:
            attended, probabilities = block.attention(block.norm1(tokens))
            tokens = tokens + attended
            tokens = tokens + block.mlp(block.norm2(tokens))
        if pool == "mean":
            tokens = tokens.mean(dim=1, keepdim=True).expand_as(tokens)
        score = model.readout(tokens)[0, target]
        (gradient,) = torch.autograd.grad(score, probabilities)  # the last block's: layer l's own attention
        per_head = [gradient[0, head].clamp(min=0) for head in range(gradient.shape[1])]
        positive = sum(per_head) / len(per_head)  # (T, T): query rows × key columns
        rows = {"all": positive, "class": positive[:1], "mean": positive[1:]}[row]
        total = total + rows.mean(dim=0)
    return total[1:].reshape(3, 3)


@pytest.mark.parametrize("start, row, pool", [(0, "all", "model"), (1, "class", "model"), (-1, "mean", "mean"),
                                              (0, "auto", "mean")])
def test_equals_a_slow_layer_by_layer_implementation_by_hand(start, row, pool):
    model = tiny_vit()
    torch.manual_seed(1)
    x = torch.randn(2, 3, 12, 12)
    targets = [[1, 4], [2, 0]]  # K = 2 targets per image
    explainer = explain.LeGrad(model, start_block=start, row=row, pool=pool, normalize=None)
    explanation = explainer.explain(x, target=targets)
    assert explanation.low_res_maps[0].shape == (2, 2, 3, 3)
    assert explanation.raw_maps.shape == (2, 2, 12, 12)
    assert explanation.diagnostics["attention_blocks"] == [f"blocks.{i}" for i in range(3)][start:]
    by_hand = torch.stack([torch.stack([legrad_of_tiny_vit(model, x[n], targets[n][k], start, row.replace(
        "auto", "class"), pool) for k in range(2)]) for n in range(2)])
    torch.testing.assert_close(explanation.low_res_maps[0], by_hand, rtol=1e-5, atol=1e-8)
    assert by_hand.abs().sum() > 0
    torch.testing.assert_close(explanation.scores, model(x).detach().gather(1, torch.tensor(targets)))


def test_blocks_by_position_top_k_and_min_max_normalisation():
    model = tiny_vit()
    x = torch.randn(2, 3, 12, 12)
    explainer = explain.LeGrad(model, blocks=[0, 2], normalize=None)
    maps = explainer.explain(x, target=[3, 1]).low_res_maps[0][:, 0]
    by_hand = torch.stack([legrad_of_tiny_vit(model, x[n], [3, 1][n], layers=[0, 2]) for n in range(2)])
    torch.testing.assert_close(maps, by_hand, rtol=1e-5, atol=1e-8)
    top = explain.LeGrad(model).explain(x, topk=2)  # default: every layer, min-max normalised
    assert top.maps.shape == (2, 2, 12, 12)
    classes = model(x).topk(2, dim=1).indices
    for n in range(2):
        for k in range(2):
            raw = F.interpolate(legrad_of_tiny_vit(model, x[n], int(classes[n, k]))[None, None], size=(12, 12),
                                mode="bilinear", align_corners=False)[0, 0]
            torch.testing.assert_close(top.maps[n, k], (raw - raw.min()) / (raw.max() - raw.min()), rtol=1e-4,
                                       atol=1e-5)
            assert top.maps[n, k].min() == 0 and top.maps[n, k].max() == 1


# ------------------------------------------------------------------ legrad-torch on OpenCLIP


class ImageEncoder(nn.Module):
    """An OpenCLIP model's image tower as a model: pixels → (N, D) image embeddings."""

    def __init__(self, clip: nn.Module):
        super().__init__()
        self.clip = clip

    def forward(self, pixels: Tensor) -> Tensor:
        return self.clip.encode_image(pixels)


def correlation(a: Tensor, b: Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


def test_equals_legrad_torch_on_an_open_clip_vit():
    """legrad-torch's LeWrapper (layer_index=-2: the last two layers) against LeGrad with its settings:
    start_block=-2 and pool="mean", since legrad-torch reads each layer as ln_post(mean of all
    tokens) @ proj where OpenCLIP's own readout (pool_type "tok") is ln_post(class token) @ proj."""
    open_clip = pytest.importorskip("open_clip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # timm's deprecated module names, imported by legrad
        legrad = pytest.importorskip("legrad")
    torch.manual_seed(0)
    clip = open_clip.model.CLIP(
        embed_dim=32,
        vision_cfg=open_clip.model.CLIPVisionCfg(layers=3, width=64, head_width=16, patch_size=8, image_size=32),
        text_cfg=open_clip.model.CLIPTextCfg(context_length=16, vocab_size=100, width=32, heads=2, layers=1),
    ).eval()
    images = torch.randn(2, 3, 32, 32)
    prompts = F.normalize(torch.randn(3, 32), dim=-1)  # 3 text embeddings
    model = ImageEncoder(clip)
    before = model_state(model)
    similarity = explain.EmbeddingSimilarity(prompts)
    ours = explain.LeGrad(model, pool="mean", start_block=-2).explain(images, target=similarity)
    assert_state_equal(before, model_state(model))
    assert ours.maps.shape == (2, 3, 32, 32)
    with contextlib.redirect_stdout(io.StringIO()):  # LeWrapper prints; it changes the model it wraps: a copy
        wrapped = legrad.LeWrapper(copy.deepcopy(clip), layer_index=-2)
    for n in range(2):
        theirs = wrapped.compute_legrad_clip(text_embedding=prompts, image=images[n : n + 1]).detach()  # (1, 3, H, W)
        for k in range(3):
            assert correlation(ours.maps[n, k], theirs[0, k]) > 0.9999
        torch.testing.assert_close(ours.maps[n], theirs[0], rtol=0, atol=1e-5)
    # OpenCLIP's own readout (the class token) gives other maps: hence pool="mean" above
    own = explain.LeGrad(model, start_block=-2).explain(images, target=similarity)
    assert (own.maps - ours.maps).abs().max() > 1e-2
    alone = explain.LeGrad(model, start_block=-2).explain(images[1:], target=similarity)
    torch.testing.assert_close(own.raw_maps[1:], alone.raw_maps, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------ model families, by hand


def pass_input_on(module, args, kwargs, output):
    """A forward hook that makes a block pass its input tokens on (skips it)."""
    tokens = args[0] if args else kwargs["hidden_states"]
    return tokens if isinstance(output, Tensor) else (tokens, *output[1:])


def legrad_by_hand(family, model: nn.Module, x: Tensor, targets: list, start: int = 0) -> Tensor:
    """(N, patches): for each layer l, the model run with the blocks after l skipped (so that its output
    is its readout of layer l's tokens) and its attention computed by hand (``run_by_hand``); ∂s_l/∂A_l,
    its positive part averaged over heads and query rows; summed over the layers."""
    from test_attention_models import run_by_hand

    attention_layers = family.attention_layers(model)
    blocks = [model.get_submodule(name.rpartition(".")[0]) for name in family.names]
    total = 0
    for layer in range(start % len(blocks), len(blocks)):
        handles = [block.register_forward_hook(pass_input_on, with_kwargs=True) for block in blocks[layer + 1 :]]
        try:
            _, stash = run_by_hand(family, model, x, targets=targets)
        finally:
            for handle in handles:
                handle.remove()
        assert len(stash) == len(attention_layers)
        total = total + stash[layer].grad.clamp(min=0).mean(dim=1).mean(dim=1)
    return total[:, family.prefix :]


def by_hand_families():
    from test_attention_models import FAMILIES, Family, hf_by_hand, timm_by_hand

    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")

    def dinov2_registers() -> nn.Module:
        torch.manual_seed(0)
        return timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False, img_size=56, depth=2,
                                 num_classes=5).eval()

    def siglip() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.SiglipVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=4)
        return transformers.SiglipVisionModel._from_config(config, attn_implementation="sdpa").eval()

    families = {name: (family, "logits") for name, family in FAMILIES.items()}
    families["timm-dinov2-registers"] = (Family(dinov2_registers, 56, lambda m: [b.attn for b in m.blocks],
                                                timm_by_hand, ["blocks.0.attn", "blocks.1.attn"], prefix=5), "logits")
    families["siglip-vision-tower"] = (Family(siglip, 32, lambda m: [layer.self_attn for layer in m.encoder.layers],
                                              hf_by_hand("out_proj"),
                                              [f"encoder.layers.{i}.self_attn" for i in (0, 1)],
                                              lambda output: output.pooler_output, prefix=0), "pooler_output")
    return families


FAMILY_NAMES = ["torchvision-vit", "timm-fused", "timm-eager", "timm-no-class-token", "hf-vit-sdpa", "hf-vit-eager",
                "hf-clip-image-tower", "transformer-encoder", "timm-dinov2-registers", "siglip-vision-tower"]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_each_model_family_equals_layer_by_layer_by_hand(name):
    family, output = by_hand_families()[name]
    model = family.build()
    torch.manual_seed(2)
    x = torch.randn(2, 3, family.size, family.size)
    targets = [[1, 4], [2, 0]]
    selector = None if output == "logits" else output
    explanation = explain.LeGrad(model, output=selector, normalize=None).explain(x, target=targets)
    assert explanation.diagnostics["attention_blocks"] == family.names
    grid = explanation.low_res_maps[0].shape[-2:]
    for k in range(2):
        by_hand = legrad_by_hand(family, model, x, [row[k] for row in targets]).reshape(2, *grid)
        torch.testing.assert_close(explanation.low_res_maps[0][:, k], by_hand, rtol=1e-4, atol=1e-9)
        assert by_hand.abs().sum() > 0
    last = explain.LeGrad(model, output=selector, start_block=-1, normalize=None).explain(x, target=[1, 2])
    torch.testing.assert_close(last.low_res_maps[0][:, 0], legrad_by_hand(family, model, x, [1, 2], start=-1).reshape(
        2, *grid), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("name", ["hf-vit-sdpa", "transformer-encoder", "timm-dinov2-registers"])
def test_a_batch_of_three_with_different_targets_equals_each_image_alone_and_the_model_is_left_as_found(name):
    family, _ = by_hand_families()[name]
    model = family.build()
    torch.manual_seed(3)
    x = torch.randn(3, 3, family.size, family.size)
    targets = [0, 3, 1]
    before = model_state(model)
    explainer = explain.LeGrad(model, normalize=None)
    together = explainer.explain(x, target=targets)
    alone = torch.cat([explainer.explain(x[i : i + 1], target=targets[i]).raw_maps for i in range(3)])
    torch.testing.assert_close(together.raw_maps, alone, rtol=1e-4, atol=1e-8)
    assert_state_equal(before, model_state(model))


def test_a_frozen_model_in_train_mode_gets_the_same_maps_and_comes_back_as_found():
    """No parameter requires grad (the first block's attention is still in the graph, through the input),
    dropout in train mode (the call runs in eval mode); flags and modes come back."""
    torch.manual_seed(0)
    model = SmallViT().eval()
    x = torch.randn(3, 3, 16, 16)
    expected = explain.LeGrad(model, normalize=None).explain(x, target=[1, 2, 3]).raw_maps
    model.train().requires_grad_(False)
    before = model_state(model)
    frozen = explain.LeGrad(model, normalize=None).explain(x, target=[1, 2, 3]).raw_maps
    torch.testing.assert_close(frozen, expected)
    assert_state_equal(before, model_state(model))


# ------------------------------------------------------------------ CLIP


def test_hf_clip_model_k_prompts_per_image_equal_the_image_tower_with_embedding_similarity():
    """CLIPModel's logits_per_image (exp(logit_scale) · cosine) with the prompts as its other input and the
    image tower's blocks, against the image tower alone with EmbeddingSimilarity: the same maps up to
    that scale; K = 3 prompts in one call equal each prompt alone."""
    from test_attention_models import ImageEmbedding, hf_clip

    clip = hf_clip()
    torch.manual_seed(4)
    pixels, prompts = torch.randn(2, 3, 32, 32), torch.randint(0, 50, (3, 7))
    before = model_state(clip)
    e = explain.LeGrad(clip, blocks="vision_model", output="logits_per_image", normalize=None).explain(
        pixels, target=[[0, 1, 2]] * 2, forward_kwargs={"input_ids": prompts}, input_position="pixel_values",
        per_image=[])
    assert_state_equal(before, model_state(clip))
    assert e.maps.shape == (2, 3, 32, 32)
    with torch.no_grad():
        texts = clip.get_text_features(input_ids=prompts).pooler_output
    tower = explain.LeGrad(ImageEmbedding(clip), normalize=None)
    similar = tower.explain(pixels, target=explain.EmbeddingSimilarity(texts))
    scale = clip.logit_scale.exp().detach()
    torch.testing.assert_close(e.raw_maps, similar.raw_maps * scale, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(e.scores, similar.scores * scale, rtol=1e-5, atol=1e-6)
    for k in range(3):
        alone = tower.explain(pixels, target=explain.EmbeddingSimilarity(texts[k]))
        torch.testing.assert_close(similar.raw_maps[:, k], alone.raw_maps, rtol=1e-4, atol=1e-8)
    with pytest.raises(ValueError, match=r"two stacks.*blocks='vision_model'"):
        explain.LeGrad(clip, output="logits_per_image").explain(
            pixels, target=[[0, 1, 2]] * 2, forward_kwargs={"input_ids": prompts}, input_position="pixel_values",
            per_image=[])
    assert_state_equal(before, model_state(clip))


# ------------------------------------------------------------------ window attention (Swin)


def legrad_by_capture(model: nn.Module, x: Tensor, blocks: list, recorded: str, targets: list) -> Tensor:
    """(N, T): LeGrad layer by layer with the attention recorded by ``explain.capture_attention``: the
    blocks after layer l skipped, ∂s_l/∂A_l by autograd, its positive part averaged over heads and rows."""
    total = 0
    for layer in range(len(blocks)):
        handles = [block.register_forward_hook(pass_input_on, with_kwargs=True) for block in blocks[layer + 1 :]]
        try:
            with explain.capture_attention(model, recorded, detach=False) as attention:
                scores = model(x)[torch.arange(len(targets)), torch.tensor(targets)]
            (gradient,) = torch.autograd.grad(scores.sum(), attention.probabilities[layer])
        finally:
            for handle in handles:
                handle.remove()
        total = total + gradient.clamp(min=0).mean(dim=1).mean(dim=1)
    return total


def test_swin_reads_its_last_stage_by_default_and_blocks_choose_among_its_blocks():
    """Each stage of Swin has its own width, so only the last stage's tokens can be read through the model's head:
    by default LeGrad reads that stage's blocks (their windows laid out on its grid: tests/test_swin_windows.py);
    blocks= by position chooses among them, by name reads the named stage (here the same), a global last stage (one
    window) is layer-by-layer LeGrad as for a ViT."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=4,
                             embed_dim=16, depths=(1, 2), num_heads=(1, 2), num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    before = model_state(swin)
    default = explain.LeGrad(swin, normalize=None).explain(x, target=[1, 3])
    assert default.diagnostics["attention_blocks"] == [f"layers.1.blocks.{i}.attn.softmax" for i in (0, 1)]
    named = explain.LeGrad(swin, blocks="layers.1", normalize=None).explain(x, target=[1, 3])
    torch.testing.assert_close(named.low_res_maps[0], default.low_res_maps[0])
    by_hand = legrad_by_capture(swin, x, list(swin.layers[1].blocks), "layers.1", [1, 3]).reshape(2, 4, 4)
    torch.testing.assert_close(default.low_res_maps[0][:, 0], by_hand, rtol=1e-4, atol=1e-9)
    last = explain.LeGrad(swin, blocks=-1, normalize=None).explain(x, target=[1, 3])
    assert last.diagnostics["attention_blocks"] == ["layers.1.blocks.1.attn.softmax"]
    with pytest.raises(ValueError, match="window attention"):
        explain.GradientAttentionRollout(swin).explain(x)
    assert_state_equal(before, model_state(swin))


# ------------------------------------------------------------------ bad input


class LooseBlocks(nn.Module):
    """Two attention blocks held as plain attributes, not in an nn.ModuleList."""

    def __init__(self):
        super().__init__()
        self.patches = nn.Conv2d(3, 16, 4, stride=4)
        self.first, self.second = TinyBlock(16, 2), TinyBlock(16, 2)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.patches(x).flatten(2).transpose(1, 2)
        return self.head(self.second(self.first(tokens)).mean(dim=1))


def test_bad_options_and_models_get_clear_errors_and_leave_the_model_as_found():
    model = tiny_vit()
    x = torch.randn(1, 3, 12, 12)
    with pytest.raises(ValueError, match="pool must be one of"):
        explain.LeGrad(model, pool="max")
    with pytest.raises(ValueError, match="row must be one of"):
        explain.LeGrad(model, row="first")
    before = model_state(model)
    with pytest.raises(ValueError, match="start_block=5 is out of range"):
        explain.LeGrad(model, start_block=5).explain(x)
    with pytest.raises(ValueError, match=r"blocks=\[7\]: block 7 does not exist"):
        explain.LeGrad(model, blocks=[7]).explain(x)
    with pytest.raises(ValueError, match=r"last entry, 'blocks.2', computed no recorded attention"):
        explain.LeGrad(model, blocks=["blocks.0", "blocks.1"]).explain(x)
    assert_state_equal(before, model_state(model))
    loose = LooseBlocks().eval()
    with pytest.raises(ValueError, match=r"found attention in 'first', 'second' but no transformer block"):
        explain.LeGrad(loose).explain(x)
    with pytest.raises(ValueError, match="found no attention"):
        explain.LeGrad(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(400, 3))).explain(x)
    assert explain.get_method("legrad") is explain.LeGrad
