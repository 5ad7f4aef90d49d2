"""Window attention (Swin and Swin v2 of timm, torchvision and HuggingFace): where each window's tokens lie on the
stage's token grid.

A window-attention block computes attention on (N · windows, heads, w², w²) probabilities: its stage's (N, H, W, C)
token grid is padded to whole windows, rolled by the shift (alternate blocks) and cut into windows of wh × ww tokens,
image by image, window rows outermost, each window's tokens in raster order. ``watch_windows`` reads how each block
did this during a forward pass (the grid from the block's input, the window and shift from the block after it ran,
since timm and HuggingFace clamp them to small grids), as ``WindowPartition``s, which place window tokens on the grid.

A block is a module with both ``window_size`` and ``shift_size`` attributes: timm's ``SwinTransformerBlock`` (and
V2), torchvision's ``ShiftedWindowAttention`` (and V2), HuggingFace's ``SwinLayer`` / ``Swinv2Layer``. timm rolls
then pads; torchvision and HuggingFace pad then roll (and torchvision drops a shift where the window covers the
padded grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from .scope import CallScope


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[1] if len(value) > 1 else value[0])
    return int(value), int(value)


def is_window_block(module: nn.Module) -> bool:
    """Whether a module partitions its tokens into (shifted) windows: it states ``window_size`` and ``shift_size``."""
    return hasattr(module, "window_size") and hasattr(module, "shift_size")


@dataclass(frozen=True)
class WindowPartition:
    """How one block's attention rows and tokens lie on its stage's token grid.

    grid: (H, W) tokens of the stage (before padding); window: (wh, ww); shift: (sh, sw), the cyclic shift towards
    the top left; roll_first: timm's order (roll the grid, then pad it) rather than pad, then roll."""

    block: str
    grid: tuple[int, int]
    window: tuple[int, int]
    shift: tuple[int, int]
    roll_first: bool

    @property
    def padded(self) -> tuple[int, int]:
        return (math.ceil(self.grid[0] / self.window[0]) * self.window[0],
                math.ceil(self.grid[1] / self.window[1]) * self.window[1])

    @property
    def windows(self) -> int:
        """Windows per image."""
        padded = self.padded
        return (padded[0] // self.window[0]) * (padded[1] // self.window[1])

    @property
    def tokens(self) -> int:
        """Tokens of the grid, H · W."""
        return self.grid[0] * self.grid[1]

    def positions(self, device: torch.device) -> Tensor:
        """(windows, wh · ww) int64: each window token's flat index y · W + x on the grid, −1 for padding."""
        (height, width), (padded_height, padded_width) = self.grid, self.padded
        y = torch.arange(padded_height, device=device).view(-1, 1).expand(padded_height, padded_width)
        x = torch.arange(padded_width, device=device).view(1, -1).expand(padded_height, padded_width)
        if self.roll_first:  # rolled on the H × W grid, then padded: padding stays at the bottom and right
            inside = (y < height) & (x < width)
            y, x = (y + self.shift[0]) % height, (x + self.shift[1]) % width
        else:  # padded, then rolled on the padded grid
            y, x = (y + self.shift[0]) % padded_height, (x + self.shift[1]) % padded_width
            inside = (y < height) & (x < width)
        flat = torch.where(inside, y * width + x, torch.full_like(y, -1))
        window_height, window_width = self.window
        return (flat.view(padded_height // window_height, window_height, padded_width // window_width, window_width)
                .permute(0, 2, 1, 3).reshape(self.windows, window_height * window_width))

    def check(self, probabilities: Tensor, count: int, module: str) -> None:
        """A clear error unless the (N · windows, heads, w², w²) probabilities fit this partition."""
        expected = (count * self.windows, self.window[0] * self.window[1])
        if probabilities.dim() != 4 or (probabilities.shape[0], probabilities.shape[-1]) != expected \
                or probabilities.shape[-2] != expected[1]:
            raise ValueError(
                f"the attention in {module!r} has shape {tuple(probabilities.shape)}, which does not fit the windows "
                f"of block {self.block!r} ({count} image(s) × {self.windows} window(s) of {self.window[0]} × "
                f"{self.window[1]} tokens on a {self.grid[0]} × {self.grid[1]} grid); this model's window layout is "
                "not one explain reads (timm, torchvision or HuggingFace Swin). Use AttnLRP or GradCAM.")

    def to_grid(self, values: Tensor, count: int) -> Tensor:
        """(N · windows, ..., w²) values of window tokens → (N, ..., H · W) on the grid (padding dropped)."""
        positions = self.positions(values.device)
        windowed = values.unflatten(0, (count, self.windows)).movedim(1, -2)  # (N, ..., windows, w²)
        keep = positions >= 0
        grid = values.new_zeros(*windowed.shape[:-2], self.tokens)
        grid[..., positions[keep]] = windowed[..., keep]
        return grid

    def from_grid(self, values: Tensor) -> Tensor:
        """(N, ..., H · W) grid values → (N · windows, ..., w²) per window token (0 for padding)."""
        positions = self.positions(values.device)
        padded = torch.cat([values, values.new_zeros(*values.shape[:-1], 1)], dim=-1)  # index −1: the zero
        windowed = padded[..., positions]  # (N, ..., windows, w²)
        return windowed.movedim(-2, 1).flatten(0, 1)


def spread_to_grid(values: Tensor, coarse: tuple[int, int], fine: tuple[int, int]) -> Tensor:
    """(N, h · w) values on a coarse grid → (N, H · W) on a finer one that patch merging turned into it (each coarse
    token merged the f × f fine tokens below it, f = ⌈H / h⌉, fewer at a padded edge): each fine token gets its
    coarse token's value divided by the number of fine tokens merged into it, so that the total is kept."""
    if coarse == fine:
        return values
    factors = [math.ceil(size / smaller) for size, smaller in zip(fine, coarse)]
    if any(smaller > size or math.ceil(size / factor) != smaller
           for size, smaller, factor in zip(fine, coarse, factors)):
        raise ValueError(f"a {coarse[0]} × {coarse[1]} token grid does not come from a {fine[0]} × {fine[1]} grid by "
                         "merging patches; this hierarchical model's stages are not laid out as Swin's are.")
    parents = [torch.arange(size, device=values.device) // factor for size, factor in zip(fine, factors)]
    children = [torch.bincount(parent, minlength=smaller).to(values.dtype)
                for parent, smaller in zip(parents, coarse)]
    grid = values.view(-1, *coarse)
    spread = grid[:, parents[0]][:, :, parents[1]] / (children[0][parents[0]].view(-1, 1)
                                                      * children[1][parents[1]].view(1, -1))
    return spread.flatten(1)


class WindowWatch:
    """The partitions of the window blocks that ran during a forward pass (``watch_windows``), in call order."""

    def __init__(self, model: nn.Module):
        self.blocks = {name: module for name, module in model.named_modules() if is_window_block(module)}
        self.calls: list[WindowPartition] = []
        self._grids: dict[str, tuple[int, int]] = {}

    def before(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tokens = next((value for value in (*args, *kwargs.values()) if isinstance(value, Tensor)), None)
        dimensions = kwargs.get("input_dimensions", next(
            (value for value in args[1:] if isinstance(value, (tuple, list)) and len(value) == 2
             and all(isinstance(item, int) for item in value)), None))
        grid: Optional[tuple[int, int]] = None
        if tokens is not None and tokens.dim() == 4:  # (N, H, W, C)
            grid = (int(tokens.shape[1]), int(tokens.shape[2]))
        elif dimensions is not None:  # HuggingFace: (N, H · W, C) and input_dimensions=(H, W)
            grid = _pair(dimensions)
        elif hasattr(self.blocks[name], "input_resolution"):
            grid = _pair(self.blocks[name].input_resolution)
        if grid is not None:
            self._grids[name] = grid

    def after(self, name: str) -> None:
        block = self.blocks[name]
        grid = self._grids.pop(name, None)
        if grid is None:
            return
        window, shift = _pair(block.window_size), _pair(block.shift_size)
        roll_first = type(block).__module__.startswith("timm")
        if not roll_first:  # torchvision: no shift along a side that one window covers (padded)
            padded = (math.ceil(grid[0] / window[0]) * window[0], math.ceil(grid[1] / window[1]) * window[1])
            shift = (0 if window[0] >= padded[0] else shift[0], 0 if window[1] >= padded[1] else shift[1])
        self.calls.append(WindowPartition(name, grid, window, shift, roll_first))

    def partition(self, module: str, taken: Optional[set[int]] = None) -> Optional[WindowPartition]:
        """The partition of the block inside which attention module ``module`` ran (the innermost window block that
        is ``module`` or holds it); None when it ran in none. ``taken``: indices of calls already matched (a block
        that ran twice is matched in order)."""
        for index, call in enumerate(self.calls):
            if taken is not None and index in taken:
                continue
            if module == call.block or module.startswith(call.block + "."):
                if taken is not None:
                    taken.add(index)
                return call
        return None

    def partitions(self, modules: Sequence[str]) -> list[Optional[WindowPartition]]:
        """Per recorded attention module (in call order), its block's partition or None."""
        taken: set[int] = set()
        return [self.partition(module, taken) for module in modules]


def watch_windows(scope: CallScope[Any], model: nn.Module) -> WindowWatch:
    """Hooks (through ``scope``, removed with it) that read each window block's partition as it runs."""
    watch = WindowWatch(model)
    for name, module in watch.blocks.items():
        def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str = name) -> None:
            watch.before(name, args, kwargs)

        def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                  name: str = name) -> None:
            watch.after(name)

        scope.forward_pre_hook(module, before, with_kwargs=True)
        scope.forward_hook(module, after, with_kwargs=True)
    return watch
