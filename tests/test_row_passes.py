"""Methods that run many copies of the images (path points, noisy samples, references) push them
through the model in passes (``Explainer.row_passes``). With ``batch_size`` None a pass that runs
out of memory is run again in halves, with the same result as passes that fit from the start; the
explainer keeps the size that fitted; a size the caller gave is kept and its failure explained.

A GPU's out-of-memory error is simulated on the CPU by a model that refuses batches of more rows
than it "has memory" for, in its forward or in its backward pass."""

from __future__ import annotations

import pytest
import torch
from conftest import SmallCNN, assert_state_equal, model_state
from torch import nn

import explain
from explain.core.capture import ModelInputError, is_out_of_memory
from explain.methods import passes


class RefuseBackward(torch.autograd.Function):
    """Identity whose backward runs out of "memory" for batches of more than ``rows`` rows."""

    @staticmethod
    def forward(context, inputs, rows):
        context.rows = rows
        return inputs.view_as(inputs)

    @staticmethod
    def backward(context, gradient):
        if gradient.shape[0] > context.rows:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return gradient, None


class LimitedMemory(nn.Module):
    """SmallCNN that raises torch's OutOfMemoryError for batches of more than ``rows`` rows, in
    its forward pass (``where="forward"``) or in the backward pass from its output (``"backward"``)."""

    def __init__(self, rows: int, where: str = "forward"):
        super().__init__()
        torch.manual_seed(0)
        self.net = SmallCNN(classes=4)
        self.rows, self.where = rows, where
        self.refusals = 0
        self.largest_batch = 0

    def forward(self, x):
        if x.shape[0] > self.rows and self.where == "forward":
            self.refusals += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        self.largest_batch = max(self.largest_batch, x.shape[0])
        output = self.net(x)
        if self.where == "backward" and output.requires_grad:
            output = RefuseBackward.apply(output, self.rows)
        return output


METHODS = {
    "integratedgradients": lambda model, **kw: explain.IntegratedGradients(model, steps=12, **kw),
    "gradientshap": lambda model, **kw: explain.GradientShap(model, torch.randn(3, 3, 12, 12), samples=10, **kw),
    "deepliftshap": lambda model, **kw: explain.DeepLiftShap(model, torch.randn(5, 3, 12, 12), **kw),
    "smoothgrad": lambda model, **kw: explain.SmoothGrad(model, samples=9, **kw),
    "layerintegratedgradients": lambda model, **kw: explain.LayerIntegratedGradients(
        model, "net.features.3", steps=12, **kw),
    "layerconductance": lambda model, **kw: explain.LayerConductance(model, "net.features.3", steps=12, **kw),
    "guidedig": lambda model, **kw: explain.GuidedIG(model, steps=6, **kw),
    "blurig": lambda model, **kw: explain.BlurIG(model, steps=12, **kw),
}


