"""AttnLRP (explain.AttnLRP, Achtibat et al. 2024): the relevance at the input against

1. relevance propagated by hand, layer by layer, in relevance space (no gradients) through a tiny transformer
   written here: LRP-0 for linear maps, the identity rule for GELU and LayerNorm, the softmax rule, the uniform rule
   for QKᵀ and A·V, proportional splits for residual sums;
2. conservation: with no bias and nothing constant added on the path, the input's relevance sums to the score, less
   (AttnLRP) what the softmax rule's bias terms absorb, exactly (CP-LRP);
3. lxt 2.x (the authors' library) with zennit's γ rule, on torchvision's and HuggingFace's ViT;
4. the model families people use (timm, torchvision, HuggingFace; ViT, DeiT, DINOv2 with registers, CLIP,
   SigLIP, Swin v1 and v2): a batch equals its images alone, every call on the input's path has a rule;
5. a hostile caller: no_grad, inference_mode, autocast, another thread serving the model, a forward that raises,
   in-place activations, gated MLPs, custom activation modules.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import sys
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import assert_state_equal, model_state
from torch import Tensor, nn

import explain

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def quietly(function: Callable, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return function(*args, **kwargs)


def strictly(function: Callable, *args, **kwargs):
    """The call with every RuntimeWarning an error: an unruled call on the input's path fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return function(*args, **kwargs)


def relative_error(value: Tensor, reference: Tensor) -> float:
    return ((value - reference).abs().max() / reference.abs().max()).item()


# ------------------------------------------------------------------ 1. a tiny transformer, and its relevance by hand


class ExplicitLayerNorm(nn.Module):
    """LayerNorm written out: (x − mean) / sqrt(var + ε) · w + b (the divisor through torch.sqrt)."""

    def __init__(self, dim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(dim))
        self.bias = nn.Parameter(0.3 * torch.randn(dim)) if bias else None
        self.eps = 1e-5

    def forward(self, x: Tensor) -> Tensor:
        centred = x - x.mean(-1, keepdim=True)
        y = centred / torch.sqrt((centred**2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y if self.bias is None else y + self.bias


class EagerAttention(nn.Module):
    def __init__(self, dim: int, heads: int, bias: bool):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.stash: list[Tensor] | None = None  # the attention probabilities, when a test asks for them

    def forward(self, x: Tensor) -> Tensor:
        count, tokens, dim = x.shape
        q, k, v = self.qkv(x).reshape(count, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attention = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        if self.stash is not None:
            attention.retain_grad()
            self.stash.append(attention)
        return self.proj((attention @ v).transpose(1, 2).reshape(count, tokens, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, bias: bool):
        super().__init__()
        self.norm1 = ExplicitLayerNorm(dim, bias)
        self.attn = EagerAttention(dim, heads, bias)
        self.norm2 = nn.LayerNorm(dim, bias=bias)  # F.layer_norm
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden, bias=bias), nn.GELU(), nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    """Patches of ``patch`` × ``patch`` pixels → a linear map → class token, position embedding → ``depth``
    blocks (2 heads, eager attention, pre-norm, GELU MLP) → LayerNorm → a linear head on the class token (or on
    the mean of the tokens without one)."""

    def __init__(self, image: int = 12, patch: int = 4, dim: int = 8, heads: int = 2, depth: int = 2,
                 hidden: int = 16, classes: int = 3, bias: bool = True, class_token: bool = True,
                 positions: bool = True):
        super().__init__()
        self.patch, self.grid = patch, image // patch
        tokens = self.grid**2 + class_token
        self.embed = nn.Linear(3 * patch * patch, dim, bias=bias)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim)) if class_token else None
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, tokens, dim)) if positions else None
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, bias) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, bias=bias)
        self.head = nn.Linear(dim, classes, bias=bias)
        with torch.no_grad():
            for name, parameter in self.named_parameters():  # biases and norm weights away from their defaults
                if "norm" in name:
                    parameter.copy_((1 if name.endswith("weight") else 0) + 0.3 * torch.randn_like(parameter))
                elif name.endswith("bias"):
                    parameter.normal_(0, 0.3)

    def forward(self, x: Tensor) -> Tensor:
        count, p = x.shape[0], self.patch
        patches = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(count, self.grid**2, -1)
        tokens = self.embed(patches)
        if self.cls_token is not None:
            tokens = torch.cat([self.cls_token.expand(count, -1, -1), tokens], dim=1)
        if self.pos_embed is not None:
            tokens = tokens + self.pos_embed
        for block in self.blocks:
            tokens = block(tokens)
        tokens = self.norm(tokens)
        return self.head(tokens[:, 0] if self.cls_token is not None else tokens.mean(dim=1))


def tiny_vit(**options) -> TinyViT:
    torch.manual_seed(0)
    return TinyViT(**options).double().eval()


# Relevance by hand: Python floats and loops, no torch. A vector is a list of floats, a token sequence a list of
# vectors, a weight matrix a list of rows (out × in), as torch stores nn.Linear's weight.


def values(tensor: Tensor | None):
    return None if tensor is None else tensor.detach().tolist()


def linear(rows, weight, bias):
    return [[sum(w * x for w, x in zip(weight_row, row)) + (0.0 if bias is None else bias[j])
             for j, weight_row in enumerate(weight)] for row in rows]


def lrp_linear(rows, weight, outputs, relevance):
    """LRP-0: R_i = Σ_j x_i w_ji / y_j · R_j, y_j with its bias (which keeps its share)."""
    return [[sum(x * weight[j][i] / y[j] * r[j] for j in range(len(y))) for i, x in enumerate(row)]
            for row, y, r in zip(rows, outputs, relevance)]


def layer_norm(rows, weight, bias, eps):
    """(outputs, divisors σ)."""
    outputs, divisors = [], []
    for row in rows:
        mean = sum(row) / len(row)
        sigma = math.sqrt(sum((x - mean) ** 2 for x in row) / len(row) + eps)
        outputs.append([(x - mean) / sigma * weight[j] + (0.0 if bias is None else bias[j])
                        for j, x in enumerate(row)])
        divisors.append(sigma)
    return outputs, divisors


def lrp_layer_norm(rows, weight, divisors, outputs, relevance):
    """The identity rule of LayerNorm: σ held constant, y_j = Σ_i (δ_ij − 1/D) w_j / σ · x_i + b_j is a linear
    map, and LRP-0 on it: R_i = Σ_j x_i (δ_ij − 1/D) w_j / σ / y_j · R_j."""
    result = []
    for row, sigma, y, r in zip(rows, divisors, outputs, relevance):
        size = len(row)
        result.append([sum(x * ((i == j) - 1 / size) * weight[j] / sigma / y[j] * r[j] for j in range(size))
                       for i, x in enumerate(row)])
    return result


