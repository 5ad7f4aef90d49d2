"""Attention-based methods for vision transformers: attention rollout and gradient-weighted rollout.

Both read each block's attention probabilities A (N, heads, T, T) through
``explain.core.attention.capture_attention``, whatever computes them (fused
``scaled_dot_product_attention``, ``nn.MultiheadAttention``, eager softmax), roll them out
across the blocks into a (T, T) relevance matrix R per image, and read one row of R over the
patch tokens, laid out on the patch grid as the CAMs lay tokens out (``explain.core.layouts``: the
class, distillation and register tokens and the patch grid as the model states them, else
inferred from the token count and the input size).

The row is what the model's head reads: the class token's row when the head reads the class
token; the mean of the patch tokens' rows when it averages the patch tokens (global average
pooling: timm ``global_pool="avg"``, with or without register tokens, and models with patch
tokens only), each patch token's share of that average; the mean of the class and distillation
tokens' rows for a distilled DeiT (timm ``deit_*_distilled``, HF ``DeiTForImageClassificationWithTeacher``),
whose logits are the mean of two linear heads', one on each token (the one token's row where ``output=``
chooses HF's ``"cls_logits"`` or ``"distillation_logits"``). HF ``Dinov2ForImageClassification``
reads the class token and the patch tokens' mean concatenated, through one linear layer whose learned weights
set their shares: no fixed row is what it reads, so "auto" reads the class row there and warns.
A head that averages every token, class and register tokens included (timm ``pool_include_prefix=True``), is read
as the mean of every token's row. An attention-pooling head (timm ``global_pool="map"``, HF SigLIP's), whose
weights of the tokens are its own attention to a learned query, is not self-attention over the tokens and cannot be
rolled out with the blocks (a ValueError names the ``blocks=`` that keeps the blocks); with the blocks chosen, "auto"
reads the mean of the rows of the tokens it pools, every token weighed alike, and warns.
``row="class"``, ``"mean"`` or ``"all"`` chooses explicitly.

The map of a single patch (an input no larger than one patch) is constant, no explanation: a ValueError says so.

A ``torch.compile``'d model is explained through the module it wraps (``_orig_mod``, the same
weights), since compiled code runs no call-scoped rule; a module compiled in place is refused
(``explain.core.attention.eager_model``).
"""

from __future__ import annotations

import contextlib
import numbers
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, ContextManager, Optional, Sequence

import torch
from torch import Tensor
from typing_extensions import Unpack

from ..core.attention import BlockSpec, CapturedAttention, capture_attention
from ..core.caller import warn_at_callers_line
from ..core.layouts import Layout, attention_pooling_head, token_layout
from ..core.scope import CallScope
from ..core.targets import SelectedTargets, Target, select_targets
from ..core.windows import WindowPartition, WindowWatch, watch_windows
from ..io.loaded_model import ModelSource
from .base import Explainer
from .maps import Attribution
from .passes import autocast_dtype
from .registry import register
from .signatures import ExplainerOptions

HEAD_FUSIONS = ("mean", "max", "min")


