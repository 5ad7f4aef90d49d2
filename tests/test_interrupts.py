"""Ctrl-C at any instant: after a KeyboardInterrupt that lands anywhere in a call (opening it,
registering hooks, in the forward, in autograd, while undoing), the model and the thread's
torch state are exactly as before the call.

A timer thread calls ``_thread.interrupt_main()`` (what Ctrl-C does) after a random delay drawn
over the call's typical duration, thousands of times. ``EXPLAIN_INTERRUPT_CALLS`` sets the
number of calls per kind: 250 by default (1,000 calls, about 20 s);
EXPLAIN_INTERRUPT_CALLS=1250 runs the 5,000 calls of issue 13 (about 2 minutes).
"""

from __future__ import annotations

import _thread
import os
import queue
import random
import signal
import sys
import threading
import time
import warnings

import pytest
import torch
from conftest import SmallCNN, assert_state_equal, model_state

import explain
from explain.scope import current_scope

CALLS_PER_KIND = int(os.environ.get("EXPLAIN_INTERRUPT_CALLS", "250"))


def thread_state() -> tuple:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch._C._len_torch_function_stack(),
            signal.getsignal(signal.SIGINT), current_scope())


class Interrupter:
    """A thread that, when armed with a delay, sleeps that long and then does what Ctrl-C does."""

    def __init__(self):
        self.requests: queue.Queue = queue.Queue()
        self.fired = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while (delay := self.requests.get()) is not None:
            deadline = time.perf_counter() + delay
            while time.perf_counter() < deadline:  # finer than time.sleep
                pass
            _thread.interrupt_main()
            self.fired.set()

    def interrupted_during(self, call, delay: float) -> bool:
        """Run ``call`` with an interrupt fired after ``delay`` seconds; whether it landed inside the call.
        The interrupt is always delivered before this returns (never later, in the test runner)."""
        self.fired.clear()
        inside = True
        try:
            self.requests.put(delay)
            call()
            inside = False
            while True:  # the interrupt lands here when the call was faster than the delay
                self.fired.wait()
                time.sleep(0)
        except KeyboardInterrupt:
            self.fired.wait()
            return inside

    def stop(self):
        self.requests.put(None)
        self.thread.join()


def kinds(model: torch.nn.Module, eval_model: torch.nn.Module, x: torch.Tensor) -> dict:
    """The calls interrupted: three explainers on a train-mode model, a capture block on an
    eval-mode one (a train-mode forward of the user's own updates BatchNorm statistics)."""
    gradcam = explain.GradCAM(model, "features.6")
    ablation = explain.AblationCAM(model, "features.6", progress=False)
    guided = explain.GuidedBackprop(model)

    def captured():
        with explain.capture(eval_model, ["features.3", "features.6"], grads=True) as records:
            eval_model(x).sum().backward()
        assert records["features.6"].grad is not None

    return {
        "gradcam": lambda: gradcam.explain(x, target=[1, 2]),
        "ablationcam": lambda: ablation.explain(x, target=[1, 2]),
        "guidedbackprop": lambda: guided.explain(x, target=[1, 2]),
        "capture": captured,
    }


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_an_interrupt_at_any_instant_leaves_model_and_thread_as_found():
    torch.manual_seed(0)
    model = SmallCNN().train()
    model.features[1].eval()
    model.head.weight.requires_grad_(False)
    eval_model = SmallCNN().eval()
    x = torch.randn(2, 3, 12, 12)
    calls = kinds(model, eval_model, x)
    rng = random.Random(0)
    before_thread = thread_state()
    landed_inside = dict.fromkeys(calls, 0)
    interrupter, switch_interval = Interrupter(), sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # let the interrupter thread run within microseconds of its deadline
    try:
        check_calls(calls, rng, interrupter, landed_inside, model, eval_model)
    finally:
        sys.setswitchinterval(switch_interval)
        interrupter.stop()
    assert thread_state() == before_thread
    # most interrupts must have landed inside the calls, or the test proves little
    for name, count in landed_inside.items():
        assert count >= 0.5 * CALLS_PER_KIND, f"{name}: only {count} of {CALLS_PER_KIND} interrupts landed inside"
    # and the toolkit still works afterwards
    explanation = explain.GradCAM(model, "features.6", normalize=None).explain(x, target=[1, 2])
    assert torch.isfinite(explanation.maps).all()


def check_calls(calls, rng, interrupter, landed_inside, model, eval_model):
    before_model, before_eval_model, before_thread = model_state(model), model_state(eval_model), thread_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        durations = {}
        for name, call in calls.items():
            call()  # warm-up
            start = time.perf_counter()
            for _ in range(5):
                call()
            durations[name] = (time.perf_counter() - start) / 5
        for index in range(CALLS_PER_KIND * len(calls)):
            name = list(calls)[index % len(calls)]
            landed_inside[name] += interrupter.interrupted_during(calls[name], rng.uniform(0, durations[name]))
            assert thread_state() == before_thread, f"{name}, call {index}: thread state changed"
            assert_state_equal(before_model, model_state(model))
            eval_model.zero_grad(set_to_none=True)  # the capture block runs .backward(): the user's own doing
            assert_state_equal(before_eval_model, model_state(eval_model))