def add_rows(a, b):
    return [[x + y for x, y in zip(row_a, row_b)] for row_a, row_b in zip(a, b)]


def split_proportionally(terms, total, relevance):
    """A sum's relevance split in proportion to its terms: R_term = term / total · R."""
    return [[t / s * r for t, s, r in zip(row_t, row_s, row_r)] for row_t, row_s, row_r in zip(terms, total, relevance)]


def gelu(x: float) -> float:
    return 0.5 * x * (1 + math.erf(x / math.sqrt(2)))


class BlockByHand:
    """One block's forward pass in floats, and its relevance backwards."""

    def __init__(self, block: Block, rows, conservative: bool):
        self.block, self.rows, self.conservative = block, rows, conservative
        self.absorbed = 0.0  # by the softmaxes, once the relevance is propagated
        attn, heads = block.attn, block.attn.heads
        norm1 = block.norm1
        self.a, self.sigma1 = layer_norm(rows, values(norm1.weight), values(norm1.bias), norm1.eps)
        self.qkv = linear(self.a, values(attn.qkv.weight), values(attn.qkv.bias))
        dim = len(rows[0])
        self.head_dim, tokens = dim // heads, len(rows)
        d = self.head_dim

        def head_part(which: int, head: int):
            return [[row[which * dim + head * d + e] for e in range(d)] for row in self.qkv]

        self.q = [head_part(0, h) for h in range(heads)]
        self.k = [head_part(1, h) for h in range(heads)]
        self.v = [head_part(2, h) for h in range(heads)]
        self.scores, self.attention, self.heads_out = [], [], []
        for h in range(heads):
            scores = [[attn.scale * sum(self.q[h][i][e] * self.k[h][j][e] for e in range(d)) for j in range(tokens)]
                      for i in range(tokens)]
            attention = []
            for row in scores:
                top = max(row)
                exps = [math.exp(s - top) for s in row]
                attention.append([e / sum(exps) for e in exps])
            self.scores.append(scores)
            self.attention.append(attention)
            self.heads_out.append([[sum(attention[i][j] * self.v[h][j][e] for j in range(tokens)) for e in range(d)]
                                   for i in range(tokens)])
        self.o = [[self.heads_out[h][i][e] for h in range(heads) for e in range(d)] for i in range(tokens)]
        self.p = linear(self.o, values(attn.proj.weight), values(attn.proj.bias))
        self.h = add_rows(rows, self.p)
        norm2 = block.norm2
        self.b, self.sigma2 = layer_norm(self.h, values(norm2.weight), values(norm2.bias), norm2.eps)
        self.u = linear(self.b, values(block.fc1.weight), values(block.fc1.bias))
        self.g = [[gelu(x) for x in row] for row in self.u]
        self.m = linear(self.g, values(block.fc2.weight), values(block.fc2.bias))
        self.out = add_rows(self.h, self.m)

    def relevance(self, relevance_out):
        """(relevance of the block's input, per head the relevance of its attention probabilities R_A)."""
        block, attn = self.block, self.block.attn
        heads, d, tokens = attn.heads, self.head_dim, len(self.rows)
        # out = h + m
        relevance_h = split_proportionally(self.h, self.out, relevance_out)
        relevance_m = split_proportionally(self.m, self.out, relevance_out)
        relevance_g = lrp_linear(self.g, values(block.fc2.weight), self.m, relevance_m)
        relevance_u = relevance_g  # GELU: the identity rule
        relevance_b = lrp_linear(self.b, values(block.fc1.weight), self.u, relevance_u)
        relevance_h = add_rows(relevance_h, lrp_layer_norm(self.h, values(block.norm2.weight), self.sigma2, self.b,
                                                           relevance_b))
        # h = x + p
        relevance_x = split_proportionally(self.rows, self.h, relevance_h)
        relevance_p = split_proportionally(self.p, self.h, relevance_h)
        relevance_o = lrp_linear(self.o, values(attn.proj.weight), self.p, relevance_p)
        relevance_qkv = [[0.0] * (3 * heads * d) for _ in range(tokens)]
        relevance_attention = []
        for h in range(heads):
            relevance_head = [[relevance_o[i][h * d + e] for e in range(d)] for i in range(tokens)]
            a, v, out = self.attention[h], self.v[h], self.heads_out[h]
            # O_ie = Σ_j A_ij V_je: each product's relevance A_ij V_je / O_ie · R_ie, half to A_ij, half to V_je
            # (CP-LRP: A is a constant, all of it to V)
            share = 1.0 if self.conservative else 0.5
            relevance_a = [[0.5 * sum(a[i][j] * v[j][e] / out[i][e] * relevance_head[i][e] for e in range(d))
                            for j in range(tokens)] for i in range(tokens)]
            relevance_v = [[share * sum(a[i][j] * v[j][e] / out[i][e] * relevance_head[i][e] for i in range(tokens))
                            for e in range(d)] for j in range(tokens)]
            relevance_attention.append(relevance_a)
            # softmax: R_S = S ⊙ (R_A − A Σ_j R_A)
            scores = self.scores[h]
            relevance_s = [[scores[i][j] * (relevance_a[i][j] - a[i][j] * sum(relevance_a[i]))
                            for j in range(tokens)] for i in range(tokens)]
            if self.conservative:
                relevance_s = [[0.0] * tokens for _ in range(tokens)]
            else:  # what the softmax rule does not pass on (its bias term)
                self.absorbed += sum(map(sum, relevance_a)) - sum(map(sum, relevance_s))
            # S_ij = scale Σ_e q_ie k_je: each product's relevance, half to q_ie, half to k_je
            q, k = self.q[h], self.k[h]
            terms = [[[attn.scale * q[i][e] * k[j][e] / scores[i][j] * relevance_s[i][j] for e in range(d)]
                      for j in range(tokens)] for i in range(tokens)]
            for i in range(tokens):
                for e in range(d):
                    relevance_qkv[i][h * d + e] += 0.5 * sum(terms[i][j][e] for j in range(tokens))
                    relevance_qkv[i][heads * d + h * d + e] += 0.5 * sum(terms[j][i][e] for j in range(tokens))
                    relevance_qkv[i][2 * heads * d + h * d + e] += relevance_v[i][e]
        relevance_a_in = lrp_linear(self.a, values(attn.qkv.weight), self.qkv, relevance_qkv)
        relevance_x = add_rows(relevance_x, lrp_layer_norm(self.rows, values(block.norm1.weight), self.sigma1, self.a,
                                                           relevance_a_in))
        return relevance_x, relevance_attention


