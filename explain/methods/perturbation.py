"""CAMs whose channel weights come from forward passes on perturbed inputs or features.

Both run without any autograd graph, batch their forward passes (``batch_size``
copies per pass) and show a progress bar on long runs.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Unpack

from ..core.caller import warn_at_callers_line
from ..core.capture import ModelInputError
from ..core.edit import edit
from ..core.targets import SelectedTargets
from ..io.loaded_model import ModelSource
from ._eval_batch_norm import uses_batch_statistics
from .cam import (
    CAM,
    FLOAT32_ROUNDOFF,
    ROUNDING_GROWTH,
    ROUNDING_TOLERANCE,
    CAMOptions,
    TargetLayers,
    precision_name,
    weighted_sum,
    working_unit_roundoff,
)
from .options import NoiseDraws, drawn_noise, int_option, noise_options, normal_draws
from .registry import register


def batch_statistics_layers(model: nn.Module) -> list[str]:
    """The BatchNorm modules of ``model`` that normalise by the statistics of the batch even in eval mode
    (``track_running_stats=False``): through them, the rows of a batch change each other's scores."""
    return [name or type(model).__name__ for name, module in model.named_modules() if uses_batch_statistics(module)]


class PerturbationOptions(CAMOptions, total=False):
    """The keyword options of the perturbation CAMs (see ``PerturbationCAM``)."""

    batch_size: int


