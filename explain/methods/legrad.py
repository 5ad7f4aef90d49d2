"""LeGrad (Bousselham et al. 2024, "LeGrad: An Explainability Method for Vision Transformers via
Feature Formation Sensitivity"): the gradient of each layer's own score with respect to that
layer's attention probabilities, as the map.

For every layer l from ``start_block`` on, the layer's score s_l is the model's own readout of
that layer's output tokens z_l: the part of the model after its last transformer block (final
norm, pooling, head or projection, CLIP's similarity) applied to z_l instead of the last block's
output. With A_l (N, heads, T, T) the layer's attention probabilities,

    map = Σ_l  mean over query rows of  mean over heads of  (∂s_l / ∂A_l)⁺,

read over the patch tokens' key columns (class and register tokens dropped) on the patch grid,
then min–max normalised. ∂s_l/∂A_l is the gradient through layer l alone: s_l also depends on
the earlier layers' attention (through z_l), which LeGrad does not count there.

One forward pass and one backward pass per target compute it for every layer at once:

- the blocks are the entries of the ``nn.ModuleList`` / ``nn.Sequential`` holding the layers
  (timm ``blocks``, torchvision ``encoder.layers``, HuggingFace ``encoder.layer(s)``, open_clip
  ``transformer.resblocks``, ``nn.TransformerEncoder.layers``) inside which attention is
  computed; each block's output is handed to the next block cut from the autograd graph, so that
  z_l depends on A_l and on no earlier layer's attention;
- at the end of the last block, the rest of the model receives every chosen layer's tokens
  stacked along the batch dimension (L·N rows) and runs once; row block l of the output holds
  layer l's scores, for the targets selected from the last layer's (the model's true) output;
- one ``torch.autograd.grad`` of Σ_l s_l per target with respect to all the A_l then gives
  exactly ∂s_l/∂A_l for each l.

The part of the model after the last block must read that block's output only (as classifiers,
CLIP towers and SigLIP's attention pooling head do), and must score each row on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypedDict, Union, cast

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ..core.attention import AttentionRecord, BlockSpec, CapturedAttention, SkippedSoftmax, capture_attention
from ..core.layouts import Layout, stage_layout, token_layout
from ..core.scope import CallScope
from ..core.targets import OutputSelector, SelectedTargets, Target, select_targets
from ..core.windows import WindowPartition, is_window_block, watch_windows
from ..io.inputs import PreprocessSpec
from ..io.loaded_model import ModelSource
from .attention import AttentionMethod, check_patches, token_rows
from .maps import Attribution
from .registry import register

POOLS = ("model", "mean")
LEGRAD_ROWS = ("all", "auto", "class", "mean")
STACKS = "nn.ModuleList or nn.Sequential"


class LeGradOptions(TypedDict, total=False):
    """The keyword options LeGrad passes on to ``AttentionMethod`` and ``Explainer``."""

    preprocess: PreprocessSpec
    class_names: Optional[Sequence[str]]
    output: OutputSelector
    progress: Optional[bool]
    blocks: BlockSpec
    start_block: int
    reshape: Optional[Sequence[int]]


# ------------------------------------------------------------------ the blocks and their outputs


@dataclass(frozen=True)
class _Entry:
    """A module held by an nn.ModuleList / nn.Sequential: a possible transformer block."""

    name: str
    module: nn.Module
    stack: str
    last: bool


def _stack_entries(model: nn.Module) -> list[_Entry]:
    """Every entry of every nn.ModuleList and nn.Sequential in the model (each module once)."""
    entries: list[_Entry] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        for index, (child_name, child) in enumerate(children):
            if id(child) in seen:
                continue
            seen.add(id(child))
            entries.append(_Entry(f"{name}.{child_name}" if name else child_name, child, name,
                                  index == len(children) - 1))
    return entries


def _tokens_of(output: Any) -> Optional[Tensor]:
    """A block's output tokens: the output itself, or the first item of a tuple or list."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


def _with_tokens(output: Any, tokens: Tensor) -> Any:
    """The block's output with its tokens replaced."""
    if isinstance(output, Tensor):
        return tokens
    replaced = [tokens, *output[1:]]
    return tuple(replaced) if isinstance(output, tuple) else replaced