@dataclass
class ByHand:
    score: float
    pixels: Tensor  # (3, H, W): the relevance of the image's pixels
    attention: list  # per block, per head, (T, T): the relevance of the attention probabilities R_A
    absorbed: float  # by the softmax rule's bias terms, over blocks and heads


def relevance_by_hand(model: TinyViT, image: Tensor, target: int, conservative: bool = False) -> ByHand:
    """The score's relevance propagated backwards in relevance space, layer by layer."""
    p, grid = model.patch, model.grid
    pixels = image.tolist()
    patches = [[pixels[c][gy * p + y][gx * p + x] for c in range(3) for y in range(p) for x in range(p)]
               for gy in range(grid) for gx in range(grid)]
    embedded = linear(patches, values(model.embed.weight), values(model.embed.bias))
    tokens = ([values(model.cls_token)[0][0]] if model.cls_token is not None else []) + embedded
    rows = tokens if model.pos_embed is None else add_rows(tokens, values(model.pos_embed)[0])
    blocks = []
    for block in model.blocks:
        blocks.append(BlockByHand(block, rows, conservative))
        rows = blocks[-1].out
    normed, sigmas = layer_norm(rows, values(model.norm.weight), values(model.norm.bias), model.norm.eps)
    readout = normed[0] if model.cls_token is not None else [sum(column) / len(normed) for column in zip(*normed)]
    logits = linear([readout], values(model.head.weight), values(model.head.bias))[0]
    relevance_logits = [logits[target] if j == target else 0.0 for j in range(len(logits))]
    relevance_readout = lrp_linear([readout], values(model.head.weight), [logits], [relevance_logits])[0]
    if model.cls_token is not None:
        relevance = [relevance_readout] + [[0.0] * len(readout) for _ in normed[1:]]
    else:  # the mean: each token's share of it, x_t / T / mean · R
        relevance = [[x / len(normed) / m * r for x, m, r in zip(row, readout, relevance_readout)] for row in normed]
    relevance = lrp_layer_norm(rows, values(model.norm.weight), sigmas, normed, relevance)
    attention_relevance = []
    for block in reversed(blocks):
        relevance, per_head = block.relevance(relevance)
        attention_relevance.insert(0, per_head)
    if model.pos_embed is not None:  # the position embedding is a constant: its share stays there
        relevance = split_proportionally(tokens, add_rows(tokens, values(model.pos_embed)[0]), relevance)
    if model.cls_token is not None:  # so is the class token
        relevance = relevance[1:]
    relevance_patches = lrp_linear(patches, values(model.embed.weight), embedded, relevance)
    result = [[[0.0] * (grid * p) for _ in range(grid * p)] for _ in range(3)]
    for index, patch_relevance in enumerate(relevance_patches):
        gy, gx = divmod(index, grid)
        for position, r in enumerate(patch_relevance):
            c, rest = divmod(position, p * p)
            y, x = divmod(rest, p)
            result[c][gy * p + y][gx * p + x] = r
    return ByHand(logits[target], torch.tensor(result, dtype=torch.float64), attention_relevance,
                  sum(block.absorbed for block in blocks))


@pytest.mark.parametrize("conservative", [False, True], ids=["attnlrp", "cp-lrp"])
@pytest.mark.parametrize("options", [{}, {"class_token": False, "positions": False}], ids=["class-token", "mean"])
def test_relevance_equals_the_relevance_propagated_by_hand_layer_by_layer(options, conservative):
    model = tiny_vit(**options)
    torch.manual_seed(1)
    x, targets = torch.randn(3, 3, 12, 12, dtype=torch.float64), [2, 0, 1]
    explanation = strictly(explain.AttnLRP(model, conservative=conservative).explain, x, target=targets)
    assert explanation.diagnostics["unruled"] == []
    # norms: 2 divisors (torch.sqrt) of the explicit LayerNorms, 3 F.layer_norm; identity: 2 GELU, 2 squares of
    # the explicit LayerNorms (inside a divisor, held constant); uniform: QKᵀ and A·V in 2 blocks (CP-LRP: A is
    # held constant, so A·V is linear)
    uniform = 2 if conservative else 4
    assert explanation.diagnostics["rules"] == ["identity: 4", "linear: 10", "norm: 5", "softmax: 2",
                                                f"uniform: {uniform}"]
    for n, target in enumerate(targets):
        by_hand = relevance_by_hand(model, x[n], target, conservative)
        assert math.isclose(explanation.scores[n].item(), by_hand.score, rel_tol=1e-6)
        error = relative_error(explanation.attributions[n, 0], by_hand.pixels)
        assert error < 1e-6, f"image {n}: relative error {error:.3g}"  # measured 1e-10 to 1e-8: ε of y / (x + ε)
        sums = explanation.diagnostics["relevance_sum"][n, 0].item(), by_hand.pixels.sum().item()
        assert math.isclose(*sums, rel_tol=1e-5, abs_tol=1e-9)


# ------------------------------------------------------------------ 2. conservation


