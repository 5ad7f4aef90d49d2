"""Call scopes: everything a call sets on a model or on its thread, undone exactly afterwards.

Every explainer call, ``capture`` block and ``edit`` block runs inside a ``CallScope``. The
scope is the only place where the toolkit changes state that outlives a statement:

- hooks on the model's modules, registered through the scope: they act only on forward
  passes made by the thread that opened the scope (another thread serving predictions from
  the same model sees the plain model), and are removed when the scope ends;
- train/eval flags (modules whose ``train()`` does more than set the flag, such as torchvision's
  fx feature extractors that swap their graph, are restored through ``train()``);
- context managers entered for the call (``torch.inference_mode(False)``, function modes);
- the thread's grad mode and torch function-mode stack, put back as they were when the
  scope opened, whatever happened inside.

Ctrl-C: a ``KeyboardInterrupt`` may arrive between any two bytecodes. While the scope's own
code runs (opening, registering a hook, closing), SIGINT is deferred: the interrupt is raised
once that code is done, at the next forward pass of the call or when the scope closes, so no
interrupt can leave a hook registered, a flag changed or a mode on. Interrupts elsewhere (in
the model's forward, in autograd) are raised at once as usual and the scope undoes everything.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import AbstractContextManager
from types import CodeType, FrameType, TracebackType
from typing import Any, Callable, Generic, Optional, cast

import torch
from torch import nn
from typing_extensions import TypeVar

Function = TypeVar("Function", bound=Callable[..., Any])
Value = TypeVar("Value")
Entered = TypeVar("Entered", covariant=True, default=Any)
"""What ``with scope as value`` gives, what ``setup()`` returns: the scope itself unless a subclass
returns something else; a subclass states it as its type parameter (``CallScope["ActivationCapture"]``,
``CallScope[Captured]``)."""

_PROTECTED_CODE: set[CodeType] = set()
"""Code objects during which SIGINT is deferred (the scope's own state-changing steps)."""


def _protected(function: Function) -> Function:
    """Mark a function as one whose run must not be cut by a KeyboardInterrupt."""
    _PROTECTED_CODE.add(function.__code__)
    return function


def _in_protected_code(frame: Optional[FrameType]) -> bool:
    while frame is not None:
        if frame.f_code in _PROTECTED_CODE:
            return True
        frame = frame.f_back
    return False


class _InterruptDeferral:
    """The SIGINT handler installed while at least one scope is open in the main thread.

    It defers an interrupt that lands in protected code (``pending``) and hands any other
    to the handler that was installed before (normally ``signal.default_int_handler``,
    which raises KeyboardInterrupt).
    """

    def __init__(self) -> None:
        self.depth = 0
        self.previous: Optional[Callable[[int, Optional[FrameType]], object]] = None
        self.pending = False

    def handler(self, signum: int, frame: Optional[FrameType]) -> None:
        if _in_protected_code(frame):
            self.pending = True
            return
        self.pending = False
        assert self.previous is not None, "the handler is installed only with a previous one to hand on to"
        self.previous(signum, frame)

    @_protected
    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self.depth == 0:
            previous = signal.getsignal(signal.SIGINT)
            if not callable(previous):  # SIG_IGN, SIG_DFL or a handler set from C: nothing to wrap
                return
            self.previous = previous
            self.pending = False
            signal.signal(signal.SIGINT, self.handler)
        self.depth += 1

    @_protected
    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            if signal.getsignal(signal.SIGINT) == self.handler:
                signal.signal(signal.SIGINT, self.previous)
            self.previous = None

    def take_pending(self) -> bool:
        """Whether an interrupt was deferred in this (main) thread; clears it."""
        if threading.current_thread() is not threading.main_thread() or not self.pending:
            return False
        self.pending = False
        return True


_deferral = _InterruptDeferral()
_open_scopes = threading.local()


def raise_deferred_interrupt() -> None:
    """Raise the KeyboardInterrupt that arrived while a scope changed state, if any.

    Called at safe points (the start of each hook of ours, the end of a scope)."""
    if _deferral.take_pending():
        raise KeyboardInterrupt


def current_scope() -> Optional["CallScope[Any]"]:
    """The innermost scope opened by this thread, or None."""
    stack = getattr(_open_scopes, "stack", None)
    return stack[-1] if stack else None


def errors_handled_outside() -> set[int]:
    """The ids of the exceptions that this thread's callers were handling when its open scopes began
    (a call made inside ``except ...:``), with what those were raised from: an error raised during the
    call links to them as its ``__context__``, but they are not part of the call's own failure."""
    handled: set[int] = set()
    for scope in getattr(_open_scopes, "stack", ()):
        error = scope.handled_on_entry
        while error is not None and id(error) not in handled:
            handled.add(id(error))
            error = error.__cause__ or error.__context__
    return handled


CHECKPOINTING_FLAGS = ("grad_checkpointing", "gradient_checkpointing")
"""The module attributes with which timm and HuggingFace switch gradient checkpointing on."""


def _overrides_train(module: nn.Module) -> bool:
    return type(module).train is not nn.Module.train


class CallScope(AbstractContextManager[Entered], Generic[Entered]):
    """``with CallScope(model) as scope:`` — the state one call changes, undone when it ends.

    model: the model whose modules get hooks and flags (None for thread state only).
    eval_mode: put the model in eval mode for the scope (see ``eval_mode``).
    Subclasses that change more on entering do it in ``setup()``, which runs protected; its
    return value is what ``with ... as`` gives, and the subclass's type parameter says what it is
    (``class CaptureBlock(CallScope[Captured])``).
    """

    def __init__(self, model: Optional[nn.Module] = None, *, eval_mode: bool = False):
        self.model = model
        self.switch_to_eval = eval_mode
        self.thread = threading.get_ident()
        self._undo: list[Callable[[], object]] = []
        self._grad_enabled = True
        self._function_modes = 0
        self.handled_on_entry: Optional[BaseException] = None
        """The exception the caller was handling when the scope opened, if any (see ``errors_handled_outside``)."""

    @_protected
    def __enter__(self) -> Entered:
        _deferral.install()
        self.handled_on_entry = sys.exc_info()[1]
        self._grad_enabled = torch.is_grad_enabled()
        self._function_modes = torch._C._len_torch_function_stack()
        stack = getattr(_open_scopes, "stack", None)
        if stack is None:
            stack = _open_scopes.stack = []
        stack.append(self)
        try:
            if self.switch_to_eval and self.model is not None:
                self.eval_mode(self.model)
            return self.setup()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise

    def setup(self) -> Entered:
        """What the scope changes on entering (hooks); returns the ``with ... as`` value."""
        # the scope itself; a subclass whose `with` gives something else overrides setup
        return cast(Entered, self)

    @_protected
    def __exit__(
        self, error_type: Optional[type], error: Optional[BaseException], traceback: Optional[TracebackType]
    ) -> None:
        failure: Optional[BaseException] = None
        interrupted_in_undo = False
        try:
            if error_type is not None and issubclass(error_type, KeyboardInterrupt):
                _finish_abandoned_frames(traceback)
            while self._undo:
                undo = self._undo.pop()
                try:
                    undo()
                except KeyboardInterrupt:  # an entered scope's exit raising a deferred Ctrl-C: undo the rest first
                    interrupted_in_undo = True
                except Exception as undo_error:  # keep undoing the rest; report the first failure
                    failure = failure or undo_error
            while torch._C._len_torch_function_stack() > self._function_modes:
                torch._C._pop_torch_function_stack()
            torch.set_grad_enabled(self._grad_enabled)
            stack = getattr(_open_scopes, "stack", [])
            if self in stack:
                stack.remove(self)
            self.handled_on_entry = None
        finally:
            _deferral.uninstall()
        interrupted = _deferral.take_pending() or interrupted_in_undo
        if interrupted and error_type is not KeyboardInterrupt:
            raise KeyboardInterrupt
        if failure is not None and error_type is None:
            raise failure

    # ------------------------------------------------------------------ what a call may change

    @_protected
    def add_undo(self, undo: Callable[[], object]) -> None:
        """Run ``undo()`` when the scope ends (last added, first run)."""
        self._undo.append(undo)

    @_protected
    def enter(self, context: AbstractContextManager[Value]) -> Value:
        """Enter a context manager for the rest of the scope (e.g. ``torch.inference_mode(False)``)."""
        value = context.__enter__()
        self._undo.append(lambda: context.__exit__(None, None, None))
        return value

    def _owned(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        owner = self.thread

        def hook_of_this_thread(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:
                return None  # another thread's forward: the plain model
            raise_deferred_interrupt()
            return hook(*args, **kwargs)

        return hook_of_this_thread

    @_protected
    def forward_hook(self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> None:
        """``module.register_forward_hook(hook)`` for this thread's forward passes, until the scope ends."""
        handle = module.register_forward_hook(self._owned(hook), with_kwargs=with_kwargs)
        self._undo.append(handle.remove)

    @_protected
    def forward_pre_hook(self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> None:
        """``module.register_forward_pre_hook(hook)`` for this thread's forward passes, until the scope ends."""
        handle = module.register_forward_pre_hook(self._owned(hook), with_kwargs=with_kwargs)
        self._undo.append(handle.remove)

    @_protected
    def frozen_parameters(self, model: nn.Module) -> None:
        """``requires_grad`` off for every parameter of ``model`` (no weight gradient is wanted, so the forward
        keeps no layer input for one); each flag comes back when the scope ends."""
        flags = [parameter for parameter in model.parameters() if parameter.requires_grad]
        if not flags:
            return
        self._undo.append(lambda: [parameter.requires_grad_(True) for parameter in flags])
        for parameter in flags:
            parameter.requires_grad_(False)

    @_protected
    def without_gradient_checkpointing(self, model: nn.Module, modules: Optional[list[nn.Module]] = None) -> None:
        """timm's ``grad_checkpointing`` and HuggingFace's ``gradient_checkpointing`` off for the scope: a
        checkpointed block runs its forward again during the backward pass, when the call's hooks and rules may be
        gone, so that the recomputed values differ from the first ones (and timm checkpoints in eval mode too).
        The values are the same either way; checkpointing only saves memory. Only plain attributes set to True are
        switched (not properties); each comes back on when the last call that switched it off ends, so that calls
        on one model in several threads keep it off for each other. modules: ``list(model.modules())``, when the
        caller has it."""
        with _checkpointing_lock:
            taken: list[tuple[int, str]] = []
            others_switched = bool(_checkpointing_off)
            for module in model.modules() if modules is None else modules:
                attributes = module.__dict__
                for name in CHECKPOINTING_FLAGS:
                    key = (id(module), name)
                    if others_switched and key in _checkpointing_off:
                        _checkpointing_off[key][0] += 1
                    elif attributes.get(name) is True:
                        _checkpointing_off[key] = [1, module]
                        setattr(module, name, False)
                    else:
                        continue
                    taken.append(key)
            if taken:
                self._undo.append(lambda: _checkpointing_back_on(taken))

    @_protected
    def eval_mode(self, model: nn.Module, modules: Optional[list[nn.Module]] = None) -> None:
        """Put every module in eval mode; each module's own flag comes back when the scope ends.

        Modules that override ``train()`` (fx feature extractors swap their graph there) are
        restored through it, so they compute as before, not only report the same flag.
        modules: ``list(model.modules())``, when the caller has it.

        Calls that overlap on one model (threads) share the flags: a module goes back to train mode when the last
        call that holds it in eval mode ends, not when the first does (which would run the others' remaining passes
        in train mode, with dropout and batch statistics, and update BatchNorm's running statistics)."""
        modules = list(model.modules()) if modules is None else modules
        with _training_lock:
            if not _held_in_eval and not any(module.training for module in modules):
                return  # the usual case: an eval-mode model that no other call holds
            taken: list[int] = []
            for module in modules:
                key = id(module)
                if module.training:
                    entry = _held_in_eval.setdefault(key, [0, module])
                elif key in _held_in_eval:  # in eval mode because another open call put it there
                    entry = _held_in_eval[key]
                else:
                    continue
                entry[0] += 1
                taken.append(key)
            if not taken:
                return
            self._undo.append(lambda: _back_to_training(taken, modules))
            model.eval()


def _finish_abandoned_frames(traceback: Optional[TracebackType]) -> None:
    """Clear the finished frames an interrupt unwound through, so that what they held is released now.

    An interrupt can leave a generator-based context manager entered and never exited (torch's
    ``_pop_mode_temporarily``, around every call under a function mode): its generator, still
    suspended, would run its cleanup (pushing a mode back) whenever it is garbage-collected, at
    a random later time. Clearing the frames that hold it runs that cleanup here, before the
    scope puts the thread's state back. The traceback keeps its lines, not those frames' locals.
    """
    while traceback is not None:
        try:
            traceback.tb_frame.clear()
        except RuntimeError:  # a frame still running (the one that holds the ``with``)
            pass
        traceback = traceback.tb_next


_checkpointing_lock = threading.Lock()
_checkpointing_off: dict[tuple[int, str], list[Any]] = {}
"""Per (id(module), flag name) switched off by open scopes: [how many scopes, the module]."""

_training_lock = threading.Lock()
_held_in_eval: dict[int, list[Any]] = {}
"""id(module) → [the open calls holding it in eval mode, the module]: modules that were in train mode when a call
began (``CallScope.eval_mode``)."""


def _back_to_training(taken: list[int], modules: list[nn.Module]) -> None:
    """A call that held ``taken`` in eval mode ends: each whose last holder it was goes back to train mode, every
    other module of ``modules`` keeps its flag (a parent that overrides ``train()`` is restored through it, and the
    children it recursed into are put back)."""
    with _training_lock:
        released: set[int] = set()
        for key in taken:
            entry = _held_in_eval[key]
            entry[0] -= 1
            if entry[0] == 0:
                del _held_in_eval[key]
                released.add(key)
        if released:
            _restore_training([(module, True if id(module) in released else module.training) for module in modules])


def _checkpointing_back_on(taken: list[tuple[int, str]]) -> None:
    with _checkpointing_lock:
        for key in taken:
            entry = _checkpointing_off[key]
            entry[0] -= 1
            if entry[0] == 0:
                del _checkpointing_off[key]
                setattr(entry[1], key[1], True)


def _restore_training(flags: list[tuple[nn.Module, bool]]) -> None:
    for module, training in flags:  # parents first: their train() recurses into the children
        if module.training != training and _overrides_train(module):
            module.train(training)
    for module, training in flags:
        if module.training != training:  # nn.Module.__setattr__ is slow: touch only what changed
            module.training = training


