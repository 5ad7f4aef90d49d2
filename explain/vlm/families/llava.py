"""LLaVA (``config.model_type`` "llava"): where its image tokens lie on the image.

The image processor (CLIPImageProcessor or LlavaImageProcessor, PIL or torchvision backend) turns the image into one
view: LlavaImageProcessor with ``do_pad`` first pads it to a square (centred, the odd pixel after); then it resizes it
(``shortest_edge``: the short side to that size, the long side to int(size · long / short); or to ``height`` ×
``width``) and centre-crops it to ``crop_size`` (a crop larger than the image pads it first: the torchvision backend
puts the odd pixel of padding after the image, the PIL backend before it). The vision tower cuts the view into
``patch_size`` squares, row by row, after its class token. ``vision_feature_select_strategy`` "default" drops the
tower's first token (the class token), "full" keeps it: a token with no place on the image.

The geometry helpers here (``Frame``, ``processed_frame``, ...) serve the other CLIP-style families too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from ..layout import Box, ImageLayout, TokenGrid, image_token_count, register_layout


@dataclass(frozen=True)
class Frame:
    """An image made from the original by padding, resizing and cropping: its (height, width) in pixels, and where
    a point of the original lands on it: y' = scale_y · y + shift_y, x' = scale_x · x + shift_x (coordinates of
    pixel edges, so pixel i spans [i, i + 1); resizing n → m pixels maps [0, n] onto [0, m])."""

    height: int
    width: int
    scale_y: float = 1.0
    scale_x: float = 1.0
    shift_y: float = 0.0
    shift_x: float = 0.0

    @classmethod
    def of(cls, size: tuple[int, int]) -> Frame:
        """The original image of (height, width) ``size``."""
        return cls(int(size[0]), int(size[1]))

    def place(self, top: float, left: float, height: int, width: int) -> Frame:
        """This image put at (top, left) on a height × width canvas: padding for positive offsets, a crop (the
        canvas showing part of the image) for negative ones."""
        return Frame(height, width, self.scale_y, self.scale_x, self.shift_y + top, self.shift_x + left)

    def crop(self, top: float, left: float, height: int, width: int) -> Frame:
        """The height × width part of this image whose top left corner is (top, left) (may lie outside: padding)."""
        return self.place(-top, -left, height, width)

    def resize(self, height: int, width: int) -> Frame:
        """This image resized to height × width."""
        ry, rx = height / self.height, width / self.width
        return Frame(height, width, self.scale_y * ry, self.scale_x * rx, self.shift_y * ry, self.shift_x * rx)

    def box(self, top: float, left: float, bottom: float, right: float) -> Box:
        """A rectangle of this image's pixels → (left, top, right, bottom) in the original's pixels."""
        return ((left - self.shift_x) / self.scale_x, (top - self.shift_y) / self.scale_y,
                (right - self.shift_x) / self.scale_x, (bottom - self.shift_y) / self.scale_y)

    def grid(self, tokens: Tensor, patch: int) -> TokenGrid:
        """The TokenGrid of (rows, cols) ``tokens`` on patch × patch squares from this image's top left corner."""
        rows, cols = tokens.shape
        return TokenGrid(tokens=tokens, box=self.box(0, 0, rows * patch, cols * patch))


def size_entry(size: Any, key: str) -> Optional[int]:
    """One entry (``height``, ``shortest_edge``, ...) of a processor's size, a dict or a SizeDict; None if unset."""
    if size is None:
        return None
    value = size.get(key) if isinstance(size, Mapping) else getattr(size, key, None)
    return None if value is None else int(value)