def test_without_biases_or_constants_on_the_path_relevance_is_conserved_up_to_what_the_softmaxes_absorb():
    """No bias, no class token, no position embedding: every rule conserves relevance (LRP-0 without bias, the
    identity rules, the uniform rule, proportional sums, the mean) except the softmax rule, whose bias term keeps
    Σ R_A − Σ R_S. CP-LRP holds the softmax constant: the input's relevance sums to the score (within the ε of the
    identity rule, 1e-10 / |x|); AttnLRP's sums to the score less what the softmaxes absorb, worked out by hand.
    (That share is large with random weights: 60 % to 280 % of the score on this model over seeds 0 to 3.)"""
    model = tiny_vit(bias=False, class_token=False, positions=False)
    torch.manual_seed(2)
    x, targets = torch.randn(3, 3, 12, 12, dtype=torch.float64), [0, 1, 2]
    cp = strictly(explain.AttnLRP(model, conservative=True).explain, x, target=targets).diagnostics
    torch.testing.assert_close(cp["relevance_sum"], cp["output_relevance"], rtol=1e-6, atol=0)
    assert (cp["conservation_error"].abs() <= 1e-6 * cp["output_relevance"].abs()).all()
    attnlrp = strictly(explain.AttnLRP(model).explain, x, target=targets).diagnostics
    absorbed = torch.tensor([[relevance_by_hand(model, x[n], t).absorbed] for n, t in enumerate(targets)])
    assert (absorbed.abs() > 0.05 * attnlrp["output_relevance"].abs()).all()  # a real share, not rounding
    torch.testing.assert_close(attnlrp["relevance_sum"].double(), attnlrp["output_relevance"].double() - absorbed,
                               rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ 3. lxt 2.x, the authors' library


@contextmanager
def restored(*attributes: tuple[object, str]) -> Iterator[None]:
    """Each (owner, name) set back as found when the block ends (deleted if it was not there): lxt patches classes
    and modules globally."""
    missing = object()
    saved = [(owner, name, vars(owner).get(name, missing)) for owner, name in attributes]
    try:
        yield
    finally:
        for owner, name, value in saved:
            if value is missing:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


@pytest.fixture
def lxt_efficient():
    """lxt.efficient's modules by name. Its package __init__ imports its model patches, which fail to import with
    transformers 5: the package is registered bare, and removed again with its modules."""
    spec = importlib.util.find_spec("lxt") if importlib.util.find_spec("zennit") else None
    if spec is None or spec.origin is None:
        pytest.skip("lxt and zennit are needed")
    before = set(sys.modules)
    if "lxt.efficient" not in sys.modules:
        package = types.ModuleType("lxt.efficient")
        package.__path__ = [str(Path(spec.origin).parent / "efficient")]
        sys.modules["lxt.efficient"] = package
    try:
        yield lambda name: importlib.import_module("lxt.efficient." + name)
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("lxt.efficient"):
                del sys.modules[name]


LXT_TARGETS = [1, 3, 0, 4]


def lxt_relevance(model: nn.Module, x: Tensor, targets: list[int], logits=lambda output: output) -> Tensor:
    """lxt's recipe: frozen parameters, each image alone, input × its gradient."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    relevances = []
    for image, target in zip(x, targets):
        image = image[None].clone().requires_grad_(True)
        logits(model(image))[0, target].backward()
        relevances.append((image * image.grad)[0])
    return torch.stack(relevances)


def torchvision_vit_64() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16,
                                                mlp_dim=32, num_classes=5)
    nn.init.normal_(model.heads.head.weight, std=0.5)  # torchvision initialises it to zero
    return model.double().eval()


@pytest.mark.parametrize("gamma", [False, True], ids=["lrp-0", "gamma"])
def test_cp_lrp_on_torchvisions_vit_equals_lxt(lxt_efficient, gamma):
    """lxt supports torchvision's ViT in its CP-LRP variant only (its nn.MultiheadAttention patch); with ``gamma``,
    zennit's Gamma rule on the convolution (γ = 0.25) and linear layers (γ = 0.05) as lxt patches it."""
    options = {"linear_gamma": 0.05, "conv_gamma": 0.25} if gamma else {}
    torch.manual_seed(1)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    explanation = strictly(explain.AttnLRP(torchvision_vit_64(), conservative=True, **options).explain, x,
                           target=LXT_TARGETS)
    assert explanation.diagnostics["unruled"] == []
    assert ("gamma: 6" in explanation.diagnostics["rules"]) == gamma  # the conv, 2 × 2 MLP linears, the head
    patches = lxt_efficient("patches")
    zennit_patches = lxt_efficient("zennit_patches")
    from zennit.composites import LayerMapComposite
    from zennit.core import BasicHook
    from zennit.rules import Gamma

    with restored(*[(cls, name) for cls in (nn.GELU, nn.LayerNorm, nn.MultiheadAttention)
                    for name in ("forward", "original_forward")], (BasicHook, "forward"), (BasicHook, "backward")):
        patches.patch_method(patches.non_linear_forward, nn.GELU, keep_original=True)
        patches.patch_method(patches.layer_norm_forward, nn.LayerNorm)
        patches.patch_method(patches.cp_multi_head_attention_forward, nn.MultiheadAttention, keep_original=True)
        model = torchvision_vit_64()
        composite = None
        if gamma:
            zennit_patches.monkey_patch_zennit()
            composite = LayerMapComposite([(nn.Conv2d, Gamma(0.25)), (nn.Linear, Gamma(0.05))])
            composite.register(model)
        try:
            reference = lxt_relevance(model, x, LXT_TARGETS)
        finally:
            if composite is not None:
                composite.remove()
    assert nn.GELU.forward is not patches.non_linear_forward and not hasattr(nn.GELU, "original_forward")
    error = relative_error(explanation.attributions[:, 0], reference)
    assert error <= 1e-4, f"relative error {error:.3g}"  # measured: 1e-15 (LRP-0), 2e-15 (γ)


def hf_vit(implementation: str, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                    image_size=32, patch_size=8, num_labels=5)
    model = transformers.ViTForImageClassification._from_config(config, attn_implementation=implementation)
    nn.init.normal_(model.classifier.weight, std=0.5)
    return model.to(dtype).eval()


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attnlrp_on_huggingface_vit_equals_lxt(lxt_efficient, implementation):
    """AttnLRP proper (softmax rule, uniform rule on QKᵀ and A·V): lxt wraps HuggingFace's eager attention function
    (q, k gradients ÷ 4, v ÷ 2); ours is checked with eager attention and with fused ``sdpa``."""
    torch.manual_seed(1)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    explanation = strictly(explain.AttnLRP(hf_vit(implementation), output="logits").explain, x, target=LXT_TARGETS)
    assert explanation.diagnostics["unruled"] == []
    patches = lxt_efficient("patches")
    from transformers.activations import GELUActivation
    from transformers.models.vit import modeling_vit

    with restored(*[(cls, name) for cls in (GELUActivation, nn.LayerNorm) for name in ("forward", "original_forward")],
                  (modeling_vit, "eager_attention_forward"), (modeling_vit, "ALL_ATTENTION_FUNCTIONS")):
        patches.patch_method(patches.non_linear_forward, GELUActivation, keep_original=True)
        patches.patch_method(patches.layer_norm_forward, nn.LayerNorm)
        modeling_vit.eager_attention_forward = patches.wrap_attention_forward(modeling_vit.eager_attention_forward)
        reference = lxt_relevance(hf_vit("eager"), x, LXT_TARGETS, lambda output: output.logits)
    assert not hasattr(GELUActivation, "original_forward")
    error = relative_error(explanation.attributions[:, 0], reference)
    assert error <= 1e-4, f"relative error {error:.3g}"  # measured: 3e-16 (eager), 7e-8 (sdpa)


# ------------------------------------------------------------------ 4. the model families


def timm_vit(fused: bool = True, **options) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_heads=2, embed_dim=16, num_classes=5, **options)
    for block in model.blocks:
        block.attn.fused_attn = fused
    return model


