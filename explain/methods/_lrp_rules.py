"""The LRP rules as formulas (Montavon et al. 2019, "Layer-wise relevance propagation: an overview").

A linear layer computes z = f(x; W, b) (``F.linear``, ``F.conv2d``, ...). Its rule takes the relevance R at the
output (shape of z) to the input (shape of x). Notation: x⁺ = max(x, 0), x⁻ = min(x, 0), likewise W⁺, W⁻, b⁺, b⁻;
Jᵀ_W s is the layer's linear map with weights W, transposed, applied to s (shape of x); stab(z) = z + ε·sign(z),
with sign(0) = +1, keeps a division finite without changing its sign. Every rule has the form

    R_i = Σ_j q_ij / (Σ_i' q_i'j + bias share_j) · R_j

for some contributions q_ij, so Σ_i R_i = Σ_j R_j up to what the bias share and the stabiliser take. The rules read
the weights they are given and compute new tensors; nothing is written to a parameter. Also here: the proportional
rule of sums and average pools, BatchNorm folding, and the composites (which layer gets which rule, as in zennit).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence, overload

import torch
from torch import Tensor

LayerFunction = Callable[[Tensor, Tensor, Optional[Tensor]], Tensor]
"""f(x, weight, bias) → z: the layer's own function with its other arguments (stride, padding, ...) bound."""


def stabilize(z: Tensor, epsilon: float) -> Tensor:
    """z + ε·sign(z) with sign(0) = +1: a denominator that is never zero and keeps z's sign."""
    sign = (z >= 0).to(z.dtype) * 2 - 1
    return z + sign * epsilon


@overload
def _positive(tensor: Tensor) -> Tensor: ...
@overload
def _positive(tensor: None) -> None: ...
def _positive(tensor: Optional[Tensor]) -> Optional[Tensor]:
    return None if tensor is None else tensor.clamp(min=0)


@overload
def _negative(tensor: Tensor) -> Tensor: ...
@overload
def _negative(tensor: None) -> None: ...
def _negative(tensor: Optional[Tensor]) -> Optional[Tensor]:
    return None if tensor is None else tensor.clamp(max=0)


def _terms(layer: LayerFunction, terms: Sequence[tuple[Tensor, Tensor, Optional[Tensor]]]
           ) -> tuple[list[Tensor], list[Tensor]]:
    """f(x_k; W_k, b_k) for each term (x_k, W_k, b_k), on leaf copies of the x_k: (outputs, leaves). For z combined
    linearly from the outputs, the gradient of ⟨z, s⟩ at leaf k is Jᵀ_{W_k} s times the term's coefficient in z."""
    leaves = [x.detach().requires_grad_(True) for x, _, _ in terms]
    return [layer(leaf, weight, bias) for leaf, (_, weight, bias) in zip(leaves, terms)], leaves


def signed_share(layer: LayerFunction, x: Tensor, relevance: Tensor, for_positive: Tensor, for_negative: Tensor,
                 bias: Optional[Tensor], stabilizer: float, where: Optional[Tensor] = None) -> Tensor:
    """The relevance split over one kind of contribution: positive inputs through the weights ``for_positive`` (a),
    negative inputs through ``for_negative`` (b), R_i = Σ_j (x⁺_i a_ij + x⁻_i b_ij) R_j / (z_j + bias_j) with
    z_j = Σ_i (x⁺_i a_ij + x⁻_i b_ij). where: 0/1 mask (shape of z) of the outputs that take part. This is the
    shared core of z⁺, α-β and γ. (An input with no negative value, as after a ReLU, skips the x⁻ term: it is 0.)"""
    terms = [(x.clamp(min=0), for_positive, bias)]
    if bool((x < 0).any()):
        terms.append((x.clamp(max=0), for_negative, None))
    with torch.enable_grad():
        outputs, leaves = _terms(layer, terms)
        z = outputs[0] if len(outputs) == 1 else outputs[0] + outputs[1]
        s = relevance / stabilize(z.detach(), stabilizer)
        if where is not None:
            s = s * where
        gradients = torch.autograd.grad(z, leaves, s)
    shares = [inputs * gradient for (inputs, _, _), gradient in zip(terms, gradients)]
    return shares[0] if len(shares) == 1 else shares[0] + shares[1]