@pytest.fixture
def large_passes(monkeypatch):
    """Automatic passes of 64 rows on the CPU whatever the images' size, as a GPU's large passes."""
    monkeypatch.setitem(passes.ROWS_PER_PASS, "cpu", 64)
    monkeypatch.setattr(passes, "CPU_VALUES_PER_PASS", 0)


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_pass_that_runs_out_of_memory_is_run_again_in_halves_with_the_same_result(name, where, large_passes):
    torch.manual_seed(1)
    images = torch.randn(2, 3, 12, 12, dtype=torch.float64)
    build = METHODS[name]
    unlimited = LimitedMemory(rows=10_000).double().eval()
    with torch.random.fork_rng():
        expected = build(unlimited, batch_size=3, normalize=None).explain(images, target=[[1, 2], [0, 3]])
    model = LimitedMemory(rows=3, where=where).double().eval()
    model.load_state_dict(unlimited.state_dict())
    before = model_state(model)
    explainer = build(model, normalize=None)
    with torch.random.fork_rng():
        result = explainer.explain(images, target=[[1, 2], [0, 3]])
    assert_state_equal(before, model_state(model))
    torch.testing.assert_close(result.raw_maps, expected.raw_maps, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(result.attributions, expected.attributions, rtol=1e-10, atol=1e-12)
    for key, value in expected.diagnostics.items():
        torch.testing.assert_close(result.diagnostics[key], value, rtol=1e-6, atol=1e-9)
    fitted = explainer.rows_that_fit["cpu"]
    assert fitted < 64  # halved at least once, and remembered
    # the next call starts at the size that fitted: no pass runs out of memory again
    refusals = model.refusals
    explainer.explain(images, target=[[1, 2], [0, 3]])
    assert model.refusals == refusals


def test_smoothgrad_draws_the_same_noise_for_a_pass_that_is_run_again(large_passes):
    images = torch.randn(3, 3, 12, 12, dtype=torch.float64)
    unlimited = LimitedMemory(rows=10_000).double().eval()
    limited = LimitedMemory(rows=8).double().eval()
    limited.load_state_dict(unlimited.state_dict())
    expected = explain.SmoothGrad(unlimited, samples=10, seed=3, normalize=None).explain(images, target=0)
    result = explain.SmoothGrad(limited, samples=10, seed=3, normalize=None).explain(images, target=0)
    assert limited.refusals > 0 and limited.largest_batch <= 8
    torch.testing.assert_close(result.attributions, expected.attributions, rtol=1e-12, atol=1e-14)


def test_a_batch_size_the_caller_gave_is_kept_and_its_failure_says_what_to_do():
    model = LimitedMemory(rows=7).eval()
    before = model_state(model)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"batch_size=8 was given: pass a smaller one"):
        explain.IntegratedGradients(model, steps=16, batch_size=8).explain(torch.randn(1, 3, 12, 12), target=0)
    assert model.refusals == 1  # not retried: the caller chose the size
    assert_state_equal(before, model_state(model))


def test_running_out_of_memory_at_one_row_raises_with_the_rows_it_tried(large_passes):
    model = LimitedMemory(rows=0, where="backward").eval()  # the forward at x (no graph) runs
    before = model_state(model)
    explainer = explain.GradientShap(model, torch.randn(2, 3, 12, 12), samples=6)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"at 1 row per pass \(even one row at a time"):
        explainer.explain(torch.randn(1, 3, 12, 12), target=0)
    assert explainer.rows_that_fit == {"cpu": 1}  # 6 rows, then 3, then 1
    assert_state_equal(before, model_state(model))


def test_other_errors_are_raised_at_once(large_passes):
    class Broken(nn.Module):
        calls = 0

        def forward(self, x):
            Broken.calls += 1
            if x.shape[0] > 1:
                raise ValueError("out of range")  # not an allocation failure
            return x.flatten(1)[:, :3]

    with pytest.raises(ModelInputError, match="out of range"):
        explain.IntegratedGradients(Broken(), steps=8).explain(torch.randn(1, 3, 4, 4), target=0)
    assert Broken.calls == 1  # the first pass only (x and the baseline are rows of it)


