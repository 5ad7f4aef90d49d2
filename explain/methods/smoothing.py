"""SmoothGrad, SmoothGrad² and VarGrad (Smilkov et al. 2017; Adebayo et al. 2018): the mean, the
mean square or the variance of any method's attributions over noisy copies of the input."""

from __future__ import annotations

from typing import ClassVar, Optional, Union

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ..targets import Target, select_targets
from .base import Attribution, Explainer, ExplainerOptions, checked_batch_size, register
from .gradients import GradientExplainer, GradientOptions, Saliency, reduce_channels
from .options import int_option, number_option, random_generator, seed_option

STATISTICS = ("mean", "mean_square", "variance")
AVERAGES = ("attributions", "maps")


@register
class SmoothGrad(Explainer):
    """The mean of a method's attributions over ``samples`` noisy copies of each image.

    explainer: any explainer of the toolkit (CAM methods included), or a model, which
        is wrapped in ``Saliency`` (the other keyword arguments go to it).
    noise: standard deviation of the Gaussian noise as a fraction of each image's value
        range (max − min of the model input); noise_std: an absolute standard deviation in
        model-input units instead (Captum's ``stdevs``); samples: copies per image.
    average: "attributions" (default for methods that attribute to input pixels, as in the papers):
        the per-channel attributions (N, K, C, H, W) are averaged, then reduced to a map by the
        wrapped method's ``reduce`` (max |·| over colour channels by default); "maps": each copy's
        map is computed first and the maps are averaged (the default for CAMs and layer methods).
    seed: the noise is drawn from a generator seeded with it, on the batch's device: same seed and
        device, same map. None: new noise on every call, its seed drawn from torch's global
        generator (``torch.manual_seed`` makes a run repeatable).
    batch_size: noisy copies (rows, one image's copy each) per pass of the wrapped method;
        None (default): 16 on the CPU, 256 on a GPU (halved where memory runs out;
        ``ROWS_PER_PASS``).
    The targets are chosen on the clean image and kept for every noisy copy.
    """

    name = "smoothgrad"
    summary = "SmoothGrad: any method's attributions averaged over noisy copies of the input (default: saliency)"
    records_the_forward = False  # the wrapped method checks the model for itself
    statistic: ClassVar[str] = "mean"
    """"mean" (SmoothGrad), "mean_square" (SmoothGrad²) or "variance" (VarGrad) over the copies."""

    def __init__(
        self,
        explainer: Union[Explainer, nn.Module],
        *,
        samples: int = 25,
        noise: float = 0.15,
        noise_std: Optional[float] = None,
        average: Optional[str] = None,
        seed: Optional[int] = 0,
        batch_size: Optional[int] = None,
        **options: Unpack[GradientOptions],
    ):
        if isinstance(explainer, nn.Module):
            explainer = Saliency(explainer, **options)
        elif not isinstance(explainer, Explainer):
            raise TypeError(f"{type(self).__name__} wraps an explainer or a model; got {type(explainer).__name__}.")
        options.setdefault("preprocess", explainer.preprocess)
        options.setdefault("normalize", explainer.normalize)
        options.setdefault("class_names", explainer.class_names)
        options.setdefault("output", explainer.output)
        options.pop("reduce", None)
        shared: ExplainerOptions = options  # without "reduce", the wrapped method's own option
        super().__init__(explainer.model, **shared)
        checked_batch_size(batch_size)
        samples, noise = int_option("samples", samples, 1), number_option("noise", noise)
        noise_std = None if noise_std is None else number_option("noise_std", noise_std)
        seed = seed_option(seed)
        if average not in (None, *AVERAGES):
            raise ValueError(f"average must be one of {AVERAGES}; got {average!r}.")
        self.explainer = explainer
        self.samples, self.noise, self.noise_std, self.seed = samples, noise, noise_std, seed
        self.batch_size, self.average = batch_size, average

    def reads_pixel_gradients(self) -> bool:
        return self.explainer.reads_pixel_gradients()

    @property
    def method_name(self) -> str:
        return f"{type(self).__name__}({self.explainer.method_name})"

    def noise_scale(self, batch: Tensor) -> Tensor:
        """(N, 1, 1, 1) standard deviation of the noise for each image."""
        if self.noise_std is not None:
            return torch.full((batch.shape[0], 1, 1, 1), float(self.noise_std), dtype=batch.dtype, device=batch.device)
        return (batch.amax(dim=(1, 2, 3)) - batch.amin(dim=(1, 2, 3))).view(-1, 1, 1, 1) * self.noise

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        with torch.no_grad():
            clean = select_targets(self.call_model(batch), target, topk, batch_size=count)
        spread = self.noise_scale(batch)
        generator = random_generator(self.seed, batch.device)  # drawn where the batch is
        state_before = {0: generator.get_state()}  # by sample: rows drawn again get the same noise

        def noise_of(samples: range) -> Tensor:
            """(len(samples) · N, C, H, W): the noise of whole samples, each drawn as (N, C, H, W), in order."""
            generator.set_state(state_before[samples.start])
            draws = []
            for sample in samples:
                draws.append(torch.randn(batch.shape, generator=generator, device=batch.device))
                state_before[sample + 1] = generator.get_state()
            return torch.cat(draws)

        def images_of(rows: slice) -> Tensor:  # rows are sample by sample, image by image
            return torch.arange(rows.start, rows.stop, device=batch.device) % count

        def noisy_attribution(rows: slice) -> Attribution:
            """The wrapped method on noisy copies ``rows`` (row r: sample r // N of image r % N)."""
            first_sample, last_sample = rows.start // count, (rows.stop - 1) // count
            offset = first_sample * count
            noise = noise_of(range(first_sample, last_sample + 1))[rows.start - offset : rows.stop - offset]
            image_of_row = images_of(rows)
            noisy = batch[image_of_row] + noise.to(batch.dtype) * spread[image_of_row]
            fixed: Target
            if clean.target_function:
                fixed = clean.target_function
            else:
                assert clean.class_indices is not None, "class targets carry their class indices"
                fixed = clean.class_indices[image_of_row]
            call = self._forward_call
            self.explainer._forward_call = None if call is None else call.for_rows(image_of_row)
            try:
                return self.explainer.attribute(noisy, fixed, None)
            finally:
                self.explainer._forward_call = None

        sums: dict[str, Tensor] = {}  # per image, of each copy's values and of their squares, float64
        flag_counts: dict[str, Tensor] = {}  # per image, the copies whose gradient was not zero / not disconnected
        inner: Optional[Attribution] = None
        for rows, inner in self.row_passes(self.samples * count, self.batch_size, batch.device, noisy_attribution):
            image_of_row = images_of(rows)
            for key in ("zero_gradient", "disconnected"):
                value = getattr(inner, key)
                if value is not None:
                    counts = flag_counts.setdefault(key, torch.zeros(count, *value.shape[1:], dtype=torch.long,
                                                                     device=value.device))
                    counts.index_add_(0, image_of_row.to(value.device), (~value).long())
            for key, values in (("maps", inner.maps), ("attributions", inner.attributions)):
                if values is None:
                    continue
                values = values.detach().double()
                if key not in sums:
                    sums[key] = torch.zeros(count, *values.shape[1:], dtype=torch.float64, device=values.device)
                    sums[key + "²"] = torch.zeros_like(sums[key])
                sums[key].index_add_(0, image_of_row.to(values.device), values)
                sums[key + "²"].index_add_(0, image_of_row.to(values.device), values.pow(2))
        flags = {key: counts == 0 for key, counts in flag_counts.items()}  # every copy's gradient zero / disconnected
        statistics = {key: self._statistic(sums[key], sums[key + "²"]).float() for key in ("maps", "attributions")
                      if key in sums}
        # the papers average input gradients, then reduce them; a layer's or a CAM's maps are averaged as maps
        by_attributions = isinstance(self.explainer, GradientExplainer) and "attributions" in statistics
        average = self.average or ("attributions" if by_attributions else "maps")
        if average == "attributions":
            if "attributions" not in statistics:
                raise ValueError(f"{self.explainer.method_name} gives no per-channel attributions; use average='maps'.")
            maps = reduce_channels(statistics["attributions"], getattr(self.explainer, "reduce", "maxabs"))
        else:
            maps = statistics["maps"]
        assert inner is not None, "samples ≥ 1: the wrapped method ran at least once"
        return Attribution(
            maps=maps,
            selected=clean,
            layer=inner.layer,
            attributions=statistics.get("attributions"),
            zero_gradient=flags.get("zero_gradient"),
            disconnected=flags.get("disconnected"),
        )

    def _statistic(self, total: Tensor, total_of_squares: Tensor) -> Tensor:
        mean = total / self.samples
        if self.statistic == "mean":
            return mean
        if self.statistic == "mean_square":
            return total_of_squares / self.samples
        return (total_of_squares / self.samples - mean.pow(2)).clamp_min(0)


@register
class SmoothGradSquared(SmoothGrad):
    """SmoothGrad² (PAIR's and Captum's "smoothgrad_sq"): the mean of the squared attributions over
    noisy copies of each image (see SmoothGrad)."""

    name = "smoothgrad_sq"
    summary = "SmoothGrad²: mean of squared attributions over noisy copies of the input (default: saliency)"
    statistic = "mean_square"


@register
class VarGrad(SmoothGrad):
    """VarGrad (Adebayo et al. 2018): the variance of a method's attributions over noisy copies of
    each image (see SmoothGrad)."""

    name = "vargrad"
    summary = "VarGrad: variance of any method's attributions over noisy copies of the input (default: saliency)"
    statistic = "variance"
