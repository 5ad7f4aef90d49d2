"""Threads attacking one shared model: each thread's maps equal the single-threaded maps for the same image and
target, whatever the other threads run (other methods, no_grad / inference_mode / autocast, a Ctrl-C), and the
model and the targets shared are left as found."""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Callable

import pytest
import timm
import torch
import torchvision

import explain
from explain import SegmentationTarget


def model_state(model: torch.nn.Module) -> tuple[list[Any], list[bool], list[bool]]:
    """Every module's hooks, train flags and the parameters' requires_grad."""
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._backward_pre_hooks))
             for m in model.modules()]
    return hooks, [m.training for m in model.modules()], [p.requires_grad for p in model.parameters()]


def in_threads(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run every job at once, each in its own thread (started together); their results; raises the first error."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def run(index: int) -> None:
        try:
            start.wait()
            results[index] = jobs[index]()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


CONTEXTS: dict[str, Callable[[], Any]] = {
    "plain": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "set_grad_enabled": lambda: torch.set_grad_enabled(False),
}


def explained_in(context: str, explainer: explain.Explainer, x: torch.Tensor, target: int) -> torch.Tensor:
    """The raw maps of a call made inside ``context``, after checking that the call left the thread's modes."""
    with CONTEXTS[context]():
        modes = torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu")
        maps = explainer.explain(x, target=target).raw_maps
        assert modes == (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"))
    return maps.float()


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_mixed_methods_and_contexts_on_one_vit_match_the_single_threaded_maps(mode):
    """GradCAM, LRP, AttnLRP, rollout and Integrated Gradients on one timm ViT at once, each thread inside another
    context of the caller; the model in train mode (dropout) is explained in eval mode by every thread, and left
    in train mode with its flags and hooks as found."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=5, depth=2,
                              drop_rate=0.3, attn_drop_rate=0.3, proj_drop_rate=0.3)
    model.train(mode == "train")
    images = [torch.randn(1, 3, 32, 32) for _ in range(3)]
    explainers = [explain.GradCAM(model), explain.LRP(model), explain.AttnLRP(model),
                  explain.AttentionRollout(model), explain.IntegratedGradients(model, steps=4)]
    calls = [(explainer, context, images[i % 3], i) for i, (explainer, context) in enumerate(zip(explainers, CONTEXTS))]
    before = model_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = [explained_in(context, explainer, x, target) for explainer, context, x, target in calls]
        together = in_threads([lambda e=explainer, c=context, x=x, t=target: explained_in(c, e, x, t)
                               for explainer, context, x, target in calls])
    for (explainer, context, _, _), single, threaded in zip(calls, alone, together):
        torch.testing.assert_close(threaded, single, msg=f"{explainer.method_name} in {context}")
    assert model_state(model) == before


def test_a_ctrl_c_in_one_threads_model_hook_leaves_the_other_threads_maps_and_the_model_as_found():
    """A KeyboardInterrupt raised by the user's forward hook in one thread's call ends that call only: the threads
    explaining meanwhile get their single-threaded maps, and the train-mode model is left with its own hook only,
    in train mode, its BatchNorm statistics unchanged (torchvision's ResNet-18)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).train()
    x = torch.randn(2, 3, 32, 32)
    explainers = {"gradcam": explain.GradCAM(model, "layer4"), "saliency": explain.Saliency(model)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = {name: explainer.explain(x, target=1).raw_maps for name, explainer in explainers.items()}
    interrupted: list[str] = []

    def interrupt(module: torch.nn.Module, args: object, output: object) -> None:
        if threading.current_thread().name == "interrupted":
            interrupted.append("raised")
            raise KeyboardInterrupt

    handle = model.layer1.register_forward_hook(interrupt)
    before = model_state(model)
    statistics = [buffer.clone() for buffer in model.buffers()]

    def interrupted_call() -> str:
        threading.current_thread().name = "interrupted"
        try:
            explain.LRP(model).explain(x, target=1)
        except KeyboardInterrupt:
            return "interrupted"
        return "not interrupted"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = in_threads([interrupted_call, *(lambda e=e: e.explain(x, target=1).raw_maps
                                                  for e in explainers.values())])
    handle.remove()
    assert results[0] == "interrupted" and interrupted == ["raised"]
    for name, maps in zip(explainers, results[1:]):
        torch.testing.assert_close(maps, alone[name], msg=name)
    before[0][list(model.modules()).index(model.layer1)] = (0, 0, 0, 0)  # the test's own hook, removed
    assert model_state(model) == before
    assert all(torch.equal(a, b) for a, b in zip(statistics, model.buffers()))


class TinySegmenter(torch.nn.Module):
    """(N, 3, 16, 16) → (N, 3, 16, 16) logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU())
        self.head = torch.nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_one_segmentation_target_shared_by_threads_keeps_nothing_of_their_calls():
    """One SegmentationTarget (the predicted pixels of class 1) used by several threads at once on different
    images: each thread's maps are those of a fresh target in a single thread, also for the methods that score
    copies over the explained images' predicted pixels (Integrated Gradients, Score-CAM, smooth="augment"), and
    after the calls the target holds nothing of them (it kept every thread's predicted pixels for good)."""
    torch.manual_seed(0)
    model = TinySegmenter().eval()
    images = [torch.randn(2, 3, 16, 16), 2 * torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16) - 0.5]
    explainers = [explain.IntegratedGradients(model, steps=4), explain.ScoreCAM(model, "body.3", progress=False),
                  explain.GradCAM(model, "body.3", smooth="augment")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = [[e.explain(x, target=SegmentationTarget(1)).raw_maps for x in images] for e in explainers]
        shared = SegmentationTarget(1)
        for e, expected in zip(explainers, alone):
            threaded = in_threads([lambda x=x, e=e: e.explain(x, target=shared).raw_maps for x in images])
            for maps, single in zip(threaded, expected):
                torch.testing.assert_close(maps, single, msg=e.method_name)
    held: list[torch.Tensor] = []
    for value in vars(shared).values():  # the mask is None: any tensor is a call's
        held += [value] if isinstance(value, torch.Tensor) else [
            item for item in (value.values() if isinstance(value, dict) else ()) if isinstance(item, torch.Tensor)]
    assert not held, f"the target kept {len(held)} tensors of the calls after they ended"