def without_autocast(device: torch.device) -> ContextManager[object]:
    """The caller's ``torch.autocast`` turned off on ``device``'s type, for a method's own arithmetic on what the
    model computed (the products of attention matrices over the blocks), which autocast would otherwise run in
    bfloat16 or float16 and return in it (on a random 12-block timm ViT the rollout moved by 0.004 of its maximum,
    against 0.0003 for the model's bfloat16 attention rolled out in float32)."""
    if autocast_dtype(device.type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def full_precision(dtype: torch.dtype) -> torch.dtype:
    """The dtype a rollout is computed in: float32, or the probabilities' wider dtype (a float64 model's)."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class Recorded:
    """What ``AttentionMethod._record`` read in one forward pass: the record, the selected targets, the (N, heads,
    T, T) probabilities of the blocks rolled out (or (N · windows, heads, w², w²) for window attention), the token
    layout (None for window attention), each recorded block's window partition (None unless window attention), the
    index of the first block rolled out."""

    attention: CapturedAttention
    selected: SelectedTargets
    probabilities: list[Tensor]
    layout: Optional[Layout]
    partitions: Optional[list[WindowPartition]]
    first: int

    @property
    def token_layout(self) -> Layout:
        assert self.layout is not None, "self-attention over the image's tokens has a token layout"
        return self.layout

Relevance = tuple[Tensor, Optional[Tensor], Optional[Tensor]]
ROWS = ("auto", "class", "mean", "all")
SINGLE_HEADS = {"cls_logits": "class", "distillation_logits": "distillation"}
"""HF DeiT with teacher's outputs of one head each (``output=``), and the token that head reads."""


class AttentionOptions(ExplainerOptions, total=False):
    """The keyword options every attention method takes (see ``AttentionExplainer``)."""

    blocks: BlockSpec
    start_block: int
    row: str
    reshape: Optional[Sequence[int]]


def checked_start_block(start_block: object) -> int:
    """``start_block`` as an int (numpy ints too), else a ValueError naming the option and what it takes: not a
    bool (True would silently be block 1), not a float such as 1.5. Its range is checked against the model's
    blocks during a call."""
    if isinstance(start_block, bool) or not isinstance(start_block, numbers.Integral):
        raise ValueError(f"start_block must be an int: the first block used, an index among the recorded blocks (0 "
                         f"the first, negative from the end); got {start_block!r} ({type(start_block).__name__}).")
    return int(start_block)


class AttentionMethod(Explainer):
    """Shared by the attention methods: which blocks' attention is recorded, the checks of what was recorded, and
    the row of the relevance that the head reads.

    blocks: which attention layers: None (every attention computed inside the model), or the
        modules computing it (a name such as ``"vision_model"`` for CLIP's image tower, a glob,
        a module or a module type; see ``explain.capture_attention``).
    start_block: the first block rolled out (an index among the recorded blocks; negative from
        the end). row: "auto" (what the head reads: the class token's row; for a head that
        averages the patch tokens the mean of their rows; for a distilled DeiT the mean of the
        class and distillation tokens' rows; for HF DINOv2's head, which reads the class token and
        the patch tokens' mean, the class row with a warning; for a head that pools every token, timm's
        ``pool_include_prefix=True``, every token's row; for an attention-pooling head, the mean of the rows of
        the tokens it pools, with a warning), "class", "mean" (over the patch tokens' rows) or "all" (over every
        token's row, class and register tokens included). reshape: (h, w), the patch grid, when the
        guess is wrong (the last h·w tokens are the patches; the tokens before them must be the
        model's class, distillation and register tokens, else a ValueError lists the grids that fit).
    A ``torch.compile``'d model is run through the module it wraps (``model._orig_mod``), which
    becomes ``self.model``. Other keyword arguments: see ``Explainer``.
    """

    needs_attention: ClassVar[bool] = True
    """Marks methods that need a transformer (attention layers) rather than any model."""
    uses_gradients: ClassVar[bool] = False
    reads_windows: ClassVar[bool] = False
    """Marks methods that lay window attention (Swin) out on each stage's token grid; the others refuse it."""

    def __init__(
        self,
        model: ModelSource,
        *,
        blocks: BlockSpec = None,
        start_block: int = 0,
        row: str = "auto",
        reshape: Optional[Sequence[int]] = None,
        **options: Unpack[ExplainerOptions],
    ):
        super().__init__(model, **options)  # a torch.compile(model) is explained through the module it wraps
        if row not in ROWS:
            raise ValueError(f"row must be one of {ROWS}; got {row!r}.")
        self.blocks = blocks
        self.start_block = checked_start_block(start_block)
        self.row = row
        self.reshape = reshape

    def _record(self, batch: Tensor, target: Target, topk: Optional[int], *, detach: bool) -> Recorded:
        """One forward pass with the selected blocks' attention recorded (and, for a method that reads windows,
        each window block's partition). detach: False keeps the probabilities in the graph, for their gradients."""
        count = batch.shape[0]
        with CallScope(self.model) as scope:
            windows = watch_windows(scope, self.model) if self.reads_windows else None
            with capture_attention(self.model, self.blocks, detach=detach) as attention:
                # kept in the graph: the input is in it, so the attention is even when no parameter requires grad
                inputs = batch if detach else batch.detach().requires_grad_(batch.is_floating_point())
                output = self.call_model(inputs)
        selected = select_targets(output, target, topk, batch_size=count)
        partitions = self._window_partitions(attention, windows, count)
        probabilities = self._checked(attention, count) if partitions is None else attention.probabilities
        layout = None if partitions is not None else token_layout(
            probabilities[0].shape[-1], batch.shape[-2:], self.reshape, self.model, "the attention",
            whole_sequence=True)
        if layout is not None:
            check_patches(layout.grid, batch.shape[-2:], type(self).__name__)
        first = self._first_block(len(probabilities))
        return Recorded(attention, selected, probabilities[first:], layout, partitions, first)

    def _window_partitions(self, attention: CapturedAttention, windows: Optional[WindowWatch],
                           count: int) -> Optional[list[WindowPartition]]:
        """Each recorded block's window partition, when every block computed window attention (Swin) and this
        method reads windows; None otherwise (the attention is then checked as self-attention over the image)."""
        if windows is None or not attention.records:
            return None
        partitions = windows.partitions(attention.modules)
        if any(partition is None for partition in partitions):
            return None
        chosen = [partition for partition in partitions if partition is not None]
        for partition, record in zip(chosen, attention.records):
            partition.check(record.probabilities, count, record.module)
        if self.row == "class":
            raise ValueError("row='class' needs a class token; a window-attention model (Swin) has none: its head "
                             "averages the last stage's tokens. Use row='mean' (or 'auto').")
        return chosen

    def _first_block(self, blocks: int) -> int:
        if not -blocks <= self.start_block < blocks:
            raise ValueError(f"start_block={self.start_block} is out of range: the model has {blocks} attention "
                             "block(s).")
        return self.start_block % blocks

    def _checked(self, attention: CapturedAttention, count: int) -> list[Tensor]:
        """The recorded probabilities, or an error saying why this model's attention cannot be rolled out."""
        probabilities = attention.probabilities
        if not probabilities:
            seen = [str(softmax) for softmax in attention.skipped]
            if len(seen) > 3:
                seen[3:] = [f"{len(seen) - 3} more"]
            saw = f"It saw only {'; '.join(seen)}, which is not attention. " if seen else ""
            if self.blocks is not None:
                chosen = (f"none of the {attention.computed} attention call(s) the model computed" if attention.computed
                          else "modules inside which no attention is computed")
                raise ValueError(
                    f"blocks={self.blocks!r} chooses {chosen}. {saw}With blocks=None every attention computed inside "
                    "the model is read; see explain.capture_attention for names, globs, module types and positions."
                )
            raise ValueError(
                f"{type(self).__name__} found no attention in the model's forward pass: it looks for "
                "F.scaled_dot_product_attention, nn.MultiheadAttention, and a softmax over the last dimension of "
                f"(N, heads, T, T) scores computed as a product of queries and keys, QKᵀ. {saw}Attention methods "
                "need a transformer; for other models use GradCAM."
            )
        if any(p.shape[0] != count and p.shape[0] % count == 0 for p in probabilities):
            most = max(p.shape[0] for p in probabilities)
            rows = f"some attention has {most} rows for the {count} image(s) explained"
            if self.reads_windows:  # the window path did not recognise it: not Swin's windows
                raise ValueError(
                    f"{rows}, in groups of tokens that are not Swin-style windows of one token grid (MobileViT "
                    f"attends within folded patches, for one): {type(self).__name__} lays out only Swin-style window "
                    "attention. Use AttnLRP, which reads any attention, or GradCAM(model) with its automatic layer."
                )
            raise ValueError(
                f"{rows}: this looks like window attention (Swin's local windows, MobileViT's folded patches), so no "
                "token-to-token matrix of the whole image exists to roll out. For Swin use TransformerAttribution, "
                "AttnLRP or LeGrad, which read window attention; for other models AttnLRP, or GradCAM(model) with its "
                "automatic layer."
            )
        shapes = sorted({(p.shape[0], *p.shape[-2:]) for p in probabilities})
        if len(shapes) > 1 or shapes[0][1] != shapes[0][2] or shapes[0][0] != count:
            listed = ", ".join(f"{rows} × {queries} × {keys}" for rows, queries, keys in shapes)
            raise ValueError(
                f"the recorded attention matrices (rows × queries × keys: {listed}) are not self-attention over "
                f"the same tokens of the {count} image(s) in every block, which rollout needs. Attention of other "
                "inputs (CLIP's text tower), token merging, pooled keys, cross-attention or an attention-pooling "
                "head (timm's global_pool='map', SigLIP's head) are recorded too: choose the image's blocks with "
                f"blocks= ({self._blocks_hint(attention, count)}), or use AttnLRP or GradCAM(model)."
            )
        return probabilities

    @staticmethod
    def _blocks_hint(attention: CapturedAttention, count: int) -> str:
        """Where each shape of attention was computed, and the ``blocks=`` that keeps the image's self-attention:
        the most frequent (count, T, T) shape (the most tokens among equals), named by the innermost module holding
        all its calls and none of the others, else by positions."""
        shapes = [(int(p.shape[0]), *map(int, p.shape[-2:])) for p in attention.probabilities]
        where: dict[tuple[int, ...], list[str]] = {}
        for shape, module in zip(shapes, attention.modules):
            where.setdefault(shape, []).append(module)
        named = "; ".join(f"{shape[1]} × {shape[2]} in {', '.join(repr(m) for m in modules[:3])}"
                          + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
                          for shape, modules in where.items())
        candidates = [shape for shape in where if shape[0] == count and shape[1] == shape[2]]
        if not candidates:
            return f"{named}; no block attends among one image's tokens"
        kept = max(candidates, key=lambda shape: (len(where[shape]), shape[2]))
        chosen = [part.split(".") for part in where[kept]]
        common = next((chosen[0][:length] for length in range(len(chosen[0]), 0, -1)
                       if all(parts[:length] == chosen[0][:length] for parts in chosen)), [])
        prefix = ".".join(common)
        others = [module for shape, modules in where.items() if shape != kept for module in modules]
        if prefix and not any(module == prefix or module.startswith(prefix + ".") for module in others):
            return f"{named}: blocks={prefix!r} keeps the {kept[1]} × {kept[2]} self-attention"
        positions = [index for index, shape in enumerate(shapes) if shape == kept]
        return f"{named}: blocks={positions} (positions in call order) keeps the {kept[1]} × {kept[2]} self-attention"

    row_hint: ClassVar[str] = "row='mean' (or 'auto')"
    """The rows to suggest where row='class' finds no class token."""
    pool_hint: ClassVar[str] = "or use AttnLRP or LeGrad, which read the model through its head"
    """What else to suggest where "auto" reads the tokens an attention-pooling head pools."""

    def _token_row(self, relevance: Tensor, layout: Layout) -> Tensor:
        """(..., T, T) → (..., T): the query row(s) ``row`` chooses (see ``AttentionMethod``)."""
        return token_rows(relevance, layout, self._head_row(layout))

    def _head_row(self, layout: Layout) -> str:
        """The row read: ``row``, or for "auto" what the head reads (``layout.readout``); HF DINOv2's head, which
        reads no one row, gets the class row and a warning; an attention-pooling head (``attention_pooling_head``)
        the mean of the rows of the tokens it pools, and a warning. A ValueError for row='class' without a class
        token."""
        row = layout.readout if self.row == "auto" else self.row
        if row == "class+distillation" and self.row == "auto" and isinstance(self.output, str) \
                and self.output in SINGLE_HEADS:
            return SINGLE_HEADS[self.output]  # output= chooses one of the two heads: the token it reads
        if row == "class+mean":
            warn_at_callers_line(
                f"{type(self).__name__}(row='auto') reads the class token's row, but this model's head (HF "
                "Dinov2ForImageClassification) reads the class token and the mean of the patch tokens, concatenated, "
                "through one linear layer whose weights set their shares, so no one row is what it reads. Pass "
                "row='class' or row='mean' to choose one part (and silence this warning).", UserWarning)
            row = "class"
        pool = attention_pooling_head(self.model) if self.row == "auto" and row in ("mean", "all") else None
        if pool is not None:
            rows = "the patch tokens' rows" if row == "mean" and layout.prefix else "every token's row"
            warn_at_callers_line(
                f"{type(self).__name__}(row='auto') reads the mean of {rows}, every token weighed "
                f"alike, but this model's head pools the tokens with attention ({pool!r}: a learned query, as timm's "
                "global_pool='map' and SigLIP's head), whose weights of the tokens are its own attention, not a row "
                f"of the blocks' attention, so no one row is what it reads. Pass row={row!r} to choose this reading "
                f"(and silence this warning), {self.pool_hint}.", UserWarning)
        if row == "class" and not layout.class_token:
            raise ValueError(f"row='class' needs a class token; this model has none ({layout.prefix} token(s) "
                             f"before the patches, none a class token). Use {self.row_hint}.")
        return row


def token_rows(relevance: Tensor, layout: Layout, row: str) -> Tensor:
    """(..., T, T) → (..., T): for ``row`` "class" the class token's row, "mean" the mean of the patch tokens' rows,
    "class+distillation" the mean of the class and distillation tokens' rows (a distilled DeiT's logits are the mean
    of two linear heads', one on each token, so each token carries half of the score), "distillation" the
    distillation token's row, "all" the mean of every token's row (class and register tokens included)."""
    if row == "all":
        return relevance.mean(dim=-2)
    if row == "class+distillation":
        return relevance[..., :2, :].mean(dim=-2)
    if row == "distillation":
        return relevance[..., 1, :]
    if row == "class":
        return relevance[..., 0, :]
    return relevance[..., layout.prefix :, :].mean(dim=-2)


def check_patches(grid: Optional[Sequence[int]], input_size: Sequence[int], method: str) -> None:
    """A ValueError where the map's grid holds a single patch, on which any map is constant: no explanation."""
    if grid is not None and int(grid[0]) * int(grid[1]) == 1:
        raise ValueError(
            f"{method} lays its map out on the model's patch grid, and this {int(input_size[0])}×{int(input_size[1])} "
            "input gives a single patch (1 × 1), on which every map is constant: it says nothing about where the "
            "evidence lies. Pass a larger input (several patches in each direction, e.g. the model's training size), "
            "or use a method that explains pixels (IntegratedGradients, Saliency).")


class AttentionExplainer(AttentionMethod):
    """The rollouts' shape: records the blocks' attention during the forward pass and rolls out a relevance
    computed from the probabilities (``relevance``). Options: see ``AttentionMethod``."""

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        with torch.enable_grad() if self.uses_gradients else torch.no_grad():
            recorded = self._record(batch, target, topk, detach=not self.uses_gradients)
            with without_autocast(batch.device):  # the model ran under the caller's autocast; the rollout need not
                relevance, zero_gradient, disconnected = self.relevance(recorded.probabilities, recorded.selected)
        selected = recorded.selected
        selected.scores = selected.scores.detach()
        layout = recorded.token_layout
        grid_maps = layout.apply(self._token_row(relevance.detach(), layout).transpose(1, 2))  # (N, K, h, w)
        maps = layout.to_input(grid_maps, batch.shape[-2:])  # 0 on pixels the patch embedding never reads
        return Attribution(maps=maps, selected=selected, low_res_maps=[grid_maps], zero_gradient=zero_gradient,
                           disconnected=disconnected,
                           diagnostics={"attention_blocks": recorded.attention.modules[recorded.first:]})

    @abstractmethod
    def relevance(self, probabilities: list[Tensor], selected: SelectedTargets) -> Relevance:
        """The method: each rolled-out block's (N, heads, T, T) probabilities → (N, K, T, T) relevance,
        and for gradient methods (N, K) flags: where ∂score/∂A was zero in every block, and where the
        score does not depend on the attention at all (None for methods without gradients)."""


@register
class AttentionRollout(AttentionExplainer):
    """Attention rollout (Abnar & Zuidema 2020): R = Â_L ⋯ Â_s, with Â each block's attention fused
    over heads, the identity added for the residual connection and rows renormalised to sum to 1.

    head_fusion: "mean" (the paper), "max" or "min" over heads. discard_ratio: the share in
    [0, 1) of each image's smallest fused attention weights set to 0 before the identity is
    added (1 − ratio of the weights kept). Class-agnostic: every target of an image gets the same
    map. Other options: see ``AttentionExplainer``.
    """

    name = "attentionrollout"
    summary = "Attention rollout: attention fused over heads, multiplied across blocks (class-agnostic)"

    def __init__(self, model: ModelSource, *, head_fusion: str = "mean", discard_ratio: float = 0.0,
                 **options: Unpack[AttentionOptions]):
        super().__init__(model, **options)
        if head_fusion not in HEAD_FUSIONS:
            raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}; got {head_fusion!r}.")
        if not 0.0 <= discard_ratio < 1.0:
            raise ValueError(f"discard_ratio must be in [0, 1); got {discard_ratio!r}.")
        self.head_fusion = head_fusion
        self.discard_ratio = discard_ratio

    def relevance(self, probabilities: list[Tensor], selected: SelectedTargets) -> Relevance:
        count, tokens = probabilities[0].shape[0], probabilities[0].shape[-1]
        dtype = full_precision(probabilities[0].dtype)
        identity = torch.eye(tokens, device=probabilities[0].device, dtype=dtype)
        rollout = identity.expand(count, tokens, tokens)
        for block in probabilities:
            block = block.to(dtype)
            fused = {"mean": block.mean(dim=1), "max": block.amax(dim=1), "min": block.amin(dim=1)}[self.head_fusion]
            discarded = int(self.discard_ratio * tokens * tokens)
            if discarded:
                flat = fused.reshape(count, -1)
                smallest = flat.topk(discarded, dim=1, largest=False).indices
                fused = flat.scatter(1, smallest, 0.0).reshape(count, tokens, tokens)
            with_residual = fused + identity
            rollout = (with_residual / with_residual.sum(dim=-1, keepdim=True)) @ rollout
        return rollout.unsqueeze(1).expand(-1, selected.scores.shape[1], -1, -1), None, None