class PerturbationCAM(CAM):
    """Shared by Score-CAM and Ablation-CAM.

    batch_size: perturbed copies of the input per forward pass (bounds memory). A model with BatchNorm
        modules that normalise by the batch's statistics (``track_running_stats=False``) would score each
        copy with the statistics of the others in its pass: there every copy runs alone.
    """

    uses_gradients = False

    def __init__(
        self,
        model: ModelSource,
        layer: TargetLayers = None,
        *,
        batch_size: int = 32,
        **options: Unpack[CAMOptions],
    ):
        super().__init__(model, layer, **options)
        self.batch_size = int_option("batch_size", batch_size, 1)

    def _chunks(self, total: int, description: str, per_pass: Optional[int] = None) -> Iterator[slice]:
        """Slices of ``per_pass`` (default ``batch_size``) over ``total`` items, one per forward
        pass, with a progress bar when asked or when the run is long."""
        per_pass = self.copies_per_pass(per_pass)
        passes = -(-total // per_pass)
        with self.progress_bar(passes, passes, "pass") as bar:
            bar.set_description(description)
            for start in range(0, total, per_pass):
                yield slice(start, min(start + per_pass, total))
                bar.update()

    def copies_per_pass(self, wanted: Optional[int] = None) -> int:
        """``wanted`` (default ``batch_size``) copies per forward pass, or 1 where the model's BatchNorm modules
        normalise by the batch's statistics (``batch_statistics_layers``): the copies of one pass would mix."""
        return 1 if batch_statistics_layers(self.model) else wanted or self.batch_size

    def layer_maps(self, batch: Tensor, activations: list[Tensor], selected: SelectedTargets) -> list[Tensor]:
        maps = []
        roundoff = working_unit_roundoff(activations)
        rounding_decides = False
        for layer_index, activation in enumerate(activations):
            feature_maps = self.feature_maps(layer_index, activation).float()
            weights = self.channel_weights(batch, layer_index, feature_maps, selected)
            maps.append(weighted_sum(weights, feature_maps))
            if roundoff > FLOAT32_ROUNDOFF and not rounding_decides:  # float32 and float64: no check
                rounding_decides = cancels_below_rounding(weights, feature_maps, maps[-1], roundoff)
        if rounding_decides:
            warn_at_callers_line(
                f"{self.method_name}'s map Σ_k w_k A_k cancels: it is smaller than the rounding of the layer's "
                f"activations in {precision_name(roundoff)} can move it (by more than {ROUNDING_TOLERANCE} of its "
                "maximum), so the map is decided by rounding and differs from the float32 model's. Call explain "
                "outside torch.autocast (on a float32 model), or choose a layer after a ReLU/GELU.", RuntimeWarning)
        return maps

    def channel_weights(self, batch: Tensor, layer_index: int, activation: Tensor, selected: SelectedTargets) -> Tensor:
        """(N, K, C) weight of each channel of the layer for each target; ``activation`` is the
        layer's output as (N, C, h, w) feature maps."""
        raise TypeError(f"{type(self).__name__} does not define channel_weights.")


def cancels_below_rounding(weights: Tensor, activations: Tensor, maps: Tensor, unit_roundoff: float) -> bool:
    """Whether rounding the activations A (relative error ``ROUNDING_GROWTH`` u) can move a map Σ_k w_k A_k
    (weights (N, K, C), A (N, C, h, w), maps (N, K, h, w)) by more than ``ROUNDING_TOLERANCE`` of its largest
    |value|: where the terms w_k A_k cancel (signed activations, weights nearly equal over channels), the bound
    u Σ_k |w_k| |A_k| exceeds the map itself."""
    spread = ROUNDING_GROWTH * unit_roundoff * weighted_sum(weights.abs(), activations.abs())
    extent = maps.abs().flatten(2).amax(2)
    return bool((spread.flatten(2).amax(2) > ROUNDING_TOLERANCE * extent).any())


@register
class ScoreCAM(PerturbationCAM):
    """Score-CAM (Wang et al. 2020): each channel, upsampled to the input and min-max normalised
    to [0, 1], masks the input; the weights are the softmax over channels of the target's score
    on the masked inputs.

    Exact, with no wasted work: channels whose masks are identical (all-zero or constant
    channels, duplicates) are scored once. Cost: one forward per distinct channel mask.
    """

    name = "scorecam"
    summary = "Score-CAM: channels weighted by the score of the input masked by them (gradient-free)"

    def channel_weights(self, batch: Tensor, layer_index: int, activation: Tensor, selected: SelectedTargets) -> Tensor:
        count, channels = activation.shape[:2]
        low_res = activation.float().flatten(2)
        low = low_res.amin(dim=2, keepdim=True)
        span = low_res.amax(dim=2, keepdim=True) - low
        # upsampling is linear and keeps constants, so channels whose low-resolution maps are equal once
        # min-max normalised (one an increasing affine function of the other) give equal masks: score
        # each distinct one once (the masks themselves are normalised after upsampling, see input_masks)
        normalized = torch.where(span > 0, (low_res - low) / torch.where(span > 0, span, 1.0), 0.0)
        image_index: list[int] = []
        mask_index: list[int] = []
        inverse: list[Tensor] = []
        for image in range(count):
            distinct, where = torch.unique(normalized[image], dim=0, return_inverse=True)
            first = torch.full((len(distinct),), channels, dtype=torch.long, device=where.device)
            first = first.scatter_reduce(0, where, torch.arange(channels, device=where.device), reduce="amin")
            inverse.append(where + len(mask_index))
            image_index.extend([image] * len(distinct))
            mask_index.extend(first.tolist())
        image_index_tensor = torch.tensor(image_index, device=batch.device)
        mask_index_tensor = torch.tensor(mask_index, device=batch.device)
        scales = self.mask_scales()
        scores: list[Tensor] = []
        for rows in self._chunks(len(image_index), self.summary.split(":")[0]):
            images, masks = image_index_tensor[rows], mask_index_tensor[rows]
            mask = input_masks(activation, images, masks, batch.shape[-2:])
            scores.append(torch.stack([self.masked_scores(batch, images, scale * mask, selected)
                                       for scale in scales]).sum(dim=0) / self.mask_score_divisor())
        distinct_scores = torch.cat(scores)  # (distinct masks, K)
        per_channel = distinct_scores[torch.stack(inverse)]  # (N, C, K)
        return per_channel.softmax(dim=1).transpose(1, 2).to(activation.dtype)

    def mask_scales(self) -> list[float]:
        """The factors each mask is scored at; a channel's score is their scores' sum divided by
        ``mask_score_divisor()``. Score-CAM scores the mask itself."""
        return [1.0]

    def mask_score_divisor(self) -> int:
        """What the sum of a mask's scores over ``mask_scales()`` is divided by (their number by default)."""
        return len(self.mask_scales())

    def masked_scores(self, batch: Tensor, images: Tensor, masks: Tensor, selected: SelectedTargets) -> Tensor:
        """(R, K) scores of the targets on the images ``images`` (R,) multiplied by ``masks`` (R, 1, H, W)."""
        output = self.call_model(batch[images] * masks.to(batch.dtype), rows=images)
        return selected.scores_for(output, images).float()


def input_masks(activation: Tensor, images: Tensor, channels: Tensor, size: Sequence[int]) -> Tensor:
    """(R, 1, H, W): channel ``channels[r]`` of image ``images[r]``'s feature maps (N, C, h, w), upsampled
    bilinearly to the input's ``size`` and min-max normalised to [0, 1] (a constant channel gives zeros)."""
    upsampled = F.interpolate(activation[images, channels][:, None].float(), size=tuple(size), mode="bilinear",
                              align_corners=False)
    low = upsampled.amin(dim=(2, 3), keepdim=True)
    span = upsampled.amax(dim=(2, 3), keepdim=True) - low
    return torch.where(span > 0, (upsampled - low) / torch.where(span > 0, span, 1.0), 0.0)


@register
class ISCAM(ScoreCAM):
    """IS-CAM, Integrated Score-CAM (Naidu et al. 2020): Score-CAM whose channel scores are integrated over
    masks of growing strength. With N = ``steps`` and M_k channel k's Score-CAM mask (upsampled to the input,
    then min-max normalised to [0, 1]), the paper's α_k = (1/N) Σ_i y_c(c_i M_k ⊙ X) with c_i = Σ_{j=0..i-1} j / N
    = i (i − 1) / (2N), i = 1..N; weights softmax over channels of α, map ReLU(Σ_k w_k A_k). The first mask
    (c_1 = 0) blanks the image for every channel alike: its score adds the same constant to every α_k, which
    the softmax ignores, so it is not run. Deterministic; costs steps − 1 forwards per distinct mask.

    steps: N (default 10, as torchcam; at least 2: with one step every channel would weigh the same).

    torchcam 0.5 differs twice: its masks go one step further, c_i = i (i + 1) / (2N) (its strongest mask
    amplifies the image (N + 1) / 2 times, the paper's (N − 1) / 2), and it min-max normalises each channel at
    the layer's resolution before upsampling, which differs from normalising the upsampled map where the
    upsampling factor is even (docs/methods.md says where that matters; tests/test_issue39_cams.py measures it).
    """

    name = "iscam"
    summary = "IS-CAM: Score-CAM with scores averaged over masks of growing strength (gradient-free)"

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, steps: int = 10,
                 **options: Unpack[PerturbationOptions]):
        super().__init__(model, layer, **options)
        self.steps = int_option("steps", steps, 2)

    def mask_scales(self) -> list[float]:
        return [step * (step - 1) / (2 * self.steps) for step in range(2, self.steps + 1)]

    def mask_score_divisor(self) -> int:
        return self.steps  # the paper's 1/N, the blank first mask included


