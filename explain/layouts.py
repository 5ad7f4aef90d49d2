"""Turn a layer's output into (N, C, h, w) feature maps, whatever its layout.

- (N, C, h, w), channels first (CNNs): as it is;
- (N, h, w, C), channels last (Swin, timm ConvNeXt blocks): permuted;
- (N, T, D) tokens (ViT, DeiT, with class, distillation or register tokens in front): the
  prefix tokens are dropped and the rest laid out on the h × w patch grid, inferred from the
  token count and the input's aspect ratio (so any input size works, not only 224 px).

``reshape=`` overrides the guess: "channels_first", "channels_last", an (h, w) grid for tokens
(the last h·w tokens are the patches), or a callable tensor → (N, C, h, w).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from torch import Tensor, nn

Reshape = Union[None, str, Sequence[int], Callable[[Tensor], Tensor]]
MAX_PREFIX_TOKENS = 8
SPATIAL_FIT = 0.2
"""How far (in log ratio of the two axes' strides) a (h, w) may be from a downsampled input."""



@dataclass(frozen=True)
class Layout:
    """How a layer's output maps to (N, C, h, w). kind: "channels_first", "channels_last",
    "tokens" or "callable"; prefix: tokens before the patches; grid: (h, w) for tokens."""

    kind: str
    prefix: int = 0
    grid: Optional[tuple[int, int]] = None
    function: Optional[Callable[[Tensor], Tensor]] = None

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


def token_grid(tokens: int, input_size: Sequence[int]) -> tuple[int, tuple[int, int]]:
    """(prefix tokens, (h, w)) such that prefix + h·w = tokens, h, w ≥ 2 and h : w matches the
    input's aspect ratio; the fewest prefix tokens win. Raises ValueError when no grid fits."""
    height, width = input_size
    for prefix in range(0, min(MAX_PREFIX_TOKENS, tokens - 1) + 1):
        patches = tokens - prefix
        rows = round(math.sqrt(patches * height / width))
        for candidate in (rows, rows - 1, rows + 1):
            if candidate >= 2 and patches % candidate == 0:
                columns = patches // candidate
                if columns >= 2 and abs(candidate * width - columns * height) <= max(height, width) / max(
                    candidate, columns
                ):
                    return prefix, (candidate, columns)
    raise ValueError(
        f"cannot lay {tokens} tokens out on a patch grid for a {height}×{width} input; "
        "pass reshape=(h, w) (the last h·w tokens are the patches) or a callable."
    )


def _spatial_fit(spatial: Sequence[int], input_size: Sequence[int]) -> float:
    """How well (h, w) looks like a downsampled input: 0 for equal strides along both axes."""
    h, w = spatial
    if h < 1 or w < 1 or h > input_size[0] or w > input_size[1]:
        return math.inf
    return abs(math.log((input_size[0] / h) / (input_size[1] / w)))


def _channel_evidence(module: Optional[nn.Module]) -> Optional[tuple[int, str]]:
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
    evidence = _channel_evidence(module)
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
                 module: Optional[nn.Module] = None) -> Layout:
    """The Layout of a layer's output for an input of ``input_size`` (H, W); ``module``, the layer,
    settles a 4-dimensional output whose shape reads both ways."""
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
    if reshape is not None:
        height, width = (int(value) for value in reshape)
        if tensor.dim() != 3 or tensor.shape[1] < height * width:
            raise ValueError(f"reshape={tuple(reshape)} needs (N, T, D) tokens with T ≥ {height * width}; "
                             f"layer {name!r} gives {tuple(tensor.shape)}.")
        return Layout("tokens", prefix=tensor.shape[1] - height * width, grid=(height, width))
    if tensor.dim() == 4:
        return Layout(_four_dimensional_layout(tensor.shape, input_size, module, name))
    if tensor.dim() == 3:
        prefix, grid = token_grid(tensor.shape[1], input_size)
        return Layout("tokens", prefix=prefix, grid=grid)
    raise ValueError(
        f"layer {name!r} outputs a tensor of shape {tuple(tensor.shape)}; CAM methods need feature maps "
        "(N, C, h, w), (N, h, w, C) or tokens (N, T, D). Choose another layer (`explain layers MODEL` lists "
        "output shapes) or pass reshape=."
    )