class LinearRule(ABC):
    """How a linear layer's output relevance (shape of z) is sent to its input (shape of x)."""

    name: ClassVar[str] = ""

    @abstractmethod
    def relevance(self, layer: LayerFunction, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  relevance: Tensor) -> Tensor:
        """The relevance at the input of f(x; weight, bias) (shape of x), given the relevance at its output."""


@dataclass(frozen=True)
class Epsilon(LinearRule):
    """LRP-ε: R_i = Σ_j x_i w_ij / stab_ε(z_j) · R_j with z = Wx + b. The bias and ε absorb some relevance."""

    epsilon: float = 1e-6
    name: ClassVar[str] = "epsilon"

    def relevance(self, layer: LayerFunction, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  relevance: Tensor) -> Tensor:
        with torch.enable_grad():
            (z,), leaves = _terms(layer, [(x, weight, bias)])
            (gradient,) = torch.autograd.grad(z, leaves, relevance / stabilize(z.detach(), self.epsilon))
        return x * gradient


@dataclass(frozen=True)
class ZPlus(LinearRule):
    """LRP-z⁺ (α1β0), for inputs of either sign as zennit writes it: R_i = Σ_j (x⁺_i w⁺_ij + x⁻_i w⁻_ij) R_j /
    (Σ_i' (x⁺_i' w⁺_i'j + x⁻_i' w⁻_i'j) + b⁺_j). Conserves relevance up to the positive bias's share."""

    stabilizer: float = 1e-6
    name: ClassVar[str] = "zplus"

    def relevance(self, layer: LayerFunction, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  relevance: Tensor) -> Tensor:
        return signed_share(layer, x, relevance, _positive(weight), _negative(weight), _positive(bias),
                            self.stabilizer)


@dataclass(frozen=True)
class AlphaBeta(LinearRule):
    """LRP-αβ with α − β = 1: α times the activating share (x⁺ through W⁺, x⁻ through W⁻, bias b⁺) minus β times
    the inhibiting share (x⁺ through W⁻, x⁻ through W⁺, bias b⁻). Conserves relevance up to the biases' shares
    (and where an output has no contribution of one kind)."""

    alpha: float = 2.0
    beta: float = 1.0
    stabilizer: float = 1e-6
    name: ClassVar[str] = "alpha_beta"

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0 or abs(self.alpha - self.beta - 1) > 1e-12:
            raise ValueError(f"alpha and beta must be non-negative with alpha - beta = 1; got {self.alpha}, "
                             f"{self.beta}.")

    def relevance(self, layer: LayerFunction, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  relevance: Tensor) -> Tensor:
        positive, negative = _positive(weight), _negative(weight)
        activating = signed_share(layer, x, relevance, positive, negative, _positive(bias), self.stabilizer)
        if self.beta == 0:
            return self.alpha * activating
        inhibiting = signed_share(layer, x, relevance, negative, positive, _negative(bias), self.stabilizer)
        return self.alpha * activating - self.beta * inhibiting