@register
class SSCAM(ScoreCAM):
    """SS-CAM, Smoothed Score-CAM (Wang et al. 2020): Score-CAM whose channel scores are averaged over
    ``samples`` noisy copies of each mask, M_k + ε with ε ~ N(0, noise_std²) drawn per pixel (noise on
    the masks, the paper's and torchcam 0.5's), M_k upsampled to the input, then min-max normalised (the
    paper's; torchcam normalises before upsampling, see ``ISCAM``). Weights: softmax over channels of the
    mean score; map ReLU(Σ_k w_k A_k). Costs samples × channels forwards per image.

    samples: noisy copies of each mask (default 35, as torchcam and the paper); noise_std: the noise's
        standard deviation, in units of the [0, 1] mask (default 2.0, as torchcam); seed: the noise's
        generator seed (None: fresh draws); every image of a call gets the same draws (1, C, H, W) per
        sample, so that its map does not depend on the rest of its batch; noise_draws: a callable
        ``shape → N(0, 1) tensor`` called once per sample with shape (N, C, H, W), one draw per image,
        channel and pixel, instead of the generator (to replay another library's draws).
    """

    name = "sscam"
    summary = "SS-CAM: Score-CAM with scores averaged over noisy copies of each mask (gradient-free)"

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, samples: int = 35, noise_std: float = 2.0,
                 seed: Optional[int] = 0, noise_draws: Optional[NoiseDraws] = None,
                 **options: Unpack[PerturbationOptions]):
        super().__init__(model, layer, **options)
        self.samples, self.noise_std, self.seed, self.noise_draws = noise_options(samples, noise_std, seed, noise_draws)

    def channel_weights(self, batch: Tensor, layer_index: int, activation: Tensor, selected: SelectedTargets) -> Tensor:
        count, channels = activation.shape[:2]
        size = tuple(batch.shape[-2:])
        draws = self.noise_draws or normal_draws(self.seed, batch.device)
        # the generator's draws are one image's, shared by the batch's images (an image's map does not depend on the
        # rest of its batch); draws given as noise_draws are the whole batch's, as torchcam draws them
        drawn = count if self.noise_draws is not None else 1
        pairs = torch.cartesian_prod(torch.arange(count), torch.arange(channels)).to(batch.device)  # (N·C, 2)
        total = torch.zeros(len(pairs), selected.scores.shape[1], device=batch.device)
        noise = None
        for rows in self._sample_chunks(len(pairs)):
            if rows.start == 0:  # one draw per sample, for every image (or all of them), channel and pixel
                noise = drawn_noise(draws, (drawn, channels, *size), batch.device, torch.float32)
            assert noise is not None, "each sample starts at row 0"
            images, masks = pairs[rows, 0], pairs[rows, 1]
            noise_rows = images if drawn > 1 else torch.zeros_like(images)
            noisy = input_masks(activation, images, masks, size) + self.noise_std * noise[noise_rows, masks][:, None]
            total[rows] += self.masked_scores(batch, images, noisy, selected)
        mean = (total / self.samples).reshape(count, channels, -1)  # (N, C, K)
        return mean.softmax(dim=1).transpose(1, 2).to(activation.dtype)

    def _sample_chunks(self, rows: int) -> Iterator[slice]:
        """Slices of ``rows``, ``batch_size`` rows a pass, from row 0 again for every sample, under one
        progress bar."""
        per_pass = self.copies_per_pass()
        passes = self.samples * -(-rows // per_pass)
        with self.progress_bar(passes, passes, "pass") as bar:
            bar.set_description("SS-CAM")
            for _ in range(self.samples):
                for start in range(0, rows, per_pass):
                    yield slice(start, min(start + per_pass, rows))
                    bar.update()


@register
class AblationCAM(PerturbationCAM):
    """Ablation-CAM (Desai & Ramaswamy 2020): w_k = (y − y_k) / |y|, y_k the score with channel k
    of the layer's output set to zero.

    The paper divides by y, a trained classifier's (positive) score of its predicted class. Where y is
    negative (another class, an untrained model, a target function's score), dividing by y would give
    the channels whose ablation lowers the score negative weights, and the map would show what speaks
    against the target: |y| keeps the paper's weights where y > 0 and their sign everywhere
    (pytorch-grad-cam 1.5 divides by y).

    Only the network after the target layer depends on the ablation: the layers before it
    run once per forward pass, and the layer's output is expanded, inside the pass, into a
    batch of ablated copies that only the rest of the network processes. Where the model's
    structure does not allow that (the rest of the network also uses tensors from before
    the layer, e.g. a residual connection around it), it falls back, with a warning, to
    full forward passes of copies of the input.
    """

    name = "ablationcam"
    summary = "Ablation-CAM: channels weighted by the score drop when each is zeroed (gradient-free)"

    REPLAY_BUDGET = 2**26
    """Elements of ablated copies of the layer's output per forward pass (256 MB in float32)."""

    def __init__(self, model: ModelSource, layer: TargetLayers = None, *, replay_batch_size: Optional[int] = None,
                 **options: Unpack[PerturbationOptions]):
        """replay_batch_size: ablated copies of the layer's output per forward pass; default: as
        many as fit in REPLAY_BUDGET elements. ``batch_size`` applies to the fallback's input copies."""
        super().__init__(model, layer, **options)
        self.replay_batch_size = (None if replay_batch_size is None
                                  else int_option("replay_batch_size", replay_batch_size, 1))

    def channel_weights(self, batch: Tensor, layer_index: int, activation: Tensor, selected: SelectedTargets) -> Tensor:
        layers, layouts = self.layers, self._layouts
        assert layers is not None and layouts is not None, "during a call, the layers and their layouts are known"
        module = layers[layer_index][1]
        count, channels = activation.shape[:2]
        reference = self._reference_scores(batch, selected)  # (N, K)
        try:
            ablated = self._ablated_scores_replaying_tail(batch, module, activation, selected, reference,
                                                          layouts[layer_index].channel_dim)
        except _ReplayNotPossible as reason:
            warn_at_callers_line(
                f"Ablation-CAM cannot replay only the part of the model after layer "
                f"{layers[layer_index][0]!r} ({reason}); running full forward passes instead (slower).",
                RuntimeWarning,
            )
            ablated = self._ablated_scores_full_forwards(batch, module, count, channels, selected,
                                                         layouts[layer_index].channel_dim)
        scale = reference.abs().clamp_min(1e-12)  # |y|: see the class's docstring
        weights = (reference[:, :, None] - ablated) / scale[:, :, None]  # (N, K, C)
        return weights.to(activation.dtype)

    def _reference_scores(self, batch: Tensor, selected: SelectedTargets) -> Tensor:
        """(N, K) y: the targets' scores on the images, each image run alone where the model's BatchNorm
        modules normalise by the batch's statistics (as its ablated copies then run)."""
        if batch.shape[0] == 1 or not batch_statistics_layers(self.model):
            return selected.scores.detach().float()
        alone = [torch.tensor([image], device=batch.device) for image in range(batch.shape[0])]
        return torch.cat([selected.scores_for(self.call_model(batch[rows], rows=rows), rows).float()
                          for rows in alone])

    def _ablated_scores_replaying_tail(self, batch: Tensor, module: nn.Module, activation: Tensor,
                                       selected: SelectedTargets, reference: Tensor, channel_dim: int) -> Tensor:
        """(N, K, C) ablated scores; each pass expands the layer's output into ablated copies."""
        count, channels = activation.shape[:2]
        mixing = batch_statistics_layers(self.model)
        if mixing:
            raise _ReplayNotPossible(f"BatchNorm {', '.join(repr(name) for name in mixing[:3])} normalises by the "
                                     "statistics of the batch, so ablated copies in one pass would change each "
                                     "other's scores; each runs alone")
        # row r of a pass: image r // per_image, channel (start + r % per_image); channel -1: no ablation
        copies_per_pass = self.replay_batch_size or self.REPLAY_BUDGET // activation[0].numel()
        per_image = max(1, copies_per_pass // count)
        ablated = torch.empty(count, reference.shape[1], channels, device=batch.device)
        check_done = False
        for chunk in self._chunks(channels, "Ablation-CAM", per_pass=per_image):
            channel_ids = torch.arange(chunk.start, chunk.stop, device=batch.device)
            if not check_done:  # one unablated copy per image checks that the replay is faithful
                channel_ids = torch.cat([torch.tensor([-1], device=batch.device), channel_ids])
            copies = len(channel_ids)

            def expand(output: Tensor, channel_ids: Tensor = channel_ids, copies: int = copies) -> Tensor:
                expanded = output.repeat_interleave(copies, dim=0)  # (N * copies, ...) in the layer's layout
                ids = channel_ids.repeat(count)
                ablate = ids >= 0
                channels_second = expanded.movedim(channel_dim, 1)  # a view: zeroing it zeroes expanded
                channels_second[torch.arange(len(ids), device=output.device)[ablate], ids[ablate]] = 0
                return expanded

            try:
                with edit(self.model, module, expand):
                    output = self.call_model(batch)
                image_index = torch.arange(count, device=batch.device).repeat_interleave(copies)
                scores = selected.scores_for(output, image_index).float().reshape(count, copies, -1)
            except (RuntimeError, ValueError, IndexError) as error:
                cause = error.__cause__ if isinstance(error, ModelInputError) and error.__cause__ else error
                raise _ReplayNotPossible(f"{type(cause).__name__}: {str(cause).splitlines()[0]}") from error
            if not check_done:
                replayed, scores = scores[:, 0], scores[:, 1:]
                if not torch.allclose(replayed, reference, rtol=1e-3, atol=1e-4):
                    raise _ReplayNotPossible("the replayed scores differ from the model's")
                check_done = True
            ablated[:, :, chunk] = scores.transpose(1, 2)
        return ablated

    def _ablated_scores_full_forwards(self, batch: Tensor, module: nn.Module, count: int, channels: int,
                                      selected: SelectedTargets, channel_dim: int) -> Tensor:
        """(N, K, C) ablated scores from full forward passes of input copies, one channel zeroed in each."""
        pairs = torch.cartesian_prod(torch.arange(count), torch.arange(channels)).to(batch.device)  # (N*C, 2)
        scores: list[Tensor] = []
        for rows in self._chunks(len(pairs), "Ablation-CAM"):
            images, ablated_channels = pairs[rows, 0], pairs[rows, 1]

            def zero_channel(output: Tensor, ablated_channels: Tensor = ablated_channels) -> Tensor:
                output = output.clone()
                output.movedim(channel_dim, 1)[torch.arange(len(ablated_channels), device=output.device),
                                               ablated_channels] = 0
                return output

            with edit(self.model, module, zero_channel):
                output = self.call_model(batch[images], rows=images)
            scores.append(selected.scores_for(output, images).float())
        return torch.cat(scores).reshape(count, channels, -1).transpose(1, 2)


class _ReplayNotPossible(Exception):
    """The part of the model after the layer cannot run on a batch of ablated copies."""