def test_what_counts_as_running_out_of_memory():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                                         "memory: you tried to allocate 1099511627776 bytes."))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"))
    assert is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
    assert is_out_of_memory(RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"))
    assert is_out_of_memory(RuntimeError("miopenStatusAllocFailed"))
    try:  # a model that wraps the allocator's error in its own
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        except torch.cuda.OutOfMemoryError as error:
            raise KeyError("inference failed in block 3") from error
    except KeyError as wrapped:
        assert is_out_of_memory(wrapped)
    looping = RuntimeError("a chain that loops")
    looping.__cause__ = looping
    assert not is_out_of_memory(looping)
    assert not is_out_of_memory(ValueError("out of memory"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_the_rows_per_pass_are_16_at_224_px_on_the_cpu_more_for_smaller_images_and_256_on_a_gpu():
    """On the CPU a pass holds 16 rows of 3 × 224 × 224 values (or fewer values per row: more rows, up to 64, so that a
    model resizing its input inside holds at most 4× a 224 px pass; more values per row: still 16); on a GPU 256 rows
    whatever their size; a batch_size given is kept everywhere."""
    cpu = torch.device("cpu")
    assert passes.rows_per_pass(None, cpu) == 16
    assert passes.rows_per_pass(None, cpu, 3 * 224 * 224) == 16
    assert passes.rows_per_pass(None, cpu, 3 * 448 * 448) == 16
    assert passes.rows_per_pass(None, cpu, 3 * 112 * 112) == 64
    assert passes.rows_per_pass(None, cpu, 3 * 32 * 32) == 64  # 784 would fit: at most 64
    assert passes.rows_per_pass(None, torch.device("cuda", 0)) == 256
    assert passes.rows_per_pass(None, torch.device("cuda", 0), 3 * 32 * 32) == 256
    assert passes.rows_per_pass(None, torch.device("mps")) == 256
    assert passes.rows_per_pass(5, torch.device("cuda", 0)) == 5
    assert passes.rows_per_pass(5, cpu, 3 * 32 * 32) == 5


def test_integrated_gradients_of_a_small_image_runs_its_32_steps_in_one_pass_on_the_cpu():
    """32 path points of a 32 px image and the image and baseline that choose and score the target: one forward
    and one backward (counted by a forward hook), where 224 px images take two passes of 16 rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()
    rows_per_forward: list[int] = []
    handle = model[0].register_forward_hook(lambda _m, args, _o: rows_per_forward.append(args[0].shape[0]))
    try:
        explain.IntegratedGradients(model, steps=32).explain(torch.rand(1, 3, 32, 32), target=1)
        assert rows_per_forward == [2 + 32]
        rows_per_forward.clear()
        explain.IntegratedGradients(model, steps=32).explain(torch.rand(1, 3, 224, 224), target=1)
        assert rows_per_forward == [2 + 16, 16]
    finally:
        handle.remove()


def test_a_copied_explainer_keeps_the_size_that_fitted(large_passes):
    import copy
    import pickle

    model = LimitedMemory(rows=9).eval()
    explainer = explain.IntegratedGradients(model, steps=32)
    explainer.explain(torch.randn(1, 3, 12, 12), target=0)
    assert explainer.rows_that_fit == {"cpu": 8}
    assert copy.deepcopy(explainer).rows_that_fit == {"cpu": 8}
    state = explainer.__getstate__()
    del state["rows_that_fit"]  # an explainer pickled before the attribute existed
    restored = explain.IntegratedGradients.__new__(explain.IntegratedGradients)
    restored.__setstate__(state)
    assert restored.rows_that_fit == {}
    assert pickle.loads(pickle.dumps(explainer)).rows_that_fit == {"cpu": 8}


def test_running_out_of_memory_in_the_model_is_not_reported_as_a_bad_input():
    model = LimitedMemory(rows=0).eval()
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        explain.Saliency(model).explain(torch.randn(1, 3, 12, 12), target=0)
    assert not isinstance(raised.value, ModelInputError)
    assert "preprocess" not in str(raised.value)  # the bad-input advice would send the user the wrong way


class SharedTable(nn.Module):
    """LimitedMemory's model times the mean of a shared (2, 4) table passed as a keyword argument."""

    def __init__(self, rows: int):
        super().__init__()
        self.inner = LimitedMemory(rows)
        self.tables_seen: set[tuple[float, ...]] = set()

    def forward(self, x, table):
        self.tables_seen.add(tuple(table.mean(0).tolist()))
        return self.inner(x) * table.mean(0)


def test_a_shared_argument_stays_shared_when_a_pass_has_as_many_rows_as_it_has(large_passes):
    """One image and a (2, 4) table for every image: SmoothGrad's passes of 2 noisy copies (after running
    out of memory) must not take the table for per-image tensors of a 2-row batch."""
    table = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, -2.0, 5.0, 7.0]], dtype=torch.float64)
    x = torch.randn(1, 3, 12, 12, dtype=torch.float64)
    results = []
    for rows in (10_000, 3):
        model = SharedTable(rows).double().eval()
        model.inner.load_state_dict(LimitedMemory(10_000).double().state_dict())
        explainer = explain.SmoothGrad(explain.IntegratedGradients(model, steps=4, normalize=None), samples=8,
                                       normalize=None)
        results.append(explainer.explain(x, target=0, forward_kwargs={"table": table}))
        assert model.tables_seen == {(2.0, -0.5, 3.0, 4.0)}
    torch.testing.assert_close(results[1].attributions, results[0].attributions, rtol=1e-10, atol=1e-12)