def timm_named(name: str, **options) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=5, **options)


def timm_swin(v2: bool) -> nn.Module:
    model = timm_named("swinv2_tiny_window8_256" if v2 else "swin_tiny_patch4_window7_224", img_size=32, embed_dim=16,
                       depths=(2, 2), num_heads=(2, 2), window_size=4)
    with torch.no_grad():  # Swin v2 starts its post-norms at zero, which would leave the attention off the path
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1, 0.3)
    return model


def torchvision_swin(v2: bool) -> nn.Module:
    from torchvision.models import swin_transformer

    torch.manual_seed(0)
    extra = {"block": swin_transformer.SwinTransformerBlockV2,
             "downsample_layer": swin_transformer.PatchMergingV2} if v2 else {}
    return swin_transformer.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                            window_size=[4, 4], num_classes=5, **extra)


def hf_model(model_class: str, config_class: str, **config) -> nn.Module:
    torch.manual_seed(0)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))


SMALL = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
HF_SWIN = {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [2, 2], "num_heads": [2, 2],
           "window_size": 4, "num_labels": 5}


class Family:
    """A tiny model of one family (random weights, no download): ``build()``, input ``size``, ``output`` (the
    model output's field holding the scores), ``embedding`` (explained by EmbeddingSimilarity, not classes),
    ``windows`` (Swin's window attention)."""

    def __init__(self, build: Callable[[], nn.Module], size: int = 32, output: str | None = None,
                 embedding: bool = False, windows: bool = False):
        self.build, self.size, self.output, self.embedding, self.windows = build, size, output, embedding, windows

    def model(self, dtype=torch.float64) -> nn.Module:
        return self.build().to(dtype).eval()

    def inputs(self, model: nn.Module, count: int = 3, dtype=torch.float64):
        """(images, the batch's targets, image i's targets alone): different classes, or each image its own
        reference embedding."""
        torch.manual_seed(1)
        x = torch.randn(count, 3, self.size, self.size, dtype=dtype)
        if not self.embedding:
            classes = [0, 3, 1, 4, 2][:count]
            return x, classes, lambda i: classes[i]
        with torch.no_grad():
            output = model(x[:1])
        dim = getattr(output, self.output).shape[-1]
        references = torch.randn(count, 1, dim, dtype=dtype)
        return x, explain.EmbeddingSimilarity(references), lambda i: explain.EmbeddingSimilarity(references[i:i + 1])


FAMILIES = {
    "timm-vit-fused": Family(timm_vit),
    "timm-vit-eager": Family(lambda: timm_vit(fused=False)),
    "timm-deit-distilled": Family(lambda: timm_named("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8,
                                                     depth=2, num_heads=2, embed_dim=16)),
    "timm-dinov2-reg4": Family(lambda: timm_named("vit_small_patch14_reg4_dinov2", img_size=28, patch_size=7, depth=2,
                                                  num_heads=2, embed_dim=16, init_values=1.0), size=28),
    "hf-dinov2-registers": Family(lambda: hf_model(
        "Dinov2WithRegistersForImageClassification", "Dinov2WithRegistersConfig", **{**SMALL, "image_size": 28,
                                                                                     "patch_size": 7},
        mlp_ratio=2, num_register_tokens=4, num_labels=5), size=28, output="logits"),
    "hf-vit-sdpa": Family(lambda: hf_vit("sdpa"), output="logits"),
    "hf-vit-eager": Family(lambda: hf_vit("eager"), output="logits"),
    "hf-clip-vision": Family(lambda: hf_model("CLIPVisionModelWithProjection", "CLIPVisionConfig", **SMALL,
                                              intermediate_size=32, projection_dim=8),
                             output="image_embeds", embedding=True),
    "hf-siglip-vision": Family(lambda: hf_model("SiglipVisionModel", "SiglipVisionConfig", **SMALL,
                                                intermediate_size=32), output="pooler_output", embedding=True),
    "torchvision-vit": Family(torchvision_vit_64),
    "timm-swin": Family(lambda: timm_swin(False), windows=True),
    "timm-swinv2": Family(lambda: timm_swin(True), windows=True),
    "torchvision-swin": Family(lambda: torchvision_swin(False), windows=True),
    "torchvision-swinv2": Family(lambda: torchvision_swin(True), windows=True),
    "hf-swin": Family(lambda: hf_model("SwinForImageClassification", "SwinConfig", **HF_SWIN), output="logits",
                      windows=True),
    "hf-swinv2": Family(lambda: hf_model("Swinv2ForImageClassification", "Swinv2Config", **HF_SWIN),
                        output="logits", windows=True),
}


@pytest.mark.parametrize("gamma", [False, True], ids=["lrp-0", "gamma"])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_a_batch_equals_its_images_alone_and_every_call_on_the_path_has_a_rule(name, gamma):
    family = FAMILIES[name]
    model = family.model()
    x, targets, alone = family.inputs(model)
    options = {"linear_gamma": 0.1, "conv_gamma": 0.25} if gamma else {}
    explainer = explain.AttnLRP(model, output=family.output, **options)
    together = strictly(explainer.explain, x, target=targets)  # an unruled call would warn
    diagnostics = together.diagnostics
    assert diagnostics["unruled"] == []
    applied = dict(rule.split(": ") for rule in diagnostics["rules"])
    assert int(applied.get("attention", 0)) + int(applied.get("softmax", 0)) >= 2, diagnostics["rules"]
    assert int(applied["identity"]) >= 2 and int(applied["norm"]) >= 5, diagnostics["rules"]
    assert (applied.get("gamma") == str(int(applied["linear"]) + int(applied["convolution"]))) == gamma
    assert together.attributions.abs().amax() > 0
    for i in range(len(x)):
        single = strictly(explainer.explain, x[i : i + 1], target=alone(i))
        error = relative_error(together.attributions[i], single.attributions[0])
        assert error <= 1e-6, f"image {i}: relative error {error:.3g}"


CONSTANTS = ("bias", "cls_token", "class_token", "class_embedding", "pos_embed", "pos_embedding",
             "position_embedding", "reg_token", "register_tokens", "dist_token")