@dataclass(frozen=True)
class Gamma(LinearRule):
    """LRP-γ, generalised to inputs of either sign (Andéol et al. 2021; zennit's ``Gamma``): with W↑ = W + γW⁺ and
    W↓ = W + γW⁻ (biases likewise), an output with z_j > 0 sends its relevance along x⁺ through W↑ and x⁻ through
    W↓, one with z_j < 0 along x⁺ through W↓ and x⁻ through W↑; z_j = 0 sends nothing. γ → 0 gives LRP-0,
    γ → ∞ the z⁺ rule. Conserves relevance up to the biases' shares."""

    gamma: float = 0.25
    stabilizer: float = 1e-6
    name: ClassVar[str] = "gamma"

    def relevance(self, layer: LayerFunction, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  relevance: Tensor) -> Tensor:
        up = weight + self.gamma * weight.clamp(min=0)
        down = weight + self.gamma * weight.clamp(max=0)
        up_bias = None if bias is None else bias + self.gamma * bias.clamp(min=0)
        down_bias = None if bias is None else bias + self.gamma * bias.clamp(max=0)
        with torch.no_grad():
            z = layer(x, weight, bias)
        return (signed_share(layer, x, relevance, up, down, up_bias, self.stabilizer, where=z > 0)
                + signed_share(layer, x, relevance, down, up, down_bias, self.stabilizer, where=z < 0))


@dataclass(frozen=True)
class ZBox(LinearRule):
    """LRP-z^B (Montavon et al. 2017) for an input bounded by low ≤ x ≤ high: R_i = Σ_j (x_i w_ij − l_i w⁺_ij −
    h_i w⁻_ij) R_j / Σ_i' (...). The bias cancels, so relevance is conserved. low, high: tensors that broadcast to
    x (per-channel bounds of a normalised image as (1, C, 1, 1))."""

    low: Tensor
    high: Tensor
    stabilizer: float = 1e-6
    name: ClassVar[str] = "zbox"

    def relevance(self, layer: LayerFunction, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  relevance: Tensor) -> Tensor:
        low = self.low.to(x).expand_as(x)
        high = self.high.to(x).expand_as(x)
        terms = [(x, weight, bias), (low, weight.clamp(min=0), _positive(bias)),
                 (high, weight.clamp(max=0), _negative(bias))]
        with torch.enable_grad():
            (data, lowest, highest), leaves = _terms(layer, terms)
            z = data - (lowest + highest)
            gradients = torch.autograd.grad(z, leaves, relevance / stabilize(z.detach(), self.stabilizer))
        return x * gradients[0] + (low * gradients[1] + high * gradients[2])  # the last two gradients are −Jᵀ s


@dataclass(frozen=True)
class Flat(LinearRule):
    """LRP-flat (Lapuschkin et al. 2019): every input in an output's receptive field gets an equal share,
    R_i = Σ_j 1_ij R_j / Σ_i' 1_i'j, whatever the input and the weights. Conserves relevance."""

    stabilizer: float = 1e-6
    name: ClassVar[str] = "flat"

    def relevance(self, layer: LayerFunction, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  relevance: Tensor) -> Tensor:
        with torch.enable_grad():
            (z,), leaves = _terms(layer, [(torch.ones_like(x), torch.ones_like(weight), None)])
            (gradient,) = torch.autograd.grad(z, leaves, relevance / stabilize(z.detach(), self.stabilizer))
        return gradient