def resized_size(size: Any, height: int, width: int) -> tuple[int, int]:
    """(height, width) that an image processor's resize to ``size`` gives a height × width image, with its
    rounding: the short side to ``shortest_edge`` and the long side to int(shortest_edge · long / short) (capped
    by ``longest_edge`` if set), or exactly ``height`` × ``width``."""
    shortest, longest = size_entry(size, "shortest_edge"), size_entry(size, "longest_edge")
    if shortest is not None and longest is not None:
        short, long = min(height, width), max(height, width)
        raw = None
        if long / short * shortest > longest:
            raw = longest * short / long
            shortest = int(round(raw))
        if short == shortest:
            return height, width
        new_long = int((raw if raw is not None else shortest) * long / short)
        return (new_long, shortest) if width < height else (shortest, new_long)
    if shortest is not None:
        short, long = min(height, width), max(height, width)
        new_long = int(shortest * long / short)
        return (new_long, shortest) if width <= height else (shortest, new_long)
    target_height, target_width = size_entry(size, "height"), size_entry(size, "width")
    if target_height is not None and target_width is not None:
        return target_height, target_width
    raise ValueError(f"explain cannot follow an image processor that resizes to {size!r}: it knows sizes given as "
                     "shortest_edge (optionally with longest_edge) or as height and width.")


def torchvision_backend(image_processor: Any) -> bool:
    """Whether the image processor is a torchvision ("fast") one rather than a PIL/NumPy ("slow") one."""
    names = {cls.__name__ for cls in type(image_processor).__mro__}
    return bool(names & {"TorchvisionBackend", "BaseImageProcessorFast"})