def _sequence_first(block: nn.Module) -> bool:
    """Whether the block states that it takes (T, N, D) tokens (``batch_first=False`` somewhere inside)."""
    return any(getattr(module, "batch_first", None) is False for module in block.modules())


def _batch_dim(tokens: Tensor, count: int, token_count: int, block: nn.Module) -> Optional[int]:
    """Which dimension of a block's output holds the images: 0 for (N, T, D) (or (N, h, w, D)), 1 for
    open_clip's and nn.MultiheadAttention's sequence-first (T, N, D); None when neither fits."""
    shape = tokens.shape
    batch_first = tokens.dim() >= 3 and shape[0] == count and math.prod(shape[1:-1]) == token_count
    sequence_first = tokens.dim() == 3 and shape[1] == count and shape[0] == token_count
    if batch_first and sequence_first:  # as many images as tokens: the block says which
        return 1 if _sequence_first(block) else 0
    if batch_first or sequence_first:
        return 0 if batch_first else 1
    return None


@dataclass
class _Layer:
    """One transformer block as LeGrad reads it: its name, its attention and its output tokens
    (in the autograd graph of this block alone), with the dimension that holds the images."""

    block: str
    record: AttentionRecord
    tokens: Tensor
    batch_dim: int
    windowed: bool = False
    """Window attention (Swin): the record's rows are the image's windows, laid out by ``explain.core.windows``."""


class _ChosenAttention(CapturedAttention):
    """The chosen blocks' attention, for the checks every attention method makes (``_checked``)."""

    def __init__(self, records: Sequence[AttentionRecord]):  # no recorder: the records are given
        self._chosen = list(records)

    @property
    def records(self) -> list[AttentionRecord]:
        return list(self._chosen)

    @property
    def skipped(self) -> list[SkippedSoftmax]:
        return []