def proportional(function: Callable[..., Tensor], inputs: Sequence[Tensor], relevance: Tensor,
                 stabilizer: float) -> list[Tensor]:
    """The z-rule of a linear function without bias of one or more inputs (a sum, an average pool, a mean):
    R_k = x_k ⊙ ∂⟨f, R / stab(z)⟩/∂x_k with z = f(x_1, ..., x_n), i.e. each input gets the relevance in proportion
    to its contribution (zennit's ``Norm`` rule, and its canonised residual sum). Returns one tensor per input."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) for x in inputs]
        z = function(*leaves)
        s = relevance / stabilize(z.detach(), stabilizer)
        gradients = torch.autograd.grad(z, leaves, s, allow_unused=True)
    return [torch.zeros_like(x) if gradient is None else x * gradient for x, gradient in zip(inputs, gradients)]


@dataclass
class BatchNormStatistics:
    """What a BatchNorm computes, y = (x − mean) / √(var + eps) · weight + bias, per channel (1-D tensors;
    weight and bias None for a BatchNorm without affine parameters). Snapshots taken when the BatchNorm ran."""

    mean: Tensor
    var: Tensor
    weight: Optional[Tensor]
    bias: Optional[Tensor]
    eps: float


def fold_batch_norm(weight: Tensor, bias: Optional[Tensor], norm: BatchNormStatistics, transposed_layer: bool = False,
                    groups: int = 1) -> tuple[Tensor, Tensor]:
    """New (weight, bias) of a linear layer followed by a BatchNorm, as one layer (zennit's MergeBatchNorm):
    W' = W · s per output channel and b' = (b − mean) · s + β, with s = γ / √(var + eps).

    weight: (out, in, ...) for F.linear and convolutions, (in, out / groups, ...) for transposed convolutions.
    """
    scale = 1 / (norm.var + norm.eps) ** 0.5 if norm.weight is None else norm.weight / (norm.var + norm.eps) ** 0.5
    trailing = (1,) * (weight.dim() - 2)
    if transposed_layer:  # output channel o = g · (out / groups) + j sits at weight[g's inputs, j]
        grouped = weight.unflatten(0, (groups, -1))
        folded = (grouped * scale.view(groups, 1, -1, *trailing)).flatten(0, 1)
    else:
        folded = weight * scale.view(-1, 1, *trailing)
    shifted = (0 if bias is None else bias) - norm.mean
    folded_bias = shifted * scale + (0 if norm.bias is None else norm.bias)
    return folded, folded_bias


COMPOSITES = ("epsilon_gamma_box", "epsilon_plus", "epsilon_alpha2_beta1", "epsilon_plus_flat",
              "epsilon_alpha2_beta1_flat")
"""zennit's composites (``zennit.composites``), by the names zennit registers them under."""


@dataclass(frozen=True)
class Composite:
    """Which rule each linear layer gets, as zennit's composites assign them: ``first`` ("zbox", "flat" or None) for
    the first layer of a kind in ``first_kinds`` that the forward runs on the input's path, ``convolution`` for the
    other (transposed) convolutions, ``linear`` for the fully connected layers."""

    name: str
    convolution: LinearRule
    linear: LinearRule
    first: Optional[str] = None
    first_kinds: frozenset = frozenset()


def make_composite(name: str, epsilon: float = 1e-6, gamma: float = 0.25, stabilizer: float = 1e-6) -> Composite:
    """The composite of a name as zennit writes it, "epsilon_gamma_box" or "EpsilonGammaBox" (case, "_" and "-" do
    not matter); see ``COMPOSITES``."""
    if not isinstance(name, str):
        raise TypeError(f"composite must be a name, one of {COMPOSITES}; got {type(name).__name__}.")
    key = name.lower().replace("_", "").replace("-", "")
    linear = Epsilon(epsilon)
    convolutions = {"epsilongammabox": Gamma(gamma, stabilizer), "epsilonplus": ZPlus(stabilizer),
                    "epsilonalpha2beta1": AlphaBeta(2.0, 1.0, stabilizer)}
    if key in convolutions:
        first = ("zbox", frozenset({"convolution", "transposed"})) if key == "epsilongammabox" else (None, frozenset())
        return Composite(next(n for n in COMPOSITES if n.replace("_", "") == key), convolutions[key], linear, *first)
    if key.endswith("flat") and key[: -len("flat")] in ("epsilonplus", "epsilonalpha2beta1"):
        base = make_composite(key[: -len("flat")], epsilon, gamma, stabilizer)
        return Composite(base.name + "_flat", base.convolution, linear, "flat",
                         frozenset({"linear", "convolution", "transposed"}))
    raise ValueError(f"unknown composite {name!r}; choose one of {', '.join(COMPOSITES)} (or zennit's class names, "
                     "e.g. EpsilonGammaBox).")