def centre_crop_start(image_processor: Any, length: int, crop: int) -> int:
    """Where an image processor's centre crop of ``crop`` pixels starts along a side of ``length`` pixels; negative
    where it pads: the torchvision backend pads floor((crop − length) / 2) pixels before the image, the PIL backend
    ceil(...)."""
    if crop > length and torchvision_backend(image_processor):
        return -((crop - length) // 2)
    return (length - crop) // 2


def crop_and_resize(image_processor: Any, frame: Frame) -> Frame:
    """``frame`` through the image processor's resize (``do_resize``, ``size``) and centre crop (``do_center_crop``,
    ``crop_size``)."""
    if getattr(image_processor, "do_resize", False):
        frame = frame.resize(*resized_size(image_processor.size, frame.height, frame.width))
    if getattr(image_processor, "do_center_crop", False):
        crop_height = size_entry(image_processor.crop_size, "height")
        crop_width = size_entry(image_processor.crop_size, "width")
        if crop_height is None or crop_width is None:
            raise ValueError(f"the image processor's crop_size {image_processor.crop_size!r} lacks height or width.")
        frame = frame.crop(centre_crop_start(image_processor, frame.height, crop_height),
                           centre_crop_start(image_processor, frame.width, crop_width), crop_height, crop_width)
    return frame


def processed_frame(image_processor: Any, image_size: tuple[int, int]) -> Frame:
    """The view a single-view image processor makes of an image of (height, width) ``image_size``: LLaVA's pad to a
    square (``do_pad`` on a processor with ``pad_to_square``), then resize, then centre crop."""
    frame = Frame.of(image_size)
    if getattr(image_processor, "do_pad", False) and hasattr(image_processor, "pad_to_square"):
        side = max(frame.height, frame.width)
        frame = frame.place((side - frame.height) // 2, (side - frame.width) // 2, side, side)
    return crop_and_resize(image_processor, frame)


def pixel_size(inputs: Mapping[str, Any]) -> tuple[int, int]:
    """(height, width) of the processed view(s) in ``inputs["pixel_values"]``."""
    if "pixel_values" not in inputs:
        raise ValueError("the processor's output has no pixel_values: pass the inputs the processor made from the "
                         "image and the text.")
    shape = tuple(inputs["pixel_values"].shape)
    return int(shape[-2]), int(shape[-1])


def check_view(frame: Frame, processed: tuple[int, int], image_size: tuple[int, int]) -> None:
    """A clear error where the processor's settings do not give the view it made (called with other settings)."""
    if (frame.height, frame.width) != processed:
        raise ValueError(
            f"the image processor's settings turn a {image_size[0]}×{image_size[1]} image into "
            f"{frame.height}×{frame.width} pixels, but pixel_values are {processed[0]}×{processed[1]}: pass the "
            "original image's (height, width) and the processor the inputs were made with, called without "
            "overriding its size, crop or padding settings.")


def dropped_tokens(config: Any) -> int:
    """How many of the vision tower's first tokens ``vision_feature_select_strategy`` drops: 1 for "default",
    0 for "full"."""
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"explain knows vision_feature_select_strategy 'default' and 'full', not {strategy!r}.")
    return 1 if strategy == "default" else 0


def leading_tokens(model: nn.Module) -> Optional[int]:
    """How many tokens the vision tower puts before its patches (1 for CLIP's class token, 0 for SigLIP), read from
    its embeddings' ``num_positions`` − ``num_patches``; None where the tower does not state them."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "vision_tower":
            embeddings = getattr(module, "embeddings", None)
            if embeddings is None:
                embeddings = getattr(getattr(module, "vision_model", None), "embeddings", None)
            positions, patches = getattr(embeddings, "num_positions", None), getattr(embeddings, "num_patches", None)
            if isinstance(positions, int) and isinstance(patches, int):
                return positions - patches
            return None
    return None


def view_tokens(model: nn.Module, patches: int, token_count: Optional[int] = None) -> Tensor:
    """(patches,) long: each patch's index among the tokens a view of ``patches`` patches sends to the language
    model, −1 for a patch not sent.

    The vision tower gives ``leading`` tokens (a class token) and then the patches in order; the select strategy
    drops the first ``dropped`` of them. So patch q is token q + leading − dropped. Where the tower does not state
    ``leading``, it is inferred from ``token_count``, the view's tokens in the sequence."""
    config: Any = model.config
    dropped = dropped_tokens(config)
    leading = leading_tokens(model)
    if leading is None:
        if token_count is None:
            raise ValueError(f"explain cannot tell how many tokens {type(model).__name__}'s vision tower puts before "
                             "its patches.")
        leading = token_count + dropped - patches
    if leading < 0:
        raise ValueError(f"a view of {patches} patches cannot give {token_count} image tokens with the "
                         f"{config.vision_feature_select_strategy!r} select strategy.")
    tokens = torch.arange(patches) + leading - dropped
    return torch.where(tokens >= 0, tokens, torch.full_like(tokens, -1))


def check_count(token_count: int, expected: int, what: str) -> None:
    """A clear error where the sequence holds another number of image tokens than the layout places."""
    if token_count != expected:
        raise ValueError(f"the sequence holds {token_count} image tokens, but {what} gives {expected}: pass the "
                         "processor's inputs for one image, with the processor the model was built with.")


def patch_size(model: nn.Module) -> int:
    """The vision tower's patch side in pixels (``config.vision_config.patch_size``)."""
    config: Any = model.config
    return int(config.vision_config.patch_size)


@register_layout("llava")
def llava_layout(model: nn.Module, processor: Any, inputs: Mapping[str, Any],
                 image_size: tuple[int, int]) -> ImageLayout:
    """Where LLaVA's image tokens lie on an image of (height, width) ``image_size``: one grid of patches over the
    padded, resized and cropped view; with the "full" strategy the class token (token 0) has no place."""
    image_processor = getattr(processor, "image_processor", processor)
    frame = processed_frame(image_processor, image_size)
    check_view(frame, pixel_size(inputs), image_size)
    patch = patch_size(model)
    rows, cols = frame.height // patch, frame.width // patch
    token_count = image_token_count(model, inputs)
    tokens = view_tokens(model, rows * cols, token_count)
    check_count(token_count, int(tokens.max()) + 1, f"a {rows}×{cols} patch grid")
    grid = frame.grid(tokens.view(rows, cols), patch)
    return ImageLayout(size=(int(image_size[0]), int(image_size[1])), grids=[grid], token_count=token_count)