class RefusesOnce(LimitedMemory):
    """Runs out of memory once, on the first batch of exactly ``rows`` rows."""

    def forward(self, x):
        if x.shape[0] == self.rows and not self.refusals:
            self.refusals += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated, transient)")
        return self.net(x)


def test_a_short_last_pass_that_fails_once_does_not_shrink_later_calls(large_passes):
    model = RefusesOnce(rows=2).eval()
    explainer = explain.IntegratedGradients(model, steps=66)  # passes of 64 rows, then 2
    explainer.explain(torch.randn(1, 3, 12, 12), target=0)
    assert model.refusals == 1
    assert explainer.rows_that_fit == {"cpu": 64}  # the largest pass that fitted, not half of the 2 that failed


def test_xrai_keeps_the_size_that_fitted_for_its_next_call(large_passes):
    model = LimitedMemory(rows=8).eval()
    xrai = explain.XRAI(model, steps=16)
    x = torch.rand(1, 3, 16, 16)
    xrai.explain(x, target=0)
    refusals = model.refusals
    assert refusals > 0 and xrai.rows_that_fit == {"cpu": 8}
    xrai.explain(x, target=0)
    assert model.refusals == refusals


def test_smoothgrad_splits_a_sample_of_many_images_over_passes(large_passes):
    """Eight images on a model that takes four rows at a time: one noisy copy of every image is more
    than a pass can hold, so a pass holds part of a sample; the noise and the result are unchanged."""
    images = torch.randn(8, 3, 12, 12, dtype=torch.float64)
    unlimited = LimitedMemory(rows=10_000).double().eval()
    limited = LimitedMemory(rows=4, where="backward").double().eval()
    limited.load_state_dict(unlimited.state_dict())
    targets = [0, 1, 2, 3, 0, 1, 2, 3]
    expected = explain.SmoothGrad(unlimited, samples=5, seed=1, normalize=None).explain(images, target=targets)
    result = explain.SmoothGrad(limited, samples=5, seed=1, normalize=None).explain(images, target=targets)
    torch.testing.assert_close(result.attributions, expected.attributions, rtol=1e-12, atol=1e-14)
    given = explain.SmoothGrad(unlimited, samples=5, seed=1, normalize=None, batch_size=3).explain(
        images, target=targets)  # passes of 3 rows: samples split everywhere
    torch.testing.assert_close(given.attributions, expected.attributions, rtol=1e-12, atol=1e-14)


def test_a_batch_size_of_one_that_runs_out_of_memory_does_not_ask_for_a_smaller_one():
    model = LimitedMemory(rows=0, where="backward").eval()
    with pytest.raises(torch.cuda.OutOfMemoryError, match="even one row at a time") as raised:
        explain.IntegratedGradients(model, steps=4, batch_size=1).explain(torch.randn(1, 3, 12, 12), target=0)
    assert "pass a smaller one" not in str(raised.value)


class OwnError(RuntimeError):
    """A model's own error type, raised from the allocator's."""


class WrapsItsMemoryErrors(LimitedMemory):
    def forward(self, x):
        try:
            return super().forward(x)
        except torch.cuda.OutOfMemoryError as error:
            raise OwnError("inference failed in block 3") from error


def test_an_out_of_memory_error_the_model_wraps_is_retried_and_not_reported_as_a_bad_input(large_passes):
    unlimited = LimitedMemory(rows=10_000).eval()
    model = WrapsItsMemoryErrors(rows=5).eval()
    model.load_state_dict(unlimited.state_dict())
    x = torch.randn(1, 3, 12, 12)
    result = explain.IntegratedGradients(model, steps=16).explain(x, target=0)
    expected = explain.IntegratedGradients(unlimited, steps=16, batch_size=4).explain(x, target=0)
    torch.testing.assert_close(result.attributions, expected.attributions, rtol=1e-4, atol=1e-6)
    model.rows = 0
    with pytest.raises(OwnError, match="inference failed") as raised:  # the model's type, as it raised it
        explain.Saliency(model).explain(x, target=0)
    assert not isinstance(raised.value, ModelInputError)
