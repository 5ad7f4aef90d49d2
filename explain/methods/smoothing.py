"""SmoothGrad, SmoothGrad² and VarGrad (Smilkov et al. 2017; Adebayo et al. 2018): the mean, the
mean square or the variance of any method's attributions over noisy copies of the input."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Union

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ..core.targets import SelectedTargets, Target, select_targets
from ..io.loaded_model import LoadedModel
from .base import Explainer
from .gradients import (
    GradientExplainer,
    GradientOptions,
    Saliency,
    UnsplitOutput,
    every_row,
    fold_leading_rows,
    reduce_channels,
    sum_per_image,
)
from .maps import Attribution, Flags, flags_of, without_graph
from .options import int_option, number_option, random_generator, seed_option
from .passes import checked_batch_size
from .registry import register
from .signatures import ExplainerOptions

STATISTICS = ("mean", "mean_square", "variance")
AVERAGES = ("attributions", "maps")


def noise_source(seed: Optional[int], batch: Tensor) -> Callable[[range], Tensor]:
    """The noise of a call's samples: ``noise_of(samples)`` is (len(samples) · N, C, H, W), sample s being the s-th
    standard normal (N, C, H, W) draw from a generator seeded with ``seed`` (``random_generator``) on the batch's
    device. Samples drawn again (a pass run again after running out of memory) get the same values. SmoothGrad
    gives it one image (``batch[:1]``), so that every image of a call gets the same draws.

    On the CPU, where the N·C·H·W values of a sample are a multiple of 16, the samples of a pass are drawn in one
    call: torch's CPU normal sampler turns uniform draws into normal ones 16 at a time, so one draw of S samples
    equals S draws of one (tests/test_issue40_methods.py checks it); elsewhere one draw per sample."""
    generator = random_generator(seed, batch.device)  # drawn where the batch is
    state_before = {0: generator.get_state()}  # by sample, where known
    latest: dict[str, Any] = {}  # the latest draw: "first" sample and "noise", whose last sample a pass may share
    at_once = batch.device.type == "cpu" and batch.numel() % 16 == 0
    count = batch.shape[0]

    def draw(samples: int) -> Tensor:
        return torch.randn((samples * count, *batch.shape[1:]), generator=generator, device=batch.device)

    def noise_of(samples: range) -> Tensor:
        first, parts = samples.start, []
        if latest and latest["first"] + len(latest["noise"]) // count - 1 == first < samples.stop:
            parts.append(latest["noise"][-count:])  # a pass that began inside this sample drew it
            first += 1
        if first < samples.stop:
            start = max(sample for sample in state_before if sample <= first)  # ``first`` itself, unless skipped
            generator.set_state(state_before[start])
            if at_once:
                drawn = draw(samples.stop - start)
            else:
                draws = []
                for sample in range(start, samples.stop):
                    draws.append(draw(1))
                    state_before[sample + 1] = generator.get_state()
                drawn = torch.cat(draws) if len(draws) > 1 else draws[0]
            if start < first:
                drawn = drawn[(first - start) * count:]
            state_before[samples.stop] = generator.get_state()
            latest.update(first=first, noise=drawn)
            parts.append(drawn)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return noise_of


def takes_gradients_alone(explainer: Explainer) -> bool:
    """Whether an explainer's attributions are a function of the batch and ∂score/∂input alone (saliency, input ×
    gradient: ``GradientExplainer.attributions_of_gradients``), its ``attribute`` being the one written with it (a
    subclass that overrides ``attribute`` alone is not)."""
    for owner in type(explainer).__mro__:
        defines = ("attribute" in owner.__dict__, "attributions_of_gradients" in owner.__dict__)
        if any(defines):
            return all(defines) and owner is not GradientExplainer
    return False


def add_per_image(sums: dict[str, Tensor], key: str, values: Tensor, image_of_row: Tensor, count: int) -> None:
    """Add (R, ...) values of copies to ``sums[key]``, (N, ...) float64 per image (made at the first pass)."""
    sums[key] = sum_per_image(sums.get(key), values, image_of_row, count)


def every_copy(passes: list[tuple[Tensor, Flags]], count: int) -> Optional[Callable[[], Tensor]]:
    """(N, K) bool, computed when called: where a flag of the wrapped method (``zero_gradient``, ``disconnected``)
    holds for every noisy copy of the image; None where the method gives no such flag. passes: each pass's rows (the
    image of each) and the flag's (R, K) values there."""
    return every_row(passes, count) if passes else None


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
        generator (``torch.manual_seed`` makes a run repeatable). Every image of a call gets the
        same ``samples`` standard normal draws (each scaled by its own image's noise level), so that
        an image's map does not depend on the other images of the batch, nor on its place among them.
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
        if isinstance(explainer, (nn.Module, LoadedModel)):
            explainer = Saliency(explainer, **options)
        elif not isinstance(explainer, Explainer):
            raise TypeError(f"{type(self).__name__} wraps an explainer or a model; got {type(explainer).__name__}.")
        elif "reduce" in options:
            self._check_reduce(explainer, options["reduce"])
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

    def _check_reduce(self, explainer: Explainer, reduce: str) -> None:
        """Refuse a ``reduce`` that differs from the wrapped explainer's: its maps are reduced by its own option."""
        own = getattr(explainer, "reduce", None)
        if reduce == own:
            return
        kind = type(explainer).__name__
        if own is None:
            raise ValueError(f"{type(self).__name__} got reduce={reduce!r}, but {kind} reduces no colour channels "
                             "(it has no reduce option); drop reduce=.")
        raise ValueError(f"{type(self).__name__} got reduce={reduce!r}, but the wrapped {kind} reduces with its own "
                         f"reduce={own!r}; pass reduce to the wrapped explainer instead: "
                         f"{type(self).__name__}({kind}(model, reduce={reduce!r}), ...).")

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
        spread = self.noise_scale(batch)
        noise_of = noise_source(self.seed, batch[:1])  # one draw per sample, the same for every image of the call
        by_gradients = takes_gradients_alone(self.explainer)
        chosen: dict[str, SelectedTargets] = {}  # "clean": the targets, chosen on the clean images

        def choose(output: object) -> SelectedTargets:
            chosen["clean"] = select_targets(output, target, topk, batch_size=count)
            return chosen["clean"]

        def noisy_attribution(rows: slice) -> tuple[Tensor, Attribution]:
            """(the image of each row, the wrapped method on noisy copies ``rows``): row r is sample r // N of image
            r % N."""
            first_sample, last_sample = rows.start // count, (rows.stop - 1) // count
            noise = noise_of(range(first_sample, last_sample + 1)).to(batch.dtype)  # (samples, C, H, W)
            if count == 1:  # every row is a copy of the one image: broadcast it
                image_of_row = torch.zeros(rows.stop - rows.start, dtype=torch.long, device=batch.device)
                noisy = batch + noise * spread
            else:
                row_numbers = torch.arange(rows.start, rows.stop, device=batch.device)
                image_of_row = row_numbers % count
                noise = noise[row_numbers // count - first_sample]  # each row its sample's draw
                noisy = batch[image_of_row] + noise * spread[image_of_row]
            if by_gradients:
                return image_of_row, self._attribution_of_gradients(batch, noisy, image_of_row, chosen, choose, target)
            if "clean" not in chosen:
                with torch.no_grad():
                    choose(self.call_model(batch))
            return image_of_row, self._wrapped_attribution(noisy, image_of_row, chosen["clean"])

        average = self.average
        squares = self.statistic != "mean"
        sums: dict[str, Tensor] = {}  # per image, of each copy's values (and of their squares), float64
        flags: dict[str, list[tuple[Tensor, Flags]]] = {"zero_gradient": [], "disconnected": []}  # by pass
        inner: Optional[Attribution] = None
        for _, (image_of_row, inner) in self.row_passes(self.samples * count, self.batch_size, batch.device,
                                                        noisy_attribution, batch.shape[1:].numel()):
            for key, passes in flags.items():  # small (R, K) flags: the copies' maps and gradients are not kept
                if by_gradients:  # disconnected as input_gradients gives it; zero_gradient from the sums, below
                    value = inner.disconnected if key == "disconnected" else None
                else:
                    value = flags_of(getattr(inner, key))
                if value is not None:
                    passes.append((image_of_row, value))
            if average is None:  # the papers average input gradients, then reduce them; a layer's or a CAM's maps
                by_attributions = isinstance(self.explainer, GradientExplainer) and inner.attributions is not None
                average = "attributions" if by_attributions else "maps"  # are averaged as maps
            values = {"attributions": inner.attributions}
            if average == "maps":
                values["maps"] = (reduce_channels(inner.maps, getattr(self.explainer, "reduce", "maxabs"))
                                  if by_gradients else inner.maps)  # by gradients: ``maps`` holds the attributions
            for key, value in values.items():
                if value is not None:
                    add_per_image(sums, key, without_graph(value), image_of_row, count)
                    if squares:
                        add_per_image(sums, key + "²", without_graph(value).pow(2), image_of_row, count)
        # the sums are float64; the statistics come back in the wrapped method's precision (float32 at least)
        result_dtype = {key: torch.promote_types(value.dtype, torch.float32)
                        for key, value in values.items() if value is not None}
        statistics = {key: self._statistic(sums[key], sums.get(key + "²")).to(result_dtype[key])
                      for key in sums if "²" not in key}
        if average == "attributions":
            if "attributions" not in statistics:
                raise ValueError(f"{self.explainer.method_name} gives no per-channel attributions; use average='maps'.")
            maps = reduce_channels(statistics["attributions"], getattr(self.explainer, "reduce", "maxabs"))
        else:
            maps = statistics["maps"]
        assert inner is not None, "samples ≥ 1: the wrapped method ran at least once"
        return Attribution(
            maps=maps,
            selected=chosen["clean"],
            layer=inner.layer,
            attributions=statistics.get("attributions"),
            zero_gradient=(self._every_gradient_zero(sums) if by_gradients
                           else every_copy(flags["zero_gradient"], count)),
            disconnected=every_copy(flags["disconnected"], count),
        )

    def _every_gradient_zero(self, sums: dict[str, Tensor]) -> Callable[[], Tensor]:
        """(N, K) bool, computed when called: where every copy's attributions (those of saliency or input × gradient)
        are zero everywhere, read from their sums (and sums of squares, where kept) over the copies: a sum of
        attributions that are not all zero is zero at every pixel only if they cancel exactly everywhere."""
        return lambda: torch.stack([sums[key].flatten(2).eq(0).all(dim=2) for key in sums]).all(dim=0)

    def _wrapped_attribution(self, noisy: Tensor, image_of_row: Tensor, clean: SelectedTargets) -> Attribution:
        """The wrapped method's ``attribute`` on noisy copies, each explained for its clean image's targets."""
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

    def _attribution_of_gradients(self, batch: Tensor, noisy: Tensor, image_of_row: Tensor,
                                  chosen: dict[str, SelectedTargets],
                                  choose: Callable[[object], SelectedTargets], target: Target) -> Attribution:
        """The wrapped method (one whose attributions are a function of the input gradient, ``takes_gradients_alone``)
        on noisy copies, from their gradients for their clean image's targets; no maps (SmoothGrad reduces the
        averaged attributions, or the copies' where it averages maps). Before the targets are chosen, the clean
        images are the first rows of this pass's forward (``fold_leading_rows``), or a no-grad forward of their own
        where they are not."""
        explainer = self.explainer
        assert isinstance(explainer, GradientExplainer), "takes_gradients_alone: a GradientExplainer"
        explainer._forward_call = self._forward_call  # the copies' rows are mapped to their images below
        try:
            gradients: Optional[Tensor] = None
            if "clean" not in chosen and fold_leading_rows(self, len(batch), self.batch_size, batch.device, target,
                                                           batch.shape[1:].numel()):
                try:
                    gradients, unreachable = explainer.folded_gradients([batch], None, noisy, image_of_row,
                                                                             lambda outputs: choose(outputs[0]))
                except UnsplitOutput:
                    pass  # an output that is not one row per input: the clean images' forward below
            if gradients is None:
                if "clean" not in chosen:
                    with torch.no_grad():
                        choose(self.call_model(batch))
                gradients, unreachable = explainer.copies_gradients(noisy, chosen["clean"], image_of_row)
        finally:
            explainer._forward_call = None
        attributions = explainer.attributions_of_gradients(noisy, gradients)
        assert attributions is not None, "takes_gradients_alone: the method computes them"
        # maps: unused (SmoothGrad reduces the averaged attributions, or each copy's where it averages maps)
        return Attribution(maps=attributions, selected=chosen["clean"], attributions=attributions,
                           disconnected=unreachable)

    def _statistic(self, total: Tensor, total_of_squares: Optional[Tensor]) -> Tensor:
        mean = total / self.samples
        if self.statistic == "mean":
            return mean
        assert total_of_squares is not None, "the squares are summed for the statistics that need them"
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
