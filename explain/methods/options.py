"""Checks of the options every method and metric takes: each error names the option, its value (a short
repr) and what it accepts; and the random generators behind ``seed`` options."""

from __future__ import annotations

import math
import numbers
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor

SEED_RANGE = (-(2**63), 2**64)
"""The seeds a torch generator takes: ints in [−2⁶³, 2⁶⁴)."""


def is_whole_number(value: object) -> bool:
    """Whether ``value`` is an int: a Python or numpy integer, or a 0-d integer tensor (what ``argmax`` returns); not a
    bool."""
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.is_floating_point() and not value.is_complex() \
            and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def int_option(name: str, value: object, minimum: int) -> int:
    """``value`` as an int option of at least ``minimum`` (numpy ints too; not a bool or a float such
    as 2.5), else a ValueError naming the option, its value and what it takes."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}; got {value!r}.")
    return int(value)


def number_option(name: str, value: object, *, minimum: float = 0.0, allow_minimum: bool = True) -> float:
    """``value`` as a finite real option ≥ ``minimum`` (> it when not ``allow_minimum``), else a
    ValueError naming the option, its value and what it takes."""
    bound = f"≥ {minimum:g}" if allow_minimum else f"> {minimum:g}"
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < minimum or (value == minimum and not allow_minimum)):
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}.")
    return float(value)


def bool_option(name: str, value: object) -> bool:
    """``value`` as a True/False option, else a TypeError naming it."""
    if not isinstance(value, (bool, numbers.Integral)) or value not in (0, 1):
        raise TypeError(f"{name} must be True or False; got {value!r}.")
    return bool(value)


PROBABILITY_FUNCTIONS = ("softmax", "sigmoid")
"""How ``Explanation.probabilities`` come from the class scores (the ``probabilities`` option of every explainer)."""


def probabilities_option(value: object) -> Optional[str]:
    """The ``probabilities`` option: "softmax", "sigmoid" or None (not given), else a ValueError naming it."""
    if value is None or (isinstance(value, str) and value in PROBABILITY_FUNCTIONS):
        return value
    raise ValueError(f"probabilities must be 'softmax' (a single-label classifier: the probabilities of its classes "
                     f"sum to 1) or 'sigmoid' (a multi-label classifier: each class's own, from its logit); got "
                     f"{value!r}.")


def seed_option(seed: object) -> Optional[int]:
    """A random seed as the methods take it: an int in ``SEED_RANGE``, or None (a fresh draw each call,
    see ``random_generator``); else a ValueError naming the option."""
    if seed is None:
        return None
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and SEED_RANGE[0] <= int(seed) < SEED_RANGE[1]:
        return int(seed)
    raise ValueError(f"seed must be an int (same seed, same draws) or None (fresh draws each call, from torch's "
                     f"global random state); got {seed!r}.")


def random_generator(seed: Optional[int], device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``; for None, seeded with a number drawn from torch's
    global (CPU) generator: every call draws afresh, and ``torch.manual_seed`` before it makes it repeat."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    return torch.Generator(device=device).manual_seed(seed)


def check_finite_reference(values: Tensor, name: str) -> None:
    """Refuse a baseline or reference tensor that holds NaN or inf, naming it and the first such value:
    a path from it, and so every attribution along it, would be undefined."""
    bad = ~torch.isfinite(values.detach())
    if bool(bad.any()):
        first = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name} holds NaN or inf ({int(bad.sum())} of its {values.numel()} values, the first at "
                         f"index {first}: {values[first].item()}); a path from it is undefined. Give finite values "
                         "in the model's input space (after preprocessing).")


NoiseDraws = Callable[[tuple[int, ...]], Tensor]
"""A source of standard normal noise: ``draws(shape)`` returns a tensor of that shape, each value drawn
from N(0, 1). The methods that add noise take one (``noise_draws=``) and call it once per sample, in
order, so that a test can replay another library's draws; by default they draw from a generator
seeded with their ``seed`` (see ``normal_draws``)."""


def normal_draws(seed: Optional[int], device: torch.device) -> NoiseDraws:
    """Standard normal draws from a generator on ``device`` seeded with ``seed`` (None: a fresh seed from
    torch's global generator, see ``random_generator``)."""
    generator = random_generator(seed, device)

    def draws(shape: tuple[int, ...]) -> Tensor:
        return torch.randn(shape, generator=generator, device=device)

    return draws


def drawn_noise(draws: NoiseDraws, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """``draws(shape)`` checked: a tensor of exactly ``shape`` with finite values (else a ValueError that
    says what came back), on ``device`` in ``dtype``."""
    noise = draws(shape)
    if not isinstance(noise, Tensor) or tuple(noise.shape) != tuple(shape):
        got = tuple(noise.shape) if isinstance(noise, Tensor) else type(noise).__name__
        raise ValueError(f"noise_draws must return a tensor of the shape it is asked for, {tuple(shape)}, of standard "
                         f"normal draws; it returned {got}.")
    if not bool(torch.isfinite(noise).all()):
        raise ValueError("noise_draws returned NaN or inf values; it must return standard normal draws.")
    return noise.to(device=device, dtype=dtype)


def noise_options(samples: object, noise_std: object, seed: object, noise_draws: object
                  ) -> tuple[int, float, Optional[int], Optional[NoiseDraws]]:
    """The options of a method that adds Gaussian noise, checked: (samples ≥ 1, noise_std ≥ 0, seed,
    noise_draws: None or a callable shape → N(0, 1) tensor)."""
    if noise_draws is not None and not callable(noise_draws):
        raise TypeError(f"noise_draws must be a callable shape → tensor of N(0, 1) draws; got "
                        f"{type(noise_draws).__name__}.")
    return (int_option("samples", samples, 1), number_option("noise_std", noise_std), seed_option(seed),
            noise_draws)