@register
class GradientAttentionRollout(AttentionExplainer):
    """Gradient-weighted attention rollout (Chefer, Gur & Wolf 2021, "Generic attention-model
    explainability"): per block Ā = mean over heads of (∂y/∂A ⊙ A)⁺, and R ← R + Ā·R from R = I,
    block after block; the map is the row of R that the head reads (see ``row``) over the patch tokens.

    Class-specific: one backward pass per target (K targets per image), each giving every
    image of the batch its own gradient. Other options: see ``AttentionExplainer``.
    """

    name = "gradientrollout"
    summary = "Gradient-weighted attention rollout (Chefer et al. 2021): class-specific, for transformers and CLIP"
    uses_gradients = True

    def relevance(self, probabilities: list[Tensor], selected: SelectedTargets) -> Relevance:
        count, tokens = probabilities[0].shape[0], probabilities[0].shape[-1]
        targets = selected.scores.shape[1]
        dtype = full_precision(probabilities[0].dtype)
        identity = torch.eye(tokens, device=probabilities[0].device, dtype=dtype)
        per_target: list[Tensor] = []
        zero_gradient: list[Tensor] = []
        disconnected: list[Tensor] = []
        for target_index in range(targets):
            score = selected.scores[:, target_index].sum()
            gradients: Sequence[Optional[Tensor]] = [None] * len(probabilities)
            if score.requires_grad:
                gradients = torch.autograd.grad(score, probabilities, retain_graph=target_index < targets - 1,
                                                allow_unused=True)
            relevance = identity.expand(count, tokens, tokens)
            nonzero = torch.zeros(count, dtype=torch.bool, device=identity.device)
            for block, gradient in zip(probabilities, gradients):
                if gradient is None:
                    continue
                nonzero |= gradient.reshape(nonzero.shape[0], -1).ne(0).any(dim=1)
                weighted = (gradient.to(dtype) * block.detach().to(dtype)).clamp(min=0).mean(dim=1)
                relevance = relevance + weighted @ relevance
            per_target.append(relevance)
            zero_gradient.append(~nonzero)
            disconnected.append(torch.full_like(nonzero, all(gradient is None for gradient in gradients)))
        return torch.stack(per_target, dim=1), torch.stack(zero_gradient, dim=1), torch.stack(disconnected, dim=1)
