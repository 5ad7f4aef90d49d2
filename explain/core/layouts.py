"""Turn a layer's output into (N, C, h, w) feature maps, whatever its layout.

- (N, C, h, w), channels first (CNNs): as it is;
- (N, h, w, C), channels last (Swin, timm ConvNeXt blocks): permuted;
- (N, T, D) tokens (ViT, DeiT, with class, distillation or register tokens in front): the
  prefix tokens are dropped and the rest laid out on the h × w patch grid (so any input size
  works, not only 224 px). The prefix tokens and the patch grid are read from the model where it
  states them (``model_tokens``: timm, torchvision, HuggingFace, CLIP), else inferred from the
  token count and the input's aspect ratio (``token_grid``). CAMs and attention methods read
  tokens through the same ``token_layout``.

Where the patch embedding is one convolution with stride = kernel = p (timm, torchvision,
HuggingFace, CLIP), the h × w grid spans the input's top-left h·p × w·p pixels: fewer than the
input's where the convolution drops the pixels past the last whole patch (HuggingFace DINOv2, ViT
with ``interpolate_pos_encoding``, an ``img_size`` that is not a multiple of p), more where the
embedding pads the input at the bottom and right (timm's ``dynamic_img_pad``). ``Layout.to_input``
then places a map on those pixels and 0 on the border the model never reads. Where the grid is
inferred or the stem is something else (a conv stem, a hybrid's backbone), the patch size is not
known and maps span the whole input, as they do where the grid divides it.

``reshape=`` overrides the guess: "channels_first", "channels_last", an (h, w) grid for tokens
(the last h·w tokens are the patches; checked against the token count), or a callable
tensor → (N, C, h, w).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .caller import warn_at_callers_line

Reshape = Union[None, str, Sequence[int], Callable[[Tensor], Tensor]]
MAX_PREFIX_TOKENS = 8
SPATIAL_FIT = 0.2
"""How far (in log ratio of the two axes' strides) a (h, w) may be from a downsampled input."""



@dataclass(frozen=True)
class Layout:
    """How a layer's output maps to (N, C, h, w). kind: "channels_first", "channels_last",
    "tokens" or "callable"; for tokens: prefix, the tokens before the patches (class,
    distillation, register); grid, the patches' (h, w); class_token, whether token 0 is a class
    token; readout, what the model's head reads (one of ``READOUTS``): "class" (the class token), "mean" (the
    average of the patch tokens), "all" (the average of every token, class and register tokens included: timm's
    ``pool_include_prefix=True``), "class+distillation" (the mean of the class and distillation tokens' logits: DeiT
    distilled) or "class+mean" (the class token and the patch tokens' average, concatenated: HF DINOv2); covered,
    the (rows, columns) of input pixels from the top-left that the patch grid spans where that is not the whole
    input (see ``to_input``), else None."""

    kind: str
    prefix: int = 0
    grid: Optional[tuple[int, int]] = None
    function: Optional[Callable[[Tensor], Tensor]] = None
    class_token: bool = False
    readout: str = "mean"
    covered: Optional[tuple[int, int]] = None
    read: Optional[tuple[int, int]] = None
    """Where fewer than ``covered``: the (rows, columns) from the top-left that the patch embedding reads (a later
    stage of a hierarchical transformer, whose 2 × 2 merges padded the grid past the pixels read)."""

    @property
    def channel_dim(self) -> int:
        """The dimension of the layer's output that holds the channels."""
        return 1 if self.kind == "channels_first" else -1

    def apply(self, tensor: Tensor) -> Tensor:
        """The layer's output (any layout) → (N, C, h, w), a view where possible."""
        if self.kind == "callable":
            assert self.function is not None, "a callable layout is made with its function"
            return self.function(tensor)
        if self.kind == "channels_first":
            return tensor
        if self.kind == "channels_last":
            return tensor.permute(0, 3, 1, 2)
        assert self.grid is not None, "a token layout is made with its grid"
        height, width = self.grid
        return tensor[:, self.prefix :, :].reshape(tensor.shape[0], height, width, -1).permute(0, 3, 1, 2)

    def to_input(self, maps: Tensor, input_size: Sequence[int]) -> Tensor:
        """(N, K, h, w) maps on this layout's grid → maps of the (H, W) input.

        Where the grid spans the whole input (``covered`` None): the maps as they are, for the caller's
        upsampling over the whole input. Otherwise (N, K, H, W) float32: the maps upsampled (bilinear,
        align_corners=False, as every map is upsampled to the input) onto the covered top-left
        rows × columns, cropped to the input where the patch embedding padded it, and 0 on the pixels
        past them, which the model never reads."""
        if self.covered is None:
            return maps
        rows, columns = self.covered
        read_rows, read_columns = self.read or self.covered
        height, width = min(rows, read_rows, int(input_size[0])), min(columns, read_columns, int(input_size[1]))
        spread = F.interpolate(maps.float(), size=(rows, columns), mode="bilinear", align_corners=False)
        placed = torch.zeros(*maps.shape[:-2], int(input_size[0]), int(input_size[1]), device=maps.device)
        placed[..., :height, :width] = spread[..., :height, :width]
        return placed


# ------------------------------------------------------------------ what a transformer says about its tokens

CLASS_TOKENS = ("cls_token", "class_token", "class_embedding")
"""Attribute names of a class token's embedding: timm and HuggingFace, torchvision, CLIP (HF, open_clip)."""
DISTILLATION_TOKENS = ("dist_token", "distillation_token")
REGISTER_TOKENS = ("reg_token", "register_tokens")
MEAN_READOUTS = ("avg", "avgmax", "max", "map", "avg_all", "gap")
"""Pooling names (timm's ``global_pool``, open_clip's ``pool_type``) of a head that reads the patch tokens."""
READOUTS = ("class", "mean", "all", "class+distillation", "class+mean")
"""What a head reads (``Layout.readout``): the class token; the patch tokens' average; every token's average (timm's
``pool_include_prefix=True``: the class and register tokens pooled with the patches); the class and distillation
tokens, each through its own linear head, the two logits averaged (timm's ``VisionTransformerDistilled`` in eval
mode, HF ``DeiTForImageClassificationWithTeacher``); the class token concatenated with the patch tokens' average
before one linear layer (HF ``Dinov2ForImageClassification``, with or without registers)."""
CLASS_AND_MEAN_HEADS = ("Dinov2ForImageClassification", "Dinov2WithRegistersForImageClassification")
ATTENTION_POOLS = ("AttentionPoolLatent", "SiglipMultiheadAttentionPoolingHead", "Siglip2MultiheadAttentionPoolingHead")
"""Attention-pooling heads: a learned query attending to the last block's tokens (timm's ``global_pool='map'``, HF
SigLIP's ``vision_model.head``)."""
POOL_BYPASSING_MODELS = ("SiglipForImageClassification", "Siglip2ForImageClassification")
"""Models that compute their tower's attention-pooling head but classify the mean of the tokens (HF SigLIP)."""


def attention_pooling_head(model: Optional[nn.Module]) -> Optional[str]:
    """The name of the attention-pooling head (``ATTENTION_POOLS``) whose output the model's head reads, else None:
    its weights of the tokens are its own attention to a learned query, which no row of the blocks' relevance
    holds. None also where the model is, or holds, one that computes such a head but does not read it
    (``POOL_BYPASSING_MODELS``: a user's module wrapping HF's SigLIP classifier)."""
    if model is None or any(type(module).__name__ in POOL_BYPASSING_MODELS for module in model.modules()):
        return None
    return next((name for name, module in model.named_modules() if type(module).__name__ in ATTENTION_POOLS), None)


def _two_token_readout(model: nn.Module, module: nn.Module) -> Optional[str]:
    """"class+distillation" or "class+mean" where the head reads two things (see ``READOUTS``), else None: timm's
    distilled ViT (``head_dist``, outside distilled training, where it returns the two heads' logits apart), HF's
    DeiT with teacher (``cls_classifier`` and ``distillation_classifier``), HF's DINOv2 classifiers."""
    if isinstance(getattr(module, "head_dist", None), nn.Module) and _token_count(getattr(module, "dist_token", None),
                                                                                 False):
        return None if getattr(module, "distilled_training", False) and module.training else "class+distillation"
    for outer in list(model.modules()):  # the HF model, or a module of the user's holding it (a list: see model_tokens)
        if isinstance(getattr(outer, "cls_classifier", None), nn.Module) and isinstance(
                getattr(outer, "distillation_classifier", None), nn.Module):
            return "class+distillation"
        if type(outer).__name__ in CLASS_AND_MEAN_HEADS:
            return "class+mean"
    return None


@dataclass(frozen=True)
class PatchEmbedding:
    """A patch embedding that is one convolution with stride = kernel = ``patch`` (rows, columns) pixels and no
    padding: an (H, W) input gives H // p × W // p patches (the pixels past the last whole patch are never read),
    or, when it ``pads`` the input at the bottom and right first (timm's ``dynamic_img_pad``), ⌈H / p⌉ × ⌈W / p⌉."""

    patch: tuple[int, int]
    pads: bool = False

    def grid(self, input_size: Sequence[int]) -> tuple[int, int]:
        """The (h, w) patch grid of an (H, W) input."""
        if self.pads:
            return (-(-int(input_size[0]) // self.patch[0]), -(-int(input_size[1]) // self.patch[1]))
        return int(input_size[0]) // self.patch[0], int(input_size[1]) // self.patch[1]

    def covered(self, grid: Sequence[int], input_size: Sequence[int]) -> Optional[tuple[int, int]]:
        """The (rows, columns) of input pixels from the top-left that an (h, w) grid of patches spans, h·p × w·p;
        None when that is the whole (H, W) input."""
        spanned = (int(grid[0]) * self.patch[0], int(grid[1]) * self.patch[1])
        return None if spanned == (int(input_size[0]), int(input_size[1])) else spanned


@dataclass(frozen=True)
class ModelTokens:
    """What a transformer's own attributes say about its tokens: ``prefix`` tokens in front of
    the patches (class, distillation and register tokens), whether the first is a class token,
    what the head reads (one of ``READOUTS``, see ``Layout``), its patch embedding where it is one
    convolution with stride = kernel (which tells the patch grid of an (H, W) input and the pixels
    it spans), and the module read (``source``)."""

    prefix: int
    class_token: bool
    readout: str
    source: str
    patch_embedding: Optional[PatchEmbedding] = field(default=None, compare=False)

    def describe(self) -> str:
        kind = "class, distillation or register" if self.class_token else "register"
        where = f"module {self.source!r}" if self.source else "the model"
        return f"{self.prefix} {kind} token(s) before the patches (as {where} states)"


def _token_count(value: object, registers: bool) -> int:
    """How many tokens an embedding parameter holds: (1, n, D) register tokens hold n, any other 1;
    0 for a missing one (None, or not a tensor)."""
    if not isinstance(value, Tensor):
        return 0
    return int(value.shape[-2]) if registers and value.dim() >= 2 else 1


def _patch_embedding(module: nn.Module) -> Optional[PatchEmbedding]:
    """The module's patch embedding where it is one convolution with stride = kernel = patch size and no padding
    (timm's ``patch_embed``, whose ``dynamic_img_pad`` pads the input first; else the module's only Conv2d, as in
    torchvision, HuggingFace and CLIP); None for other stems (a conv stem, a hybrid's backbone), whose grid the
    token count tells and whose reach is not known."""
    stem = module
    timm_embed = getattr(module, "patch_embed", None)
    if isinstance(timm_embed, nn.Module) and hasattr(timm_embed, "dynamic_feat_size") \
            and not hasattr(timm_embed, "backbone"):
        stem = timm_embed
    convolutions = [leaf for leaf in stem.modules() if isinstance(leaf, nn.Conv2d)]
    if len(convolutions) != 1:
        return None
    patchify = convolutions[0]
    kernel, stride, padding = patchify.kernel_size, patchify.stride, patchify.padding
    if kernel != stride or padding not in ((0, 0), "valid") or min(kernel) < 2:
        return None
    pads = stem is timm_embed and getattr(stem, "dynamic_img_pad", False) is True
    return PatchEmbedding((int(kernel[0]), int(kernel[1])), pads)


def _first_patch_embedding(model: nn.Module) -> Optional[PatchEmbedding]:
    """The model's first convolution, where it is a patch embedding (stride = kernel ≥ 2, no padding), as a Swin's
    is; None otherwise."""
    first = next((module for module in model.modules() if isinstance(module, nn.Conv2d)), None)
    if first is None:
        return None
    kernel, stride, padding = first.kernel_size, first.stride, first.padding
    if kernel != stride or padding not in ((0, 0), "valid") or min(kernel) < 2:
        return None
    return PatchEmbedding((int(kernel[0]), int(kernel[1])))


def stage_layout(model: nn.Module, grid: Sequence[int], input_size: Sequence[int]) -> Layout:
    """The channels-first Layout of a hierarchical transformer's (Swin's) (h, w) token grid, with the input pixels
    it spans: where the model's first convolution is a patch embedding of p pixels and the grid is its grid (H // p,
    or ⌈H / p⌉ where it pads the input) after m 2 × 2 merges (each padding an odd size, m = 0 for the first stage),
    token (i, j) spans the pixels [i·p·2^m, (i + 1)·p·2^m) × [j·p·2^m, (j + 1)·p·2^m), and ``to_input`` leaves 0
    on the pixels no patch reads. Spanning the whole input (no ``covered``) where no such embedding or merge count
    fits, or where a side of the grid is 1 (a merge count that cannot be told)."""
    embedding = _first_patch_embedding(model)
    height, width = int(input_size[0]), int(input_size[1])
    if embedding is None or min(int(grid[0]), int(grid[1])) < 2:
        return Layout("channels_first")
    rows, columns = embedding.patch
    bases = dict.fromkeys([(height // rows, width // columns), (-(-height // rows), -(-width // columns))])
    for merges in range(8):
        factor = 2 ** merges
        for base in bases:
            if (-(-base[0] // factor), -(-base[1] // factor)) != (int(grid[0]), int(grid[1])):
                continue
            spanned = (int(grid[0]) * rows * factor, int(grid[1]) * columns * factor)
            read = (base[0] * rows, base[1] * columns)
            covered = None if spanned == (height, width) and read == spanned else spanned
            return Layout("channels_first", covered=covered, read=None if read == spanned else read)
    return Layout("channels_first")


def model_tokens(model: Optional[nn.Module]) -> Optional[ModelTokens]:
    """The token layout a vision transformer states in its attributes (timm's ``num_prefix_tokens``,
    ``cls_token``, ``reg_token``, ``dist_token``, ``global_pool``; torchvision's ``class_token``;
    HuggingFace's ``cls_token``, ``distillation_token``, ``register_tokens``; CLIP's
    ``class_embedding``; the head's pooling: timm's ``global_pool``, open_clip's ``pool_type``,
    HuggingFace's ``config.use_mean_pooling``), from the outermost module that has them; None when
    no module does."""
    if model is None:
        return None
    # a list, not the generator: a return from the loop leaves no suspended generator, whose finalisation would
    # swallow a Ctrl-C that lands in it ("Exception ignored")
    for name, module in list(model.named_modules()):
        classes = sum(_token_count(getattr(module, attribute, None), False) for attribute in CLASS_TOKENS)
        distillation = sum(_token_count(getattr(module, attribute, None), False) for attribute in DISTILLATION_TOKENS)
        registers = sum(_token_count(getattr(module, attribute, None), True) for attribute in REGISTER_TOKENS)
        stated = getattr(module, "num_prefix_tokens", None)
        if not (classes or distillation or registers or isinstance(stated, int)):
            continue
        counted = classes + distillation + registers
        prefix = stated if isinstance(stated, int) and not isinstance(stated, bool) else counted
        pooling = getattr(module, "global_pool", getattr(module, "pool_type", None))
        mean_pooling = getattr(getattr(model, "config", None), "use_mean_pooling", False) is True  # HF BEiT
        reads_patches = not classes or mean_pooling or (isinstance(pooling, str) and pooling in MEAN_READOUTS)
        # timm's pool_include_prefix: the head pools the class and register tokens with the patches
        pools_prefix = prefix > 0 and getattr(module, "pool_include_prefix", False) is True
        readout = ("all" if pools_prefix else "mean") if reads_patches else _two_token_readout(model, module) or "class"
        return ModelTokens(prefix=prefix, class_token=classes > 0, readout=readout, source=name,
                           patch_embedding=_patch_embedding(module))
    return None


# ------------------------------------------------------------------ tokens on the patch grid


def _grid_of(patches: int, input_size: Sequence[int]) -> Optional[tuple[int, int]]:
    """(h, w) with h·w = patches, h, w ≥ 2 and h : w the input's aspect ratio; None when none fits."""
    height, width = input_size
    if patches < 4:
        return None
    rows = round(math.sqrt(patches * height / width))
    for candidate in (rows, rows - 1, rows + 1):
        if candidate >= 2 and patches % candidate == 0:
            columns = patches // candidate
            tolerance = max(height, width) / max(candidate, columns)
            if columns >= 2 and abs(candidate * width - columns * height) <= tolerance:
                return candidate, columns
    return None


def token_grid(tokens: int, input_size: Sequence[int]) -> tuple[int, tuple[int, int]]:
    """(prefix tokens, (h, w)) such that prefix + h·w = tokens, h, w ≥ 2 and h : w matches the
    input's aspect ratio, from the token count alone; the fewest prefix tokens win. Raises
    ValueError when no grid fits. ``token_layout`` also reads what the model states."""
    for prefix in range(0, min(MAX_PREFIX_TOKENS, tokens - 1) + 1):
        grid = _grid_of(tokens - prefix, input_size)
        if grid is not None:
            return prefix, grid
    raise ValueError(
        f"cannot lay {tokens} tokens out on a patch grid for a {input_size[0]}×{input_size[1]} input; "
        "pass reshape=(h, w) (the last h·w tokens are the patches) or a callable."
    )


def _prefixes(tokens: int, known: Optional[ModelTokens], whole_sequence: bool = False) -> list[int]:
    """The counts of tokens before the patches that a tensor of ``tokens`` tokens may have: the
    model's prefix, or none (a tensor of patch tokens only, unless ``whole_sequence``: the tokens
    are the model's whole sequence, as in its attention); 0 to MAX_PREFIX_TOKENS when the model
    states nothing."""
    if known is None:
        candidates: Sequence[int] = range(MAX_PREFIX_TOKENS + 1)
    else:
        candidates = [known.prefix] if whole_sequence else [known.prefix, 0]
    return [prefix for prefix in dict.fromkeys(candidates) if prefix < tokens]


def _fitting_grids(tokens: int, prefixes: Sequence[int], input_size: Sequence[int], most: int = 6) -> str:
    """The (h, w) grids with h·w = tokens − prefix, h, w ≥ 2, closest to the input's aspect ratio first."""
    found = []
    for prefix in prefixes:
        patches = tokens - prefix
        for rows in range(2, patches // 2 + 1):
            if patches % rows == 0:
                misfit = abs(math.log(rows * input_size[1] / (patches // rows * input_size[0])))
                found.append((misfit, prefix, (rows, patches // rows)))
    if not found:
        return "none"
    return ", ".join(f"{grid} after {prefix} prefix token(s)" for _, prefix, grid in sorted(found)[:most])


def _token_layout_of(prefix: int, grid: tuple[int, int], known: Optional[ModelTokens],
                     input_size: Sequence[int]) -> Layout:
    """The token Layout of ``prefix`` tokens before an (h, w) grid of patches; where the grid is the model's patch
    embedding's for this input, with the pixels it spans (``Layout.covered``)."""
    embedding = None if known is None else known.patch_embedding
    covered = None
    if embedding is not None and embedding.grid(input_size) == tuple(grid):
        covered = embedding.covered(grid, input_size)
    if prefix == 0:
        return Layout("tokens", prefix=0, grid=grid, class_token=False, readout="mean", covered=covered)
    if known is not None:
        return Layout("tokens", prefix=prefix, grid=grid, class_token=known.class_token, readout=known.readout,
                      covered=covered)
    return Layout("tokens", prefix=prefix, grid=grid, class_token=True, readout="class")


def checked_grid(reshape: Sequence[int], tokens: int, input_size: Sequence[int], known: Optional[ModelTokens] = None,
                 what: str = "the layer", whole_sequence: bool = False) -> Layout:
    """The token Layout for ``reshape=(h, w)``: the last h·w of ``tokens`` tokens are the patches.
    Raises ValueError, naming the token count and the grids that fit, unless the tokens before
    them are the model's prefix tokens, or none (or, when the model states nothing, at most
    MAX_PREFIX_TOKENS)."""
    try:
        values = tuple(operator.index(value) for value in reshape if not isinstance(value, bool))
    except TypeError:
        values = ()
    if len(values) != 2 or len(values) != len(reshape) or min(values) < 1:
        raise ValueError(f"reshape=(h, w) takes two positive ints, the patch grid; got {reshape!r}.")
    height, width = values
    prefixes = _prefixes(tokens, known, whole_sequence)
    prefix = tokens - height * width
    if prefix not in prefixes:
        stated = known.describe() if known is not None else f"at most {MAX_PREFIX_TOKENS} prefix tokens"
        raise ValueError(
            f"reshape={values} does not fit {what}: its {tokens} tokens are {stated} followed by the h·w patches, "
            f"so h·w must be {' or '.join(str(tokens - p) for p in prefixes) or 'positive'}, not {height * width}. "
            f"Grids that fit: {_fitting_grids(tokens, prefixes, input_size)}."
        )
    embedding = None if known is None else known.patch_embedding
    if embedding is not None:
        grid = embedding.grid(input_size)
        if grid != values and grid[0] * grid[1] == height * width:
            warn_at_callers_line(
                f"reshape={values} lays the {height * width} patch tokens of {what} out on another grid than the "
                f"model's patch embedding, which cuts this {input_size[0]}×{input_size[1]} input into {grid[0]} × "
                f"{grid[1]} patches of {embedding.patch[0]}×{embedding.patch[1]} pixels: each token's value lands on "
                f"another patch's pixels. Leave reshape out (or pass reshape={grid}).", UserWarning)
    return _token_layout_of(prefix, (height, width), known, input_size)


ModelOrTokens = Union[nn.Module, ModelTokens, None]
"""A model, or what ``model_tokens`` read of it (read once by a caller that lays out many tensors)."""


def stated_tokens(model: ModelOrTokens) -> Optional[ModelTokens]:
    """What a model states of its tokens (``model_tokens``), read now unless it was read before."""
    return model if isinstance(model, ModelTokens) else model_tokens(model)


def token_layout(tokens: int, input_size: Sequence[int], reshape: Optional[Sequence[int]] = None,
                 model: ModelOrTokens = None, what: str = "the layer", whole_sequence: bool = False) -> Layout:
    """The Layout of (N, ``tokens``, D) tokens for an (H, W) input, read the same way by every
    method (CAMs, attention methods). ``reshape=(h, w)``: that grid, checked (``checked_grid``).
    Otherwise, when ``model`` states its tokens (``model_tokens``): its prefix tokens (or none, as in
    a patch embedding's output; not when ``whole_sequence``, as for attention over every token) and
    its patch grid where the patch embedding tells it, else the grid with the input's aspect ratio;
    from the token count alone for other models (``token_grid``). Raises ValueError when no grid fits."""
    known = stated_tokens(model)
    if reshape is not None:
        return checked_grid(reshape, tokens, input_size, known, what, whole_sequence)
    if known is None:
        return _token_layout_of(*token_grid(tokens, input_size), None, input_size)
    prefixes = _prefixes(tokens, known, whole_sequence)
    if known.patch_embedding is not None:
        height, width = known.patch_embedding.grid(input_size)
        for prefix in prefixes:
            if prefix + height * width == tokens and min(height, width) >= 1:
                return _token_layout_of(prefix, (height, width), known, input_size)
    for prefix in prefixes:
        grid = _grid_of(tokens - prefix, input_size)
        if grid is not None:
            return _token_layout_of(prefix, grid, known, input_size)
    raise ValueError(
        f"cannot lay the {tokens} tokens of {what} out on a patch grid for a {input_size[0]}×{input_size[1]} input: "
        f"the model has {known.describe()}. Grids that fit: {_fitting_grids(tokens, prefixes, input_size)}; "
        "pass reshape=(h, w) (the last h·w tokens are the patches) or a callable."
    )


def _spatial_fit(spatial: Sequence[int], input_size: Sequence[int]) -> float:
    """How well (h, w) looks like a downsampled input: 0 for equal strides along both axes."""
    h, w = spatial
    if h < 1 or w < 1 or h > input_size[0] or w > input_size[1]:
        return math.inf
    return abs(math.log((input_size[0] / h) / (input_size[1] / w)))


def channel_evidence(module: Optional[nn.Module]) -> Optional[tuple[int, str]]:
    """(channel count, the layout that module type produces) of the last module, in registration
    order, that reveals its channel count: a convolution or BatchNorm (channels first), a Linear
    or LayerNorm (channels last); None when no such module is part of ``module``."""
    if module is None:
        return None
    for leaf in reversed(list(module.modules())):
        if isinstance(leaf, (nn.Conv2d, nn.ConvTranspose2d)):
            return leaf.out_channels, "channels_first"
        if isinstance(leaf, nn.BatchNorm2d):
            return leaf.num_features, "channels_first"
        if isinstance(leaf, nn.GroupNorm):
            return leaf.num_channels, "channels_first"
        if isinstance(leaf, nn.Linear):
            return leaf.out_features, "channels_last"
        if isinstance(leaf, nn.LayerNorm) and len(leaf.normalized_shape) == 1:
            return leaf.normalized_shape[0], "channels_last"
    return None


def _four_dimensional_layout(shape: Sequence[int], input_size: Sequence[int], module: Optional[nn.Module],
                             name: str) -> str:
    """"channels_first" or "channels_last" for a (N, a, b, c) output.

    The module decides where it can: the channel count of its last convolution, norm or linear
    layer is found at dimension 1 or 3 (a block that permutes back to channels first after a
    channels-last MLP is read right). Otherwise the shape does: the dimensions that look more like
    the input downsampled are the spatial ones. When both readings fit about equally well and
    nothing decides, it raises.
    """
    evidence = channel_evidence(module)
    if evidence is not None:
        channels, convention = evidence
        at_first, at_last = shape[1] == channels, shape[3] == channels
        if at_first != at_last:
            return "channels_first" if at_first else "channels_last"
        if at_first and at_last:
            return convention
    first, last = _spatial_fit(shape[2:], input_size), _spatial_fit(shape[1:3], input_size)
    if first < SPATIAL_FIT and last < SPATIAL_FIT and abs(first - last) < SPATIAL_FIT / 2:
        raise ValueError(
            f"layer {name!r} outputs {tuple(shape)} for a {input_size[0]}×{input_size[1]} input, which reads as "
            f"channels first ({shape[1]} channels on {shape[2]}×{shape[3]}) or channels last ({shape[3]} channels "
            f"on {shape[1]}×{shape[2]}), and nothing in the layer tells which. Pass reshape='channels_first' "
            "(CNNs) or reshape='channels_last' (Swin-like blocks)."
        )
    last_fits = last < SPATIAL_FIT and last < first
    return "channels_last" if last_fits else "channels_first"


def infer_layout(tensor: Tensor, input_size: Sequence[int], reshape: Reshape = None, name: str = "",
                 module: Optional[nn.Module] = None, model: ModelOrTokens = None) -> Layout:
    """The Layout of a layer's output for an input of ``input_size`` (H, W); ``module``, the layer,
    settles a 4-dimensional output whose shape reads both ways; ``model``, the whole model, states
    its prefix tokens and patch grid (``token_layout``)."""
    if callable(reshape):
        return Layout("callable", function=reshape)
    if isinstance(reshape, str):
        if reshape not in ("channels_first", "channels_last"):
            raise ValueError(
                f"reshape must be 'channels_first', 'channels_last', (h, w) or a callable; got {reshape!r}."
            )
        if tensor.dim() != 4:
            raise ValueError(
                f"reshape={reshape!r} needs a 4-dimensional output; layer {name!r} gives {tuple(tensor.shape)}."
            )
        return Layout(reshape)
    if reshape is not None and tensor.dim() != 3:
        raise ValueError(f"reshape={tuple(reshape)} needs (N, T, D) tokens; layer {name!r} gives "
                         f"{tuple(tensor.shape)}.")
    if tensor.dim() == 4:
        return Layout(_four_dimensional_layout(tensor.shape, input_size, module, name))
    if tensor.dim() == 3:
        return token_layout(tensor.shape[1], input_size, reshape, model, f"layer {name!r}")
    raise ValueError(
        f"layer {name!r} outputs a tensor of shape {tuple(tensor.shape)}; CAM methods need feature maps "
        "(N, C, h, w), (N, h, w, C) or tokens (N, T, D). Choose another layer (`explain layers MODEL` lists "
        "output shapes) or pass reshape=."
    )