class _LayerStack:
    """The state of one LeGrad forward pass, driven by forward hooks on every stack entry.

    An entry inside which attention was recorded (and which holds no other block) is a block: its
    output goes on cut from the graph; the stack's last block hands the rest of the model the chosen
    layers' readouts stacked along the batch. A problem found during the pass (window attention, a
    block that is not one) is kept in ``error`` and raised after it; the hooks then leave the model
    alone, so that the model's own code never sees an error of ours.
    """

    def __init__(self, explainer: "LeGrad", attention: CapturedAttention, count: int):
        self.explainer = explainer
        self.attention = attention
        self.count = count
        self.layers: list[_Layer] = []
        self.chosen: list[_Layer] = []
        self.stack: Optional[str] = None
        self.finished = False
        self.row_blocks = 0
        self.error: Optional[Exception] = None
        self.ran: set[str] = set()
        self.last_entry: dict[str, str] = {}
        self._unclaimed: list[AttentionRecord] = []
        self._seen = 0

    def hook(self, entry: _Entry) -> Callable[[nn.Module, tuple[Any, ...], Any], Any]:
        if entry.last:
            self.last_entry[entry.stack] = entry.name

        def after_entry(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            return self._after(entry, output)

        return after_entry

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error

    def _claim(self, name: str) -> list[AttentionRecord]:
        """The attention recorded inside entry ``name`` (by its own code or a submodule's) that no entry
        inside it claimed before."""
        records = self.attention.records
        self._unclaimed.extend(records[self._seen :])
        self._seen = len(records)
        prefix = name + "."
        if any(layer.block.startswith(prefix) for layer in self.layers):
            return []  # an entry around the blocks (a model inside an nn.Sequential): not a block
        inside = [record for record in self._unclaimed if record.module == name or record.module.startswith(prefix)]
        claimed = {id(record) for record in inside}
        self._unclaimed = [record for record in self._unclaimed if id(record) not in claimed]
        return inside

    def _after(self, entry: _Entry, output: Any) -> Any:
        self.ran.add(entry.name)
        if self.error is not None:
            return None
        inside = self._claim(entry.name)
        if not inside:
            return None
        problem = self._problem(entry, inside)
        if problem is not None:
            self._fail(problem)
            return None
        record = inside[0]
        if _in_window_block(entry, record.module):  # Swin: the block's output is the (N, H, W, C) or (N, H·W, C) grid
            tokens = _tokens_of(output)
            if tokens is None or tokens.dim() < 3 or tokens.shape[0] != self.count:
                self._fail(ValueError(f"LeGrad reads a Swin block's output tokens, (N, H, W, C) or (N, H·W, C), and "
                                      f"block {entry.name!r} returned {type(output).__name__}."))
                return None
            return self._read(entry, record, output, tokens, 0, windowed=True)
        if record.probabilities.shape[0] != self.count:  # window attention, or attention of another input
            rows = record.probabilities.shape[0]
            self._fail(self.explainer.attention_problem(_ChosenAttention([record]), self.count) or ValueError(
                f"the attention in {record.module!r} has {rows} rows for {self.count} image(s)."))
            return None
        tokens = _tokens_of(output)
        batch_dim = None if tokens is None else _batch_dim(tokens, self.count, record.probabilities.shape[-1],
                                                           entry.module)
        if tokens is None or batch_dim is None:
            shown = type(output).__name__ if tokens is None else f"a tensor of shape {tuple(tokens.shape)}"
            self._fail(ValueError(
                f"LeGrad reads each transformer block's output tokens, (N, T, D) or (T, N, D), and block "
                f"{entry.name!r} returned {shown} for {self.count} image(s) and attention over "
                f"{record.probabilities.shape[-1]} tokens. Choose the image's blocks with blocks=, or use "
                "GradientAttentionRollout."))
            return None
        return self._read(entry, record, output, tokens, batch_dim)

    def _read(self, entry: _Entry, record: AttentionRecord, output: Any, tokens: Tensor, batch_dim: int, *,
              windowed: bool = False) -> Any:
        """The block read: its tokens kept; cut from the next block's graph, or the readouts stacked after the last."""
        self.stack = entry.stack
        self.layers.append(_Layer(entry.name, record, tokens, batch_dim, windowed))
        if entry.last:
            return self._finish(output)
        # the next block starts a new graph (a copy, so that the model may change it in place)
        return _with_tokens(output, tokens.detach().requires_grad_(True).clone())

    def _problem(self, entry: _Entry, inside: list[AttentionRecord]) -> Optional[Exception]:
        """Why the entry cannot be read as the stack's next block, if it cannot."""
        if len(inside) > 1:
            modules = ", ".join(repr(record.module) for record in inside[:4])
            return ValueError(
                f"LeGrad reads one attention matrix per transformer block, and block {entry.name!r} computed "
                f"{len(inside)} ({modules}): it takes as blocks the entries of an {STACKS} inside which attention "
                "is computed. Choose the blocks to read with blocks=, or use GradientAttentionRollout.")
        if any(layer.block == entry.name for layer in self.layers):
            return ValueError(f"block {entry.name!r} ran more than once in one forward pass; LeGrad reads each "
                              "block's output once.")
        if self.finished or (self.stack is not None and entry.stack != self.stack):
            return ValueError(
                f"LeGrad found attention blocks in two stacks, {self.stack!r} and {entry.stack!r}: it reads the layers "
                "of one stack of blocks through the part of the model after it. Choose the image's blocks with "
                "blocks= (blocks='vision_model' for a HuggingFace CLIPModel).")
        return None

    def _finish(self, output: Any) -> Any:
        """At the end of the stack's last block: the chosen layers' readouts (and the last block's own
        output, when it is not among them) stacked along the batch, for the rest of the model."""
        try:
            self.chosen = [self.layers[index] for index in self.explainer.chosen_layers(len(self.layers))]
            global_attention = [layer.record for layer in self.chosen if not layer.windowed]
            problem = None if not global_attention else self.explainer.attention_problem(
                _ChosenAttention(global_attention), self.count)
        except ValueError as error:
            problem = error
        if problem is not None:
            self._fail(problem)
            return None
        last = self.layers[-1]
        rows = [self.explainer.readout(layer) for layer in self.chosen]
        if self.explainer.pool != "model" or self.chosen[-1] is not last:
            rows.append(last.tokens)  # the model's own output, for the targets and the scores
        self.row_blocks = len(rows)
        self.finished = True
        return _with_tokens(output, torch.cat(rows, dim=last.batch_dim))

    def unfinished_error(self) -> Exception:
        """Why the pass ended without reaching the end of a stack of blocks."""
        if self.error is not None:
            return self.error
        records = self.attention.records
        if not records:  # the attention methods' error for a model without attention
            return self.explainer.attention_problem(self.attention, self.count) or ValueError(
                "LeGrad found no attention in the model's forward pass.")
        if not self.layers:
            modules = sorted({record.module for record in records})
            listed = ", ".join(repr(module) for module in modules[:3]) + (" ..." if len(modules) > 3 else "")
            return ValueError(
                f"LeGrad found attention in {listed} but no transformer block around it: it reads each block's "
                f"output tokens and takes as blocks the entries of an {STACKS} inside which attention is computed "
                "(timm's blocks, torchvision's encoder.layers, HuggingFace's encoder.layer(s), open_clip's "
                "transformer.resblocks). Hold the model's blocks in an nn.ModuleList, or use GradientAttentionRollout.")
        stack = self.stack or ""
        last = self.last_entry.get(stack, "?")
        why = "did not run" if last not in self.ran else "computed no recorded attention"
        return ValueError(
            f"LeGrad recorded attention in {len(self.layers)} block(s) of {stack!r} but its last entry, {last!r}, "
            f"{why}: every layer is read through the part of the model after the stack's last block, which must be "
            "among the blocks read. Let blocks= include the stack's last block (choose the first layer with "
            "start_block=), or use GradientAttentionRollout.")


def _in_window_block(entry: _Entry, module: str) -> bool:
    """Whether attention recorded in ``module`` ran inside a window block (Swin) that is the entry or inside it."""
    for name, inner in entry.module.named_modules():
        block = f"{entry.name}.{name}" if name else entry.name
        if is_window_block(inner) and (module == block or module.startswith(block + ".")):
            return True
    return False


def _chooses_positions(blocks: BlockSpec) -> bool:
    """Whether ``blocks`` chooses blocks by position (an int, a slice or ints) rather than naming modules."""
    if isinstance(blocks, bool):
        return False
    if isinstance(blocks, (int, slice)):
        return True
    return isinstance(blocks, (list, tuple, range)) and len(blocks) > 0 and all(
        isinstance(item, int) and not isinstance(item, bool) for item in blocks)


def _positions(blocks: BlockSpec, count: int) -> Optional[list[int]]:
    """The blocks chosen by position (an int, a slice or ints; negative from the end) among ``count``
    blocks, in order; None when ``blocks`` names modules (or is None)."""
    if not _chooses_positions(blocks):
        return None
    if isinstance(blocks, slice):
        return list(range(count))[blocks]
    positions = [blocks] if isinstance(blocks, int) else [int(item) for item in cast(Sequence[int], blocks)]
    for position in positions:
        if not -count <= position < count:
            raise ValueError(f"blocks={blocks!r}: block {position} does not exist; the model has {count} "
                             "transformer block(s).")
    return sorted({position % count for position in positions})


# ------------------------------------------------------------------ the method


@register
class LeGrad(AttentionMethod):
    """LeGrad (Bousselham et al. 2024): Σ_l mean_rows mean_heads (∂s_l/∂A_l)⁺ over the patch tokens,
    s_l the score that the model's own readout gives layer l's output tokens, A_l (N, heads, T, T)
    that layer's attention probabilities; min–max normalised to [0, 1].

    pool: how layer l's tokens are read. "model" (default): as the model reads its last block's
        output, by running the part of the model after the last block on them (its final norm,
        pooling, head or projection, CLIP's similarity to the prompts). "mean": every token replaced
        by the mean of all the layer's tokens (class and register tokens included) before that
        part, which makes a norm-then-class-token readout (OpenCLIP's ``ln_post``, ``proj``) read
        ln(mean of the tokens), as legrad-torch does for OpenCLIP ViTs.
    row: which query rows of ∂s_l/∂A_l are averaged: "all" (default, as legrad-torch: every
        token's row, class and register tokens included), "auto" (what the head reads, as for the rollouts:
        the class token's row, the patch tokens' rows for a head that averages them, the class and
        distillation tokens' rows for a distilled DeiT), "class" or "mean" (the patch tokens' rows).
        A single patch (an input no larger than one patch; Swin's last stage on a small input) gives a
        constant map, no explanation: a ValueError.
    start_block: the first layer summed (an index among the blocks read; negative from the end):
        0, every layer, as the paper aggregates; legrad-torch's ``layer_index`` default is −2, the
        last two.
    blocks: the attention recorded, as for the rollouts (``"vision_model"`` for a HuggingFace
        CLIPModel); positions choose among the blocks. The blocks read must include the stack's
        last block, after which every layer is read.
    normalize: "minmax" by default, as legrad-torch normalises the summed map;
        "max" or None as for every method.
    reshape: (h, w), the patch grid, when the guess is wrong (see ``AttentionMethod``).

    Sources. The paper gives the definition: the gradient of each layer's score with respect to
    that single layer's attention map is the signal, each layer's tokens read as the last
    layer's are, aggregated over all the layers (hence ``start_block=0``). The details follow
    legrad-torch 1.1 (its OpenCLIP code, ``compute_legrad_clip``): the positive part (clamped at
    0), averaged over heads and over every query row, the class token's column dropped, summed
    over the layers and min–max normalised; its readout ln_post(mean of all tokens) @ proj
    (``pool="mean"``; OpenCLIP itself reads the class token, hence the option) and its default
    of the last two layers (``start_block=-2``). legrad-torch upsamples each layer's map before
    summing, which equals upsampling the sum (bilinear upsampling is linear); both min–max
    normalise the upsampled map. On a random-weight OpenCLIP ViT with ``pool="mean",
    start_block=-2`` the maps equal legrad-torch's to float rounding (tests/test_legrad.py).
    legrad-torch's SigLIP and CoCa variants differentiate with respect to the attention
    pooler's probabilities instead; here every model is read through its transformer blocks'
    attention, the pooler being part of the readout.

    K targets per image (class indices, top-k, ``EmbeddingSimilarity`` with K prompts) cost one
    backward pass each; the forward runs the blocks once and the rest of the model once on the
    L·N stacked rows. Window attention (Swin, Swin v2): only the last stage's tokens fit the head, so
    by default the blocks of the last stage are read (``blocks=`` by position chooses among them);
    each window's gradient is placed on the stage's token grid (``explain.core.windows``: shifted windows,
    padding), a key token's column summed over its window's rows and divided by the grid's tokens
    (the mean over all rows, the other windows' rows having no gradient for it); the map lies on the
    last stage's grid (7 × 7 for Swin-T at 224 px). Other options: see ``AttentionMethod``.
    """

    name = "legrad"
    summary = "LeGrad (Bousselham et al. 2024): each layer's score's gradient w.r.t. its attention, summed over layers"
    uses_gradients = True
    row_hint = "row='all', 'mean' or 'auto'"
    pool_hint = "or leave row='all' (every token's query row, as legrad-torch; each layer is scored through the head)"
    reads_windows = True  # Swin's window attention, laid out on its stage's grid (its own pass reads the partitions)

    def __init__(
        self,
        model: ModelSource,
        *,
        pool: str = "model",
        row: str = "all",
        normalize: Optional[str] = "minmax",
        **options: Unpack[LeGradOptions],
    ):
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}; got {pool!r}.")
        if row not in LEGRAD_ROWS:
            raise ValueError(f"row must be one of {LEGRAD_ROWS}; got {row!r}.")
        super().__init__(model, row="auto" if row == "all" else row, normalize=normalize, **options)
        self.row = row
        self.pool = pool

    # ---------------------------------------------------------------- used during the forward pass

    def chosen_layers(self, count: int) -> list[int]:
        """The indices of the layers summed among ``count`` blocks read: those ``blocks=`` chooses by
        position (all otherwise), from ``start_block`` on."""
        positions = _positions(self.blocks, count)
        indices = list(range(count)) if positions is None else positions
        if not indices:
            raise ValueError(f"blocks={self.blocks!r} chooses none of the model's {count} transformer block(s).")
        return indices[self._first_block(len(indices)):]

    def attention_problem(self, attention: CapturedAttention, count: int) -> Optional[ValueError]:
        """The error the attention methods give for attention they cannot read (none, window
        attention, unequal shapes), or None when it is self-attention over the images' tokens."""
        try:
            self._checked(attention, count)
        except ValueError as error:
            return error
        return None

    def _last_window_stack(self) -> Optional[str]:
        """For a window-attention model (Swin), the stack of blocks read by default: that of the last window block,
        whose tokens the head reads (the earlier stages have other grids and widths). None for other models."""
        stacks = {id(entry.module): entry.stack for entry in _stack_entries(self.model)}
        names = dict(self.model.named_modules())
        last = next((name for name, module in reversed(names.items()) if is_window_block(module)), None)
        while last is not None:
            if id(names[last]) in stacks:
                return stacks[id(names[last])]
            last = last.rpartition(".")[0] if last else None
        return None

    def readout(self, layer: _Layer) -> Tensor:
        """What the rest of the model receives for a layer: its tokens ("model"), or their mean in
        every token's place ("mean")."""
        tokens = layer.tokens
        if self.pool == "model":
            return tokens
        token_dims = (0,) if layer.batch_dim == 1 else tuple(range(1, tokens.dim() - 1))
        return tokens.mean(dim=token_dims, keepdim=True).expand_as(tokens)

    # ---------------------------------------------------------------- the method

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        recorded = self._last_window_stack() if _chooses_positions(self.blocks) or self.blocks is None else self.blocks
        with torch.enable_grad():
            with capture_attention(self.model, recorded, detach=False) as attention, CallScope(self.model) as scope:
                windows = watch_windows(scope, self.model)
                stack = _LayerStack(self, attention, count)
                for entry in _stack_entries(self.model):
                    scope.forward_hook(entry.module, stack.hook(entry))
                # an input in the graph: the first block's attention is in it even when no parameter requires grad
                output = self.call_model(batch.detach().requires_grad_(batch.is_floating_point()))
            if stack.error is not None or not stack.finished:
                raise stack.unfinished_error()
            layer_scores, selected = self._scores(output, stack, target, topk)
            probabilities = [layer.record.probabilities for layer in stack.chosen]
            partitions = windows.partitions([layer.record.module for layer in stack.chosen])
            if all(partition is not None for partition in partitions):  # window attention (Swin): on its grid
                grids = [partition for partition in partitions if partition is not None]
                for partition, layer in zip(grids, stack.chosen):
                    partition.check(layer.record.probabilities, count, layer.record.module)
                if len({partition.grid for partition in grids}) > 1:
                    raise ValueError(f"LeGrad sums the layers' maps on one token grid, and the blocks read lie on "
                                     f"grids {sorted({partition.grid for partition in grids})}: choose the blocks "
                                     "of one stage with blocks=.")
                check_patches(grids[0].grid, batch.shape[-2:], type(self).__name__)  # the last stage's grid
                layouts: Sequence[Union[Layout, WindowPartition]] = grids
            else:
                layouts = [token_layout(probabilities[0].shape[-1], batch.shape[-2:], self.reshape, self.model,
                                        "the attention", whole_sequence=True)] * len(probabilities)
                check_patches(layouts[0].grid, batch.shape[-2:], type(self).__name__)
            relevance, zero_gradient, disconnected = self._relevance(probabilities, layer_scores, layouts)
        selected.scores = selected.scores.detach()
        layout = layouts[0]
        if isinstance(layout, WindowPartition):
            grid_maps = relevance.unflatten(-1, layout.grid)  # (N, K, H, W)
            # 0 on pixels the patch embedding never reads
            maps = stage_layout(self.model, layout.grid, batch.shape[-2:]).to_input(grid_maps, batch.shape[-2:])
        else:
            grid_maps = layout.apply(relevance.transpose(1, 2))  # (N, T, K) → (N, K, h, w)
            maps = layout.to_input(grid_maps, batch.shape[-2:])  # 0 on pixels the patch embedding never reads
        return Attribution(maps=maps, selected=selected, low_res_maps=[grid_maps], zero_gradient=zero_gradient,
                           disconnected=disconnected,
                           diagnostics={"attention_blocks": [layer.record.module for layer in stack.chosen]})

    def _scores(self, output: Any, stack: _LayerStack, target: Target,
                topk: Optional[int]) -> tuple[list[Tensor], SelectedTargets]:
        """The targets, selected from the model's own output (the last row block), and each chosen
        layer's (N, K) scores of the same targets."""
        count, rows = stack.count, stack.row_blocks * stack.count
        if not isinstance(output, Tensor) or output.dim() == 0 or output.shape[0] != rows:
            shown = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            raise ValueError(
                f"LeGrad runs the part of the model after its last block on {stack.row_blocks} layers' tokens at once "
                f"({rows} rows for {count} image(s)) and reads their scores from an output with one row per row of "
                f"tokens; the model's output (after output=) is {shown}. Choose with output= a tensor with one row "
                "per image (logits, embeddings, CLIP's logits_per_image).")
        blocks = output.split(count)
        selected = select_targets(blocks[-1], target, topk, batch_size=count)
        images = torch.arange(count, device=output.device)
        return [selected.scores_for(blocks[index], images) for index in range(len(stack.chosen))], selected

    def _relevance(self, probabilities: list[Tensor], layer_scores: list[Tensor],
                   layouts: Sequence[Union[Layout, WindowPartition]]) -> tuple[Tensor, Tensor, Tensor]:
        """(N, K, T) relevance of each key token (T: the grid's tokens for window attention), and (N, K) flags:
        where ∂s_l/∂A_l was zero in every layer, and where no layer's score depends on its attention. ``layouts``:
        each layer's token layout, or for window attention its window partition (all on one grid)."""
        count = layer_scores[0].shape[0]
        first = layouts[0]
        tokens = first.tokens if isinstance(first, WindowPartition) else probabilities[0].shape[-1]
        targets = layer_scores[0].shape[1]
        device = probabilities[0].device
        row = self.row if self.row == "all" or isinstance(first, WindowPartition) else self._head_row(first)
        per_target: list[Tensor] = []
        zero_gradient: list[Tensor] = []
        disconnected: list[Tensor] = []
        for target_index in range(targets):
            total = torch.stack([scores[:, target_index].sum() for scores in layer_scores]).sum()
            gradients: Sequence[Optional[Tensor]] = [None] * len(probabilities)
            if total.requires_grad:
                gradients = torch.autograd.grad(total, probabilities, retain_graph=target_index < targets - 1,
                                                allow_unused=True)
            relevance = torch.zeros(count, tokens, device=device)
            nonzero = torch.zeros(count, dtype=torch.bool, device=device)
            for gradient, layout in zip(gradients, layouts):
                if gradient is None:
                    continue
                nonzero |= gradient.reshape(nonzero.shape[0], -1).ne(0).any(dim=1)
                relevance = relevance + self._query_rows(gradient.float().clamp(min=0).mean(dim=1), layout, row)
            per_target.append(relevance)
            zero_gradient.append(~nonzero)
            disconnected.append(torch.full_like(nonzero, all(gradient is None for gradient in gradients)))
        return torch.stack(per_target, dim=1), torch.stack(zero_gradient, dim=1), torch.stack(disconnected, dim=1)

    def _query_rows(self, positive: Tensor, layout: Union[Layout, WindowPartition], row: str) -> Tensor:
        """(N, T, T) → (N, T): the mean of the query rows that ``row`` chooses. Window attention, (N · windows, w²,
        w²): each key token's column summed over its window's rows and divided by the grid's tokens (the mean over
        every row of the grid, a token outside the window having no gradient), on the grid, (N, H · W)."""
        if isinstance(layout, WindowPartition):
            if self.row == "class":
                raise ValueError("row='class' needs a class token; a window-attention model (Swin) has none. Use "
                                 "row='all', 'mean' or 'auto'.")
            count = positive.shape[0] // layout.windows
            return layout.to_grid(positive.sum(dim=1) / layout.tokens, count)
        if row == "all":
            return positive.mean(dim=1)
        return token_rows(positive, layout, row)

