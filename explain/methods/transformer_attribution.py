"""Transformer attribution (Chefer, Gur & Wolf 2021a, "Transformer interpretability beyond attention
visualization"): each block's attention maps weighted by their gradients and by their LRP relevance, rolled out.

Per block b, with A_b (N, heads, T, T) the attention probabilities, ∇A_b = ∂y/∂A_b the plain gradient of the score
and R_b the relevance of A_b for a relevance of 1 at the score:

    Ā_b = E_heads[(∇A_b ⊙ R_b)⁺],      R ← R + Ā_b · R   (from R = I, block after block from ``start_block``),

and the map is the row of R that the head reads (the class token's row, as their ``rollout[:, 0, 1:]``) over the
patch tokens. ``TransformerAttribution`` takes R_b from the authors' own LRP (``explain.methods._chefer_rules``:
α1β0 for linear layers, their normalised rule for residual sums, LRP-0 halved for attention's two products, the
identity for softmax, GELU and LayerNorm), as their code (hila-chefer/Transformer-Explainability, ``ViT_LRP.py``,
``method="transformer_attribution"``) computes it. ``AttnLRPRollout`` is a variant of ours: the same rollout with
R_b from AttnLRP's rules (Achtibat et al. 2024).

Window attention (Swin, Swin v2) is laid out on each stage's token grid (``explain.core.windows``): each Ā_b acts within
its (shifted) windows, patch merging makes each merged token's row the mean of its tokens' rows, and the map, the
mean of the last stage's rows, lies on the first stage's grid.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Optional

import torch
from torch import Tensor

from ..core.caller import warn_at_callers_line
from ..core.layouts import stage_layout
from ..core.targets import SelectedTargets, Target, select_targets
from ..core.windows import WindowPartition, spread_to_grid
from ._attnlrp_rules import AttnLrpRules, AttnLrpScope
from ._chefer_rules import CheferRules, CheferScope, OneImageAtATime
from .attention import AttentionMethod, Recorded, without_autocast
from .maps import Attribution
from .passes import reduced_precision
from .registry import register


def widened(tensor: Tensor, at_least: torch.dtype = torch.float32) -> Tensor:
    """A tensor in ``at_least`` (float32 or the input's wider dtype) or wider, for sums over heads and products over
    blocks: a float64 model whose attention computes its softmax in float32 (HuggingFace's eager attention) still
    gets a float64 rollout."""
    return tensor.to(torch.promote_types(tensor.dtype, at_least))


BlockRelevances = list[list[Optional[Tensor]]]
"""Per target, per rolled-out block: the relevance of the attention probabilities (None where the score does not
reach them)."""


class RelevanceWeightedRollout(AttentionMethod):
    """The shape of Transformer attribution: per block the attention maps' gradient times their relevance, positive
    part averaged over heads, rolled out as R ← R + Ā·R; the map is the row of R that the head reads over the patch
    tokens. Subclasses say where the relevance R_A comes from (``_relevances``). Options: see ``AttentionMethod``
    (blocks=, start_block=, row=, reshape=). ``Explanation.diagnostics``: "attention_blocks", the blocks rolled
    out."""

    uses_gradients = True
    reads_windows = True

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        with torch.enable_grad():
            recorded = self._record(batch, target, topk, detach=False)
            selected, attention, first = recorded.selected, recorded.attention, recorded.first
            gradients, zero_gradient, disconnected = self._gradients(selected, recorded.probabilities)
            recorded.probabilities.clear()
            relevances = self._relevances(batch, target, topk, recorded)
        selected.scores = selected.scores.detach()
        at_least = torch.promote_types(batch.dtype, torch.float32) if batch.is_floating_point() else torch.float32
        if recorded.partitions is not None:
            with without_autocast(batch.device):  # the products over the blocks: not in the caller's bfloat16
                grid_maps = self._window_rollout(relevances, gradients, recorded.partitions, first, batch.shape[0],
                                                 at_least)
            # 0 on pixels the patch embedding never reads
            maps = stage_layout(self.model, recorded.partitions[0].grid, batch.shape[-2:]).to_input(
                grid_maps, batch.shape[-2:])
        else:
            layout = recorded.token_layout
            with without_autocast(batch.device):  # the products over the blocks: not in the caller's bfloat16
                rolled = self._rollout(relevances, gradients, at_least)
            grid_maps = layout.apply(self._token_row(rolled, layout).transpose(1, 2))  # (N, K, h, w)
            maps = layout.to_input(grid_maps, batch.shape[-2:])  # 0 on pixels the patch embedding never reads
        return Attribution(maps=maps, selected=selected, low_res_maps=[grid_maps], zero_gradient=zero_gradient,
                           disconnected=disconnected, diagnostics={"attention_blocks": attention.modules[first:]})

    @abstractmethod
    def _relevances(self, batch: Tensor, target: Target, topk: Optional[int], recorded: Recorded) -> BlockRelevances:
        """Per target, the relevance of each rolled-out block's attention probabilities (shaped as they are)."""

    def _chosen(self, computed: list[tuple[Tensor, str]], recorded: Recorded) -> list[Tensor]:
        """The probabilities a relevance pass computed in the blocks the gradient pass recorded, from the first
        rolled out; an error if the two passes computed attention in different modules."""
        wanted = recorded.attention.modules
        selected = set(wanted)
        if [module for _, module in computed if module in selected] != wanted:
            raise RuntimeError(
                f"{type(self).__name__}: the relevance pass computed attention in {[m for _, m in computed]}, not in "
                f"the blocks the gradient pass recorded ({wanted}); the model's forward differs between two calls on "
                "the same input (a random or stateful forward?)."
            )
        return [probabilities for probabilities, module in computed if module in selected][recorded.first:]


    @staticmethod
    def _gradients(selected: SelectedTargets, probabilities: list[Tensor]
                   ) -> tuple[list[list[Optional[Tensor]]], Tensor, Tensor]:
        """Per target, ∂score/∂A of each block (None where the score does not depend on it); (N, K) flags: where
        the gradient is zero in every block, where the score does not depend on the attention at all."""
        targets = selected.scores.shape[1]
        per_target: list[list[Optional[Tensor]]] = []
        zero_gradient, disconnected = [], []
        for k in range(targets):
            score = selected.scores[:, k].sum()
            gradients: list[Optional[Tensor]] = [None] * len(probabilities)
            if score.requires_grad:
                gradients = list(torch.autograd.grad(score, probabilities, retain_graph=k < targets - 1,
                                                     allow_unused=True))
            nonzero = torch.zeros(selected.scores.shape[0], dtype=torch.bool, device=selected.scores.device)
            for gradient in gradients:
                if gradient is not None:
                    nonzero |= gradient.reshape(nonzero.shape[0], -1).ne(0).any(dim=1)
            per_target.append([None if gradient is None else gradient.detach() for gradient in gradients])
            zero_gradient.append(~nonzero)
            disconnected.append(torch.full_like(nonzero, all(gradient is None for gradient in gradients)))
        return per_target, torch.stack(zero_gradient, dim=1), torch.stack(disconnected, dim=1)

    @staticmethod
    def _rollout(relevances: list[list[Optional[Tensor]]], gradients: list[list[Optional[Tensor]]],
                 at_least: torch.dtype = torch.float32) -> Tensor:
        """(N, K, T, T): per target, R = Π_b (I + E_heads[(∇A_b ⊙ R_b)⁺]) in block order."""
        rolled = []
        for block_relevances, block_gradients in zip(relevances, gradients):
            shape = next((r.shape for r in block_relevances if r is not None),
                         next((g.shape for g in block_gradients if g is not None), None))
            assert shape is not None, "at least one block was recorded (AttentionMethod._checked)"
            count, tokens = shape[0], shape[-1]
            source = widened(next(t for t in block_relevances + block_gradients if t is not None), at_least)
            result = torch.eye(tokens, device=source.device, dtype=source.dtype).expand(count, tokens, tokens)
            for relevance, gradient in zip(block_relevances, block_gradients):
                if relevance is None or gradient is None:
                    continue
                weighted = (widened(gradient, at_least) * widened(relevance, at_least)).clamp(min=0).mean(dim=1)
                result = result + weighted @ result
            rolled.append(result)
        return torch.stack(rolled, dim=1)

    @staticmethod
    def _window_rollout(relevances: list[list[Optional[Tensor]]], gradients: list[list[Optional[Tensor]]],
                        partitions: list[WindowPartition], first: int, count: int,
                        at_least: torch.dtype = torch.float32) -> Tensor:
        """(N, K, H, W) on the first block's token grid: the same rollout for window attention (Swin), where each
        Ā_b (N · windows, w², w²) acts within its windows, and patch merging between stages maps 2 × 2 tokens to
        one (the merged token's row of R is the mean of its tokens' rows).

        The map is the mean of R's rows over the last stage's tokens (Swin's head averages them), computed from
        the end as a row vector, v ← v + Ā_bᵀ·v block by block, so that no (T, T) matrix is formed; before an
        earlier, finer stage, v[child] = v[merged token] / (its number of children)."""
        maps = []
        for block_relevances, block_gradients in zip(relevances, gradients):
            last = partitions[-1]
            source = widened(next(t for t in block_relevances + block_gradients if t is not None), at_least)
            row = torch.full((count, last.tokens), 1.0 / last.tokens, device=source.device, dtype=source.dtype)
            grid = last.grid
            for partition, relevance, gradient in reversed(list(zip(partitions[first:], block_relevances,
                                                                     block_gradients))):
                row, grid = spread_to_grid(row, grid, partition.grid), partition.grid
                if relevance is None or gradient is None:
                    continue
                # (N · windows, w², w²)
                weighted = (widened(gradient, at_least) * widened(relevance, at_least)).clamp(min=0).mean(dim=1)
                windowed = partition.from_grid(row)  # (N · windows, w²)
                row = row + partition.to_grid(torch.einsum("wij,wi->wj", weighted, windowed), count)
            row = spread_to_grid(row, grid, partitions[0].grid)
            maps.append(row.view(count, *partitions[0].grid))
        return torch.stack(maps, dim=1)


@register
class TransformerAttribution(RelevanceWeightedRollout):
    """Transformer attribution (Chefer, Gur & Wolf 2021a) as its authors compute it: per block the attention maps'
    gradient times their LRP relevance (the authors' rules: α1β0 for linear layers, their normalised rule for
    residual sums, LRP-0 halved for attention's two products), positive part averaged over heads, rolled out as
    R ← R + Ā·R from ``start_block``; the map is the row of R that the head reads over the patch tokens (the class
    token's row for a class-token head).

    The relevance starts at 1 for the explained score (∂score/∂output: the authors' one-hot vector), so a class
    scored below zero is explained as one scored above. Class-specific: per target one plain backward pass and one
    relevance backward pass (two forward passes in all). Options: see ``AttentionMethod`` (blocks=, start_block=,
    row=, reshape=). ``Explanation.diagnostics``: "attention_blocks", the blocks rolled out. A warning names the
    calls after the first rolled-out attention that have no rule (there the relevance follows the gradient).
    """

    name = "transformerattribution"
    summary = "Transformer attribution (Chefer et al. 2021a): attention gradients × the authors' LRP, rolled out"

    def _relevances(self, batch: Tensor, target: Target, topk: Optional[int], recorded: Recorded) -> BlockRelevances:
        """The relevance pass runs outside ``torch.autocast``: the authors' divisions (α1β0's z⁺, their ``Add``'s
        totals) round badly in bfloat16 (on a random 3-block timm ViT the maps moved by up to 0.23 of their maximum,
        against 0.009 with this pass in float32); a model that is itself in reduced precision is warned about."""
        with without_autocast(batch.device):
            precision = reduced_precision(self.model, batch)
            if precision is not None:
                warn_at_callers_line(
                    f"{self.method_name} ran in {precision}: the authors' LRP divides by sums of products that round "
                    "to 8-11 significant bits, so the relevance of the attention maps and the maps made of it differ "
                    "from the float32 model's (on a random 3-block timm ViT by up to 0.4 of the map's maximum). For "
                    "float32 maps, call explain on a float32 copy of the model (model.float()).", RuntimeWarning)
            return self._relevances_without_autocast(batch, recorded)

    def _relevances_without_autocast(self, batch: Tensor, recorded: Recorded) -> BlockRelevances:
        try:
            return self._relevance_pass(batch, recorded, None)
        except OneImageAtATime:  # the images' sums cannot be told apart in a batch: one image at a time
            pass
        per_image = [self._relevance_pass(batch[i : i + 1], recorded, torch.tensor([i]))
                     for i in range(batch.shape[0])]
        return [[None if any(image[k][b] is None for image in per_image)
                 else torch.cat([image[k][b] for image in per_image])  # type: ignore[misc]
                 for b in range(len(per_image[0][k]))] for k in range(len(per_image[0]))]

    def _relevance_pass(self, batch: Tensor, recorded: Recorded, rows: Optional[Tensor]) -> BlockRelevances:
        """One forward pass with the authors' rules and one relevance backward pass per target. rows: the image
        index of each row of ``batch`` (None: all images)."""
        computed: list[tuple[Tensor, str]] = []
        rules = CheferRules(self.model, batch.shape[0], lambda probabilities, module: computed.append(
            (probabilities, module)))
        inputs = batch.detach().requires_grad_(True)
        with CheferScope(self.model, rules):
            rules.follow(inputs)
            output = self.call_model(inputs, rows)
        images = torch.arange(batch.shape[0]) if rows is None else rows
        scores = recorded.selected.scores_for(output, images)  # seeded outside the rules: 1 at the score
        chosen = self._chosen(computed, recorded)
        self._warn_about_gaps(rules, recorded.first)
        targets = scores.shape[1]
        per_target: BlockRelevances = []
        for k in range(targets):
            relevances: list[Optional[Tensor]] = [None] * len(chosen)
            if scores.requires_grad:
                relevances = [None if relevance is None else relevance.detach() for relevance in torch.autograd.grad(
                    scores[:, k].sum(), chosen, retain_graph=k < targets - 1, allow_unused=True)]
            per_target.append(relevances)
        return per_target

    def _warn_about_gaps(self, rules: CheferRules, first: int) -> None:
        names = [name for name, attention_before in rules.unruled.items() if attention_before > first]
        if not names:
            return
        listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        warn_at_callers_line(
            f"{self.method_name}: no rule of Chefer et al. for {listed} between the attention and the output: there "
            "the relevance follows the plain gradient (rules cover linear layers, convolutions, sums, products, "
            "softmax, normalisation, elementwise activations, pooling and reshaping).", RuntimeWarning)


@register
class AttnLRPRollout(RelevanceWeightedRollout):
    """A variant of Transformer attribution (not the paper's method): Chefer et al.'s rollout of E_heads[(∇A ⊙
    R_A)⁺] with the relevance R_A of the attention maps taken from AttnLRP's rules (Achtibat et al. 2024: the
    softmax and products' rules that conserve relevance through attention) instead of the authors' α1β0 LRP,
    divided by |score| (a relevance of size 1 at the score; the absolute value keeps a class scored below zero
    from getting a blank map). How it compares with ``TransformerAttribution``: docs/transformers.md.

    Class-specific: per target one plain backward pass and one AttnLRP backward pass (two forward passes in all).
    Options: see ``AttentionMethod`` (blocks=, start_block=, row=, reshape=). ``Explanation.diagnostics``:
    "attention_blocks", the blocks rolled out.
    """

    name = "attnlrprollout"
    summary = "Transformer attribution's rollout with AttnLRP's relevance of the attention (a variant)"

    def _relevances(self, batch: Tensor, target: Target, topk: Optional[int], recorded: Recorded) -> BlockRelevances:
        """Per target, A ⊙ (AttnLRP's modified gradient) / |score|. (Divided by the score itself, a negative score
        would flip every sign, and the positive part of ∇A ⊙ R_A would keep nothing: a blank map for any class the
        model scores below zero.)"""
        computed: list[tuple[Tensor, str]] = []
        rules = AttnLrpRules(self.model, on_attention=lambda probabilities, module: computed.append(
            (probabilities, module)))
        inputs = batch.detach().requires_grad_(True)
        with AttnLrpScope(self.model, rules):
            rules.follow(inputs)
            output = self.call_model(inputs)
            selected = select_targets(output, target, topk, batch_size=batch.shape[0])  # with the rules, as AttnLRP
        chosen = self._chosen(computed, recorded)
        targets = selected.scores.shape[1]
        per_target: BlockRelevances = []
        for k in range(targets):
            score = selected.scores[:, k]
            relevances: list[Optional[Tensor]] = [None] * len(chosen)
            if score.requires_grad:
                gradients = torch.autograd.grad(score.sum(), chosen, retain_graph=k < targets - 1, allow_unused=True)
                unit = torch.where(score.detach() == 0, torch.ones_like(score), score.detach().abs()).view(-1, 1, 1, 1)
                relevances = [None if gradient is None else probabilities.detach() * gradient
                              / unit.repeat_interleave(probabilities.shape[0] // unit.shape[0], dim=0)  # windows
                              for probabilities, gradient in zip(chosen, gradients)]
            per_target.append(relevances)
        return per_target