def constants_zeroed(model: nn.Module) -> nn.Module:
    """Every bias, and the class, distillation and register tokens and position embeddings, set to zero: nothing on
    the path adds relevance of its own (a zero token or offset has relevance 0 × gradient)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(constant in name for constant in CONSTANTS):
                parameter.zero_()
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_without_biases_conserves_relevance_with_cp_lrp(name):
    """CP-LRP, the softmax held constant: every other rule conserves, so Σ input relevance = the score (a logit or
    the cosine similarity to a reference, whose norms are held constant). Swin's position biases and shift masks
    are added to the scores, which CP-LRP holds constant with the softmax. Measured: 1e-10 to 3e-8."""
    family = FAMILIES[name]
    model = constants_zeroed(family.model())
    x, targets, _ = family.inputs(model)
    diagnostics = strictly(explain.AttnLRP(model, output=family.output, conservative=True).explain, x,
                           target=targets).diagnostics
    error = diagnostics["conservation_error"].abs() / diagnostics["output_relevance"].abs()
    assert error.max() <= 1e-6, error


def clip_with_prompts():
    """A small CLIPModel (docs/transformers.md), 2 images, 3 prompts as the model's other input."""
    torch.manual_seed(0)
    clip = transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=1000, bos_token_id=0, eos_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8), projection_dim=16))
    pixels, prompts = torch.randn(2, 3, 32, 32, dtype=torch.float64), torch.randint(2, 1000, (3, 7))
    call = {"output": "logits_per_image"}
    inputs = {"forward_kwargs": {"input_ids": prompts}, "input_position": "pixel_values", "per_image": []}
    return clip.double().eval(), pixels, call, inputs


def test_a_clip_model_scoring_images_against_prompts_is_ruled_and_conserves_with_cp_lrp():
    """logits_per_image = scale · (e / ‖e‖) · tᵀ: CLIP computes ‖e‖ as a power ½ (``_get_vector_norm``), a divisor
    held constant as sqrt is; the text tower is not on the image's path."""
    clip, pixels, call, inputs = clip_with_prompts()
    together = strictly(explain.AttnLRP(clip, **call).explain, pixels, target=[[0, 1, 2], [2, 0, 1]], **inputs)
    assert together.diagnostics["unruled"] == []
    for i, targets in enumerate([[0, 1, 2], [2, 0, 1]]):
        alone = strictly(explain.AttnLRP(clip, **call).explain, pixels[i : i + 1], target=[targets], **inputs)
        assert relative_error(together.attributions[i], alone.attributions[0]) <= 1e-6
    constants_zeroed(clip)
    diagnostics = strictly(explain.AttnLRP(clip, conservative=True, **call).explain, pixels,
                           target=[[0, 1, 2]] * 2, **inputs).diagnostics
    assert (diagnostics["conservation_error"].abs() <= 1e-6 * diagnostics["output_relevance"].abs()).all()


