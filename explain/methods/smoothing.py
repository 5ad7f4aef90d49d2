"""SmoothGrad and VarGrad (Smilkov et al. 2017; Adebayo et al. 2018): the mean (or variance) of
any method's maps over noisy copies of the input."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from ..targets import Target, select_targets
from .base import Attribution, Explainer, register
from .gradients import Saliency


@register
class SmoothGrad(Explainer):
    """The mean of a method's maps over ``samples`` noisy copies of each image.

    explainer: any explainer of the toolkit (CAM methods included), or a model, which
        is wrapped in ``Saliency``.
    noise: standard deviation of the Gaussian noise as a fraction of each image's value
        range (max − min of the model input); samples: copies per image.
    seed: the noise is drawn from a generator seeded with it: same seed, same map.
    batch_size: noisy copies per pass of the wrapped method.
    The targets are chosen on the clean image and kept for every noisy copy.
    """

    name = "smoothgrad"
    summary = "SmoothGrad: any method's maps averaged over noisy copies of the input (default: saliency)"
    statistic = "mean"

    def __init__(
        self,
        explainer: Union[Explainer, nn.Module],
        *,
        samples: int = 25,
        noise: float = 0.15,
        seed: int = 0,
        batch_size: int = 32,
        **options,
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
        super().__init__(explainer.model, **options)
        if samples < 1 or noise < 0 or batch_size < 1:
            raise ValueError("samples and batch_size must be at least 1 and noise non-negative.")
        self.explainer = explainer
        self.samples, self.noise, self.seed, self.batch_size = samples, noise, seed, batch_size

    @property
    def method_name(self) -> str:
        return f"{type(self).__name__}({self.explainer.method_name})"

    def attribute(self, batch: Tensor, target: Target, topk: Optional[int]) -> Attribution:
        count = batch.shape[0]
        with torch.no_grad():
            clean = select_targets(self.call_model(batch), target, topk, batch_size=count)
        spread = (batch.amax(dim=(1, 2, 3)) - batch.amin(dim=(1, 2, 3))).view(-1, 1, 1, 1) * self.noise
        generator = torch.Generator().manual_seed(self.seed)
        samples_per_pass = max(1, self.batch_size // count)
        sums: dict[str, Tensor] = {}
        inner: Optional[Attribution] = None
        flags: dict[str, Tensor] = {}  # where every noisy copy's gradient was zero / disconnected
        for first in range(0, self.samples, samples_per_pass):
            group = range(first, min(first + samples_per_pass, self.samples))
            noise = torch.cat([torch.randn(batch.shape, generator=generator) for _ in group]).to(batch.device)
            noisy = batch.repeat(len(group), 1, 1, 1) + noise.to(batch.dtype) * spread.repeat(len(group), 1, 1, 1)
            image_of_row = torch.arange(count, device=batch.device).repeat(len(group))
            fixed = clean.target_function or clean.class_indices[image_of_row]
            call = self.forward_call
            self.explainer.forward_call = None if call is None else call.for_rows(image_of_row)
            try:
                inner = self.explainer.attribute(noisy, fixed, None)
            finally:
                self.explainer.forward_call = None
            for key in ("zero_gradient", "disconnected"):
                value = getattr(inner, key)
                if value is not None:
                    every_copy = value.reshape(len(group), count, -1).all(0)
                    flags[key] = every_copy & flags[key] if key in flags else every_copy
            for key, values in (("maps", inner.maps), ("attributions", inner.attributions)):
                if values is None:
                    continue
                values = values.detach().double()
                grouped = values.reshape(len(group), count, *values.shape[1:])
                sums[key] = sums.get(key, 0) + grouped.sum(0)
                sums[key + "²"] = sums.get(key + "²", 0) + grouped.pow(2).sum(0)
        results = {}
        for key in ("maps", "attributions"):
            if key in sums:
                mean = sums[key] / self.samples
                if self.statistic == "mean":
                    value = mean
                else:
                    value = (sums[key + "²"] / self.samples - mean.pow(2)).clamp_min(0)
                results[key] = value.float()
        return Attribution(
            maps=results["maps"],
            selected=clean,
            layer=inner.layer,
            attributions=results.get("attributions"),
            zero_gradient=flags.get("zero_gradient"),
            disconnected=flags.get("disconnected"),
        )


@register
class VarGrad(SmoothGrad):
    """The variance of a method's maps over noisy copies of each image (see SmoothGrad)."""

    name = "vargrad"
    summary = "VarGrad: variance of any method's maps over noisy copies of the input (default: saliency)"
    statistic = "var"
