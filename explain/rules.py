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
inner function must handle the outer one as a whole, from its arguments.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Collection, Optional, Sequence

from torch.overrides import TorchFunctionMode

from .scope import CallScope


class Rule:
    """How some torch functions are computed during a call.

    ``functions``: the torch functions the rule takes over (``F.relu``, ``Tensor.relu``, ...).
    ``compute(func, args, kwargs)``: what a call of one of them returns instead. It runs with
    the rules' mode off; to leave a call as it is, return ``func(*args, **kwargs)``.
    """

    functions: ClassVar[frozenset[Callable[..., Any]]] = frozenset()

    def compute(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise TypeError(f"{type(self).__name__} does not define compute().")


class CallRules(TorchFunctionMode):
    """The function mode that routes each call of a rule's function to that rule."""

    def __init__(self, rules: Sequence[Rule]):
        super().__init__()
        self.rules = list(rules)
        self.table: dict[Callable[..., Any], Rule] = {}
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
        rule = self.table.get(func)
        if rule is None:
            return func(*args, **kwargs)
        return rule.compute(func, args, kwargs)


class call_rules(CallScope[CallRules]):  # noqa: N801 - used like a function, as torch.no_grad is
    """``with call_rules(rule, ...) as mode:`` — within the block, in this thread, every call of a
    rule's functions is computed by the rule. The mode is removed when the block ends, also on an
    exception or an interrupt (see ``explain.scope``)."""

    def __init__(self, *rules: Rule):
        super().__init__()
        self.mode = CallRules(rules)

    def setup(self) -> CallRules:
        return self.enter(self.mode)