class EagerSelfAttention(nn.Module):
    """An nn.MultiheadAttention's batch-first self-attention written out with its own weights."""

    def __init__(self, attention: nn.MultiheadAttention):
        super().__init__()
        self.attention = attention  # its weights; its forward is not called

    def forward(self, query: Tensor, key: Tensor, value: Tensor, need_weights: bool = False):
        weights, count, tokens, dim = self.attention, *query.shape
        heads = weights.num_heads
        q, k, v = F.linear(query, weights.in_proj_weight, weights.in_proj_bias).reshape(
            count, tokens, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        attention = (q @ k.transpose(-2, -1) / math.sqrt(dim // heads)).softmax(dim=-1)
        return weights.out_proj((attention @ v).transpose(1, 2).reshape(count, tokens, dim)), None


def torchvision_vit_eager() -> nn.Module:
    """torchvision_vit_64 with each nn.MultiheadAttention (fused, F.multi_head_attention_forward) written out."""
    model = torchvision_vit_64()
    for layer in model.encoder.layers:
        layer.self_attention = EagerSelfAttention(layer.self_attention)
    return model


FUSED_AND_EAGER = {
    "timm": (timm_vit, lambda: timm_vit(fused=False), None),
    "huggingface": (lambda: hf_vit("sdpa"), lambda: hf_vit("eager"), "logits"),
    "torchvision": (torchvision_vit_64, torchvision_vit_eager, None),
}


@pytest.mark.parametrize("library", FUSED_AND_EAGER)
@pytest.mark.parametrize("conservative", [False, True], ids=["attnlrp", "cp-lrp"])
def test_fused_and_eager_attention_give_the_same_relevance(library, conservative):
    """Fused (timm's F.scaled_dot_product_attention, HuggingFace sdpa, nn.MultiheadAttention) against the same
    weights computed with explicit products and softmax, where the rules act call by call."""
    *builders, output = FUSED_AND_EAGER[library]
    torch.manual_seed(1)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    relevances = [strictly(explain.AttnLRP(build().double().eval(), output=output, conservative=conservative).explain,
                           x, target=[0, 3, 1]).attributions for build in builders]
    assert relative_error(*relevances) <= 1e-6


class LatentQueryPool(nn.Module):
    """Tokens → a learned query (a parameter, not on the input's path) attending over them → a linear head, with
    fused attention, or the same written out."""

    def __init__(self, fused: bool, dim: int = 8, classes: int = 3):
        super().__init__()
        self.fused = fused
        self.embed = nn.Conv2d(3, dim, 4, stride=4)
        self.query = nn.Parameter(torch.randn(1, 1, dim))
        self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        q, k, v = self.query.expand(len(x), -1, -1), self.key(tokens), self.value(tokens)
        if self.fused:
            pooled = F.scaled_dot_product_attention(q, k, v)
        else:
            pooled = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1) @ v
        return self.head(pooled[:, 0])


def test_a_learned_query_is_not_on_the_path_so_the_fused_key_gets_half_not_a_quarter():
    """Attention pooling with a learned query (SigLIP's and timm's attention-pool heads): QKᵀ has one factor on
    the input's path, so the key keeps the relevance of the scores (÷ 2 from A·V only, as the eager products give),
    although the query requires a gradient."""
    relevances = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = LatentQueryPool(fused).double().eval()
        torch.manual_seed(1)
        relevances.append(strictly(explain.AttnLRP(model).explain, torch.randn(2, 3, 12, 12, dtype=torch.float64),
                                   target=[0, 2]).attributions)
    assert relative_error(*relevances) <= 1e-10


# ------------------------------------------------------------------ 5. a hostile caller


def float_vit() -> nn.Module:
    return timm_vit().eval()


@pytest.mark.parametrize("method", ["attnlrp", "transformerattribution", "attnlrprollout"])
def test_inside_no_grad_and_inference_mode_the_maps_are_those_outside(method):
    cls = explain.get_method(method)
    model = float_vit()
    torch.manual_seed(1)
    x = torch.randn(3, 3, 32, 32)
    outside = cls(model).explain(x, target=[0, 3, 1]).raw_maps
    assert outside.abs().amax() > 0
    with torch.no_grad():
        inside_no_grad = cls(model).explain(x, target=[0, 3, 1]).raw_maps
        assert not torch.is_grad_enabled()
    with torch.inference_mode():
        inside_inference = cls(model).explain(x.clone(), target=[0, 3, 1]).raw_maps
        assert torch.is_inference_mode_enabled()
    torch.testing.assert_close(inside_no_grad, outside, rtol=0, atol=0)
    torch.testing.assert_close(inside_inference, outside, rtol=0, atol=0)


def test_under_bf16_autocast_the_maps_are_float32_close_to_float32_and_a_warning_says_why():
    model = float_vit()
    torch.manual_seed(1)
    x = torch.randn(3, 3, 32, 32)
    reference = explain.AttnLRP(model).explain(x, target=[0, 3, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(RuntimeWarning, match=r"AttnLRP ran in bfloat16 \(torch.autocast\)"):
            mixed = explain.AttnLRP(model).explain(x, target=[0, 3, 1])
    assert mixed.maps.dtype == torch.float32 and mixed.attributions.dtype == torch.float32
    assert torch.isfinite(mixed.attributions).all()
    assert torch.corrcoef(torch.stack([mixed.maps.flatten(), reference.maps.flatten()]))[0, 1] > 0.99


@pytest.mark.parametrize("grad_enabled", [False, True])
def test_another_thread_serving_the_model_sees_the_plain_model_while_it_is_explained(grad_enabled):
    from test_threads import Server

    model = float_vit()
    torch.manual_seed(1)
    served, explained = torch.randn(3, 3, 32, 32), torch.randn(2, 3, 32, 32)
    expected = {cls: cls(model).explain(explained, target=[1, 3]).attributions for cls in (explain.AttnLRP,)}
    expected_rows = explain.TransformerAttribution(model).explain(explained, target=[1, 3]).raw_maps
    with Server(model, served, grad_enabled) as server:
        for _ in range(4):
            torch.testing.assert_close(explain.AttnLRP(model).explain(explained, target=[1, 3]).attributions,
                                       expected[explain.AttnLRP])
            torch.testing.assert_close(explain.TransformerAttribution(model).explain(explained, target=[1, 3]).raw_maps,
                                       expected_rows)
    assert server.rounds > 5, "the serving thread hardly ran"
    assert not server.problems, server.problems[:5]


class Exploding(nn.Module):
    """An activation that raises when armed: an exception in the middle of the forward pass."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            raise RuntimeError("exploded mid-forward")
        return F.gelu(x)


@pytest.mark.parametrize("method", ["attnlrp", "transformerattribution", "attnlrprollout"])
def test_the_model_is_left_exactly_as_found_after_success_and_after_an_exception_mid_forward(method):
    cls = explain.get_method(method)
    model = tiny_vit().float()
    model.blocks[1].act = Exploding()
    model.train()
    model.blocks[0].eval()
    model.head.weight.requires_grad_(False)
    before = model_state(model)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 12, 12)
    explainer = cls(model)
    first = explainer.explain(x, target=[0, 2])
    assert_state_equal(before, model_state(model))
    model.blocks[1].act.armed = True
    with pytest.raises(RuntimeError, match="exploded mid-forward"):
        explainer.explain(x, target=[0, 2])
    model.blocks[1].act.armed = False
    assert_state_equal(before, model_state(model))
    assert torch._C._len_torch_function_stack() == 0 and torch.is_grad_enabled()
    torch.testing.assert_close(explainer.explain(x, target=[0, 2]).raw_maps, first.raw_maps, rtol=0, atol=0)
    with torch.no_grad():  # nothing left running on a plain forward
        model.eval()(x)
    assert_state_equal({**before, "training": model_state(model)["training"]}, model_state(model))


class Hybrid(nn.Module):
    """A convolutional stem (BatchNorm, in-place ReLU and SiLU, GELU) → tokens → nn.TransformerEncoder → head."""

    def __init__(self, inplace: bool, dim: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=inplace),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.SiLU(inplace=inplace),
                                  nn.Conv2d(8, dim, 4, stride=4), nn.GELU())
        layer = nn.TransformerEncoderLayer(dim, 2, dim_feedforward=32, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(self.stem(x).flatten(2).transpose(1, 2)).mean(dim=1))


def test_in_place_activations_get_the_relevance_of_the_same_activations_out_of_place():
    """nn.SiLU(inplace=True) overwrites its input: the identity rule y / x needs x as it was (the module's own
    output over its overwritten input would give 1, the plain gradient of SiLU then following)."""
    torch.manual_seed(1)
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    relevances = []
    for inplace in (True, False):
        torch.manual_seed(0)
        model = Hybrid(inplace).double().eval()
        explanation = strictly(explain.AttnLRP(model).explain, x, target=[0, 3, 1])
        assert explanation.diagnostics["unruled"] == []
        relevances.append(explanation.attributions)
    assert relative_error(*relevances) <= 1e-10


def relevance_of_one_activation_by_hand(first: nn.Linear, second: nn.Linear, activation, x: Tensor) -> Tensor:
    """f(x) = w₂ · a(W₁ x), no biases, the identity rule at a: R_x = x ⊙ W₁ᵀ (a(u) / u ⊙ w₂)."""
    u = x @ first.weight.T
    return x * ((activation(u) / u * second.weight[0]) @ first.weight)


class QuickGELU(nn.Module):  # CLIP's x · σ(1.702 x), as a user writes it for timm's act_layer
    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


@pytest.mark.parametrize("activation", [QuickGELU, transformers.activations.NewGELUActivation])
def test_an_activation_module_made_of_several_calls_gets_the_identity_rule_whole(activation):
    """x · σ(1.702 x) and 0.5 x (1 + tanh(c (x + 0.044715 x³))) are products of path tensors inside: taken call by
    call they would get the uniform rule; as activation modules (no parameters, no submodules, an activation's
    name) each is one elementwise function, y / x."""
    torch.manual_seed(0)
    first, second = nn.Linear(6, 5, bias=False).double(), nn.Linear(5, 1, bias=False).double()
    model = nn.Sequential(nn.Flatten(), first, activation(), second).eval()
    x = torch.randn(4, 3, 1, 2, dtype=torch.float64)  # images of 3 × 1 × 2 pixels: 6 features
    explanation = strictly(explain.AttnLRP(model).explain, x, target=[0] * 4)
    with torch.no_grad():
        expected = relevance_of_one_activation_by_hand(first, second, activation(), x.flatten(1))
    assert explanation.diagnostics["rules"] == ["identity: 1", "linear: 2"]
    assert relative_error(explanation.attributions[:, 0].flatten(1), expected) <= 1e-8


def test_timm_vits_with_a_custom_activation_module_and_a_gated_mlp_are_ruled_and_conserve_with_cp_lrp():
    """act_layer=QuickGELU (identity rule, whole) and SwiGLU's gate (the uniform rule on SiLU(x W_g) ⊙ x W_x: with
    the plain gradient the gated product would count its relevance twice, breaking conservation)."""
    torch.manual_seed(1)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    for options, uniform in [({"act_layer": QuickGELU}, 0), ({"mlp_layer": timm.layers.SwiGLU, "act_layer": nn.SiLU},
                                                             2)]:
        model = constants_zeroed(timm_vit(class_token=False, global_pool="avg", pos_embed="none", **options))
        model = model.double().eval()
        explanation = strictly(explain.AttnLRP(model).explain, x, target=[0, 3, 1])
        applied = dict(rule.split(": ") for rule in explanation.diagnostics["rules"])
        assert applied["identity"] == "2" and int(applied.get("uniform", 0)) == uniform, applied
        cp = strictly(explain.AttnLRP(model, conservative=True).explain, x, target=[0, 3, 1]).diagnostics
        assert (cp["conservation_error"].abs() <= 1e-6 * cp["output_relevance"].abs()).all()


class Gated(nn.Module):
    """b(a(x) ⊙ c(x)), no biases: the product written as ``h * g``, ``h *= g`` or, with ``square``, ``h * h``."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.a, self.c, self.b = (nn.Linear(6, 4, bias=False), nn.Linear(6, 4, bias=False),
                                  nn.Linear(4, 2, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1)
        h, g = self.a(x), self.c(x)
        if self.form == "in place":
            h *= g
            return self.b(h)
        return self.b(h * h if self.form == "square" else h * g)


def test_a_product_of_two_path_tensors_in_place_or_of_a_tensor_with_itself_gets_the_uniform_rule():
    """Each factor's share is counted by occurrence (h * h has two factors, as h ** 2 would get all), and an
    in-place product is computed out of place and written back (a rescaled factor cannot be written in place)."""
    torch.manual_seed(1)
    x = torch.randn(3, 3, 1, 2, dtype=torch.float64)
    relevances = {}
    for form in ("product", "in place", "square"):
        torch.manual_seed(0)
        explanation = strictly(explain.AttnLRP(Gated(form).double().eval()).explain, x, target=[0, 1, 0])
        diagnostics = explanation.diagnostics
        assert diagnostics["rules"] == ["linear: 3", "uniform: 1"], form
        torch.testing.assert_close(diagnostics["relevance_sum"], diagnostics["output_relevance"], msg=form)
        relevances[form] = explanation.attributions
    assert relative_error(relevances["in place"], relevances["product"]) <= 1e-12


class Snake(nn.Module):  # x + sin²(x): no rule for sin, and not an activation by its name
    def forward(self, x: Tensor) -> Tensor:
        return x + torch.sin(x) ** 2


def test_a_function_without_a_rule_is_named_in_a_warning_and_the_diagnostics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), Snake(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()
    with pytest.warns(RuntimeWarning, match=r"AttnLRP: no AttnLRP rule for 1: sin on the input's path"):
        explanation = explain.AttnLRP(model).explain(torch.randn(2, 3, 8, 8), target=[0, 1])
    assert explanation.diagnostics["unruled"] == ["1: sin"]


@pytest.mark.parametrize("method", ["attnlrp", "transformerattribution", "attnlrprollout"])
def test_a_target_that_explains_inside_the_call_gets_the_maps_it_gets_alone(method):
    """The score is selected with the rules on (a cosine similarity's norms are held constant): a target callable
    that runs other explainers, this one included, on the same model still gets their plain results."""
    cls = explain.get_method(method)
    model = float_vit()
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32)
    inner = {"gradcam": explain.GradCAM(model), "saliency": explain.Saliency(model), "same": cls(model)}
    expected = {name: quietly(explainer.explain, x, target=[1, 2]).raw_maps for name, explainer in inner.items()}
    alone = cls(model).explain(x, target=[3, 3]).raw_maps
    seen = {}

    def target_that_explains(output):
        seen.update({name: quietly(explainer.explain, x, target=[1, 2]).raw_maps for name, explainer in inner.items()})
        return output[:, 3]

    nested = cls(model).explain(x, target=target_that_explains)
    torch.testing.assert_close(nested.raw_maps, alone)
    for name, maps in expected.items():
        torch.testing.assert_close(seen[name], maps, msg=name)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # interrupted generator finalisers
@pytest.mark.usefixtures("python_sigint_handler")
def test_an_interrupt_at_any_signal_point_leaves_the_model_and_the_thread_as_found():
    """Ctrl-C landing anywhere in a call of each new transformer method (tests/test_interrupts.py's interrupter,
    which handles SIGINT at the k-th instant CPython could): hooks, flags, modes and grad mode as before the call."""
    import random
    import threading

    from conftest import SmallViT
    from test_interrupts import SignalPointInterrupter, thread_state

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread")
    torch.manual_seed(0)
    model = SmallViT().train()
    model.encoder.eval()
    model.head.weight.requires_grad_(False)
    x = torch.randn(2, 3, 16, 16)
    before, thread_before = model_state(model), thread_state()
    interrupter, rng = SignalPointInterrupter(), random.Random(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for cls in (explain.AttnLRP, explain.TransformerAttribution, explain.LeGrad):
            explainer = cls(model)
            expected = explainer.explain(x, target=[1, 2]).raw_maps
            call = functools.partial(explainer.explain, x, target=[1, 2])
            points = interrupter.run(call)
            interrupted = 0
            for _ in range(15):
                position = rng.randint(1, points)
                try:
                    interrupter.run(call, position)
                except KeyboardInterrupt:
                    interrupted += 1
                assert thread_state() == thread_before, f"{cls.__name__}: signal point {position} of {points}"
                assert_state_equal(before, model_state(model))
            assert interrupted >= 13
            torch.testing.assert_close(explainer.explain(x, target=[1, 2]).raw_maps, expected)
