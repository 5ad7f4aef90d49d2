"""Transformer attribution (Chefer, Gur & Wolf 2021a, "Transformer interpretability beyond attention
visualization"): each block's attention maps weighted by their gradients and by their LRP relevance, rolled out.

Per block b, with A_b (N, heads, T, T) the attention probabilities, ∇A_b = ∂y/∂A_b the plain gradient and R_b the
LRP relevance of A_b for a unit relevance at the score:

    Ā_b = E_heads[(∇A_b ⊙ R_b)⁺],      R ← R + Ā_b · R   (from R = I, block after block),

and the map is the row of R that the head reads over the patch tokens (as the rollouts read it). Window attention
(Swin, Swin v2) is laid out on each stage's token grid (``explain.windows``): each Ā_b acts within its (shifted)
windows, patch merging makes each merged token's row the mean of its tokens' rows, and the map, the mean of the last
stage's rows, lies on the first stage's grid. The relevance R_b
is AttnLRP's (Achtibat et al. 2024: the softmax and products' rules that conserve relevance through attention), not
the α1β0 and pass-through rules of the 2021 code, which AttnLRP supersedes; it is computed as A_b times the modified
gradient of one AttnLRP backward pass, divided by |score| (Chefer et al. start from relevance 1 at the target; the
absolute value keeps a class scored below zero from getting a blank map, as the sign would flip every term).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..attention import CapturedAttention
from ..targets import SelectedTargets, Target, select_targets
from ..windows import WindowPartition, spread_to_grid
from ._attnlrp_rules import AttnLrpRules, AttnLrpScope
from .attention import AttentionMethod
from .base import Attribution, register


@register
class TransformerAttribution(AttentionMethod):
    """Transformer attribution (Chefer et al. 2021a): per block, the attention maps' gradient times their LRP
    relevance (AttnLRP's rules), positive part averaged over heads, rolled out as R ← R + Ā·R; the map is the row of
    R that the head reads over the patch tokens.

    Class-specific: per target one plain backward pass and one AttnLRP backward pass (two forward passes in all).
    Options: see ``AttentionMethod`` (blocks=, start_block=, row=, reshape=). ``Explanation.diagnostics``:
    "attention_blocks", the blocks rolled out.
    """

    name = "transformerattribution"
    summary = "Transformer attribution (Chefer et al. 2021a): attention gradients × LRP relevance, rolled out"
    uses_gradients = True

    reads_windows = True

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        with torch.enable_grad():
            recorded = self._record(batch, target, topk, detach=False)
            selected, attention, first = recorded.selected, recorded.attention, recorded.first
            gradients, zero_gradient, disconnected = self._gradients(selected, recorded.probabilities)
            recorded.probabilities.clear()
            relevances = self._relevances(batch, target, topk, attention, first)
        selected.scores = selected.scores.detach()
        if recorded.partitions is not None:
            maps = self._window_rollout(relevances, gradients, recorded.partitions, first, batch.shape[0])
        else:
            layout = recorded.token_layout
            rolled = self._rollout(relevances, gradients)
            maps = layout.apply(self._token_row(rolled, layout).transpose(1, 2))  # (N, K, h, w)
        return Attribution(maps=maps, selected=selected, low_res_maps=[maps], zero_gradient=zero_gradient,
                           disconnected=disconnected, diagnostics={"attention_blocks": attention.modules[first:]})

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

    def _relevances(self, batch: Tensor, target: Target, topk: Optional[int], attention: CapturedAttention,
                    first: int) -> list[list[Optional[Tensor]]]:
        """Per target, the AttnLRP relevance of each rolled-out block's attention maps, for relevance of size 1 at
        the score: A ⊙ (modified gradient) / |score|. (Divided by the score itself, a negative score would flip
        every sign, and the positive part of ∇A ⊙ R_A would keep nothing: a blank map for any class the model
        scores below zero.)"""
        recorded: list[tuple[Tensor, str]] = []
        rules = AttnLrpRules(self.model, on_attention=lambda probabilities, module: recorded.append(
            (probabilities, module)))
        inputs = batch.detach().requires_grad_(True)
        with AttnLrpScope(self.model, rules):
            rules.follow(inputs)
            output = self.call_model(inputs)
            selected = select_targets(output, target, topk, batch_size=batch.shape[0])  # with the rules, as AttnLRP
        wanted = attention.modules
        chosen = [probabilities for probabilities, module in recorded if module in set(wanted)]
        if [module for _, module in recorded if module in set(wanted)] != wanted:
            raise RuntimeError(
                f"{type(self).__name__}: the relevance pass computed attention in {[m for _, m in recorded]}, not in "
                f"the blocks the gradient pass recorded ({wanted}); the model's forward differs between two calls on "
                "the same input (a random or stateful forward?)."
            )
        chosen = chosen[first:]
        targets = selected.scores.shape[1]
        per_target: list[list[Optional[Tensor]]] = []
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

    @staticmethod
    def _rollout(relevances: list[list[Optional[Tensor]]], gradients: list[list[Optional[Tensor]]]) -> Tensor:
        """(N, K, T, T): per target, R = Π_b (I + E_heads[(∇A_b ⊙ R_b)⁺]) in block order."""
        rolled = []
        for block_relevances, block_gradients in zip(relevances, gradients):
            shape = next((r.shape for r in block_relevances if r is not None),
                         next((g.shape for g in block_gradients if g is not None), None))
            assert shape is not None, "at least one block was recorded (AttentionMethod._checked)"
            count, tokens = shape[0], shape[-1]
            device = next(t for t in block_relevances + block_gradients if t is not None).device
            result = torch.eye(tokens, device=device).expand(count, tokens, tokens)
            for relevance, gradient in zip(block_relevances, block_gradients):
                if relevance is None or gradient is None:
                    continue
                weighted = (gradient.float() * relevance.float()).clamp(min=0).mean(dim=1)
                result = result + weighted @ result
            rolled.append(result)
        return torch.stack(rolled, dim=1)

    @staticmethod
    def _window_rollout(relevances: list[list[Optional[Tensor]]], gradients: list[list[Optional[Tensor]]],
                        partitions: list[WindowPartition], first: int, count: int) -> Tensor:
        """(N, K, H, W) on the first block's token grid: the same rollout for window attention (Swin), where each
        Ā_b (N · windows, w², w²) acts within its windows, and patch merging between stages maps 2 × 2 tokens to
        one (the merged token's row of R is the mean of its tokens' rows).

        The map is the mean of R's rows over the last stage's tokens (Swin's head averages them), computed from
        the end as a row vector, v ← v + Ā_bᵀ·v block by block, so that no (T, T) matrix is formed; before an
        earlier, finer stage, v[child] = v[merged token] / (its number of children)."""
        maps = []
        for block_relevances, block_gradients in zip(relevances, gradients):
            last = partitions[-1]
            device = next(t for t in block_relevances + block_gradients if t is not None).device
            row = torch.full((count, last.tokens), 1.0 / last.tokens, device=device)
            grid = last.grid
            for partition, relevance, gradient in reversed(list(zip(partitions[first:], block_relevances,
                                                                     block_gradients))):
                row, grid = spread_to_grid(row, grid, partition.grid), partition.grid
                if relevance is None or gradient is None:
                    continue
                weighted = (gradient.float() * relevance.float()).clamp(min=0).mean(dim=1)  # (N · windows, w², w²)
                windowed = partition.from_grid(row)  # (N · windows, w²)
                row = row + partition.to_grid(torch.einsum("wij,wi->wj", weighted, windowed), count)
            row = spread_to_grid(row, grid, partitions[0].grid)
            maps.append(row.view(count, *partitions[0].grid))
        return torch.stack(maps, dim=1)
