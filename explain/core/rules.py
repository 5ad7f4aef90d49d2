"""Call-scoped rules: "this torch function is computed this way during this call".

A ``Rule`` takes over some torch functions (``F.relu``, ``F.scaled_dot_product_attention``,
...). ``call_rules(rule, ...)`` activates rules with a ``torch.overrides.TorchFunctionMode`` for
the duration of a ``with`` block, in the current thread only (torch keeps the mode stack per
thread), as a ``CallScope``: the mode is off again when the block ends, whatever happens,
Ctrl-C included. Functional calls are caught as well as the ones modules make, and no module of
the model is replaced: guided backprop's and deconvnet's ReLUs, DeepLIFT's rescale rule and
attention recording are all rules.

A rule's ``compute`` runs with the mode switched off (torch pops a mode while its handler runs),
so what it calls is computed plainly. The same is true of a Python-level torch function that
dispatches on its own and calls other torch functions inside (``F.multi_head_attention_forward``
calls ``F.scaled_dot_product_attention``): the mode sees the outer call only, so a rule for the
inner function must handle the outer one as a whole, from its arguments: for instance by computing
it step by step with the mode entered again (``with mode:``), so that the rules see the steps.

A rule with ``sees_every_call`` gets every call the mode sees, not only those of its table (LRP and
DeepLIFT follow the tensors that depend on the input through all of them). The helpers below
(``torch_functions``, ``tensors_in``, ``writes_in_place``, ``function_name``) are what such rules
share.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, ClassVar, Collection, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .scope import CallScope


class Rule:
    """How some torch functions are computed during a call.

    ``functions``: the torch functions the rule takes over (``F.relu``, ``Tensor.relu``, ...).
    ``compute(func, args, kwargs)``: what a call of one of them returns instead. It runs with
    the rules' mode off; to leave a call as it is, return ``func(*args, **kwargs)``.
    """

    functions: ClassVar[frozenset[Callable[..., Any]]] = frozenset()
    sees_every_call: ClassVar[bool] = False
    """Whether ``compute`` gets every torch function call, also those not in ``functions``."""

    def compute(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise TypeError(f"{type(self).__name__} does not define compute().")


class CallRules(TorchFunctionMode):
    """The function mode that routes each call of a rule's function to that rule."""

    def __init__(self, rules: Sequence[Rule]):
        super().__init__()
        self.rules = list(rules)
        self.table: dict[Callable[..., Any], Rule] = {}
        every_call = [rule for rule in self.rules if rule.sees_every_call]
        if len(every_call) > 1:
            raise ValueError("two rules see every call; give the mode one such rule.")
        self.every_call: Optional[Rule] = every_call[0] if every_call else None
        for rule in self.rules:
            for function in rule.functions:
                if function in self.table:
                    raise ValueError(f"two rules take over {function}; give each function one rule.")
                self.table[function] = rule

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: Optional[dict[str, Any]] = None,
    ) -> Any:
        kwargs = kwargs or {}
        rule = self.table.get(func, self.every_call)
        if rule is None:
            return func(*args, **kwargs)
        return rule.compute(func, args, kwargs)


class call_rules(CallScope[CallRules]):  # noqa: N801 - used like a function, as torch.no_grad is
    """``with call_rules(rule, ...) as mode:`` — within the block, in this thread, every call of a
    rule's functions is computed by the rule. The mode is removed when the block ends, also on an
    exception or an interrupt (see ``explain.core.scope``)."""

    def __init__(self, *rules: Rule):
        super().__init__()
        self.mode = CallRules(rules)

    def setup(self) -> CallRules:
        return self.enter(self.mode)


# ------------------------------------------------------------------ helpers for rules that follow every call


def torch_functions(*names: str) -> frozenset[Callable[..., Any]]:
    """The torch functions of these names that exist, in every namespace a model calls them from:
    ``torch.<name>``, ``Tensor.<name>``, ``F.<name>``, ``torch._C._nn.<name>``, ``torch.special.<name>``."""
    found = set()
    for name in names:
        for namespace in (torch, Tensor, F, torch._C._nn, torch.special):
            function = getattr(namespace, name, None)
            if callable(function):
                found.add(function)
    return frozenset(found)


def tensors_in(value: Any) -> Iterator[Tensor]:
    """The tensors among a call's arguments or results (also inside lists, tuples and dicts)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif type(value) is dict:
        for item in value.values():
            yield from tensors_in(item)


_SIGNATURES: dict[Callable[..., Any], Optional[inspect.Signature]] = {}


def signature_of(function: Callable[..., Any]) -> Optional[inspect.Signature]:
    """The Python signature of a torch function (None for built-ins, which have none), cached."""
    if function not in _SIGNATURES:
        try:
            _SIGNATURES[function] = inspect.signature(function) if inspect.isfunction(function) else None
        except (TypeError, ValueError):
            _SIGNATURES[function] = None
    return _SIGNATURES[function]


_IN_PLACE_OPERATORS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                                 "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                                 "__imatmul__", "__setitem__"})


def writes_in_place(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call writes into its first argument (``relu_``, ``x += y``, ``x[i] = y``,
    ``F.relu(x, inplace=True)``, ``F.hardtanh(x, -1, 1, True)``)."""
    name = getattr(function, "__name__", "")
    if (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS:
        return True
    position = _inplace_position(function)
    if position is not None and len(args) > position:
        return bool(args[position])
    return bool(kwargs.get("inplace", False))


def _inplace_position(function: Callable[..., Any]) -> Optional[int]:
    """Where a Python function takes ``inplace`` positionally (``F.hardtanh(x, -1, 1, True)``), read from its
    signature once (not bound on every call); None when it takes no such parameter or only by keyword."""
    try:
        return _inplace_position_cached(function)
    except TypeError:  # an unhashable callable: read it now
        return _inplace_position_cached.__wrapped__(function)


@functools.lru_cache(maxsize=4096)
def _inplace_position_cached(function: Callable[..., Any]) -> Optional[int]:
    signature = signature_of(function)
    names = [] if signature is None else [
        parameter.name for parameter in signature.parameters.values()
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return names.index("inplace") if "inplace" in names else None


def function_name(function: Callable[..., Any]) -> str:
    """A torch function's name as a model calls it: ``relu``, ``__mul__``, ``T`` for the ``Tensor.T``
    property (whose getter is what the mode sees)."""
    name = getattr(function, "__name__", None)
    if name == "__get__":
        name = getattr(getattr(function, "__self__", None), "__name__", name)
    return name if isinstance(name, str) else repr(function)
