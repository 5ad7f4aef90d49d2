"""Window attention (Swin, Swin v2; timm, torchvision, HuggingFace) laid out on the token grid, and the
class-specific attention methods that read it (TransformerAttribution, LeGrad) against slow computations:

1. where each window token lies on its stage's grid, found without explain's layout code: perturb one grid token at
   the block's input and see which window of the recorded attention changes, and which of its tokens (in the rows of
   the other tokens of that window, log A changes by one constant except in the perturbed token's column);
2. TransformerAttribution on Swin against the rollout written with whole (T, T) matrices: each block's Ā placed
   entry by entry at the positions found in 1, patch merging as an explicit (T', T) matrix, R ← R + Ā·R forwards;
3. LeGrad on Swin against a layer-by-layer computation (later blocks skipped, ∂s_l/∂A_l by autograd, placed on the
   grid by the positions of 1);
4. every family: a batch of three with different targets equals each image alone, the model left as found; grids
   that need padding and shifted windows in every stage; the rollouts keep their error.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import pytest
import torch
from conftest import assert_state_equal, model_state
from test_attnlrp import FAMILIES, HF_SWIN, hf_model
from torch import Tensor, nn

import explain
from explain.core.scope import CallScope
from explain.core.windows import watch_windows

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")


def timm_swin(v2: bool, size: int) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("swinv2_tiny_window8_256" if v2 else "swin_tiny_patch4_window7_224", pretrained=False,
                              num_classes=5, img_size=size, embed_dim=16, depths=(2, 2), num_heads=(2, 2),
                              window_size=4)
    with torch.no_grad():  # Swin v2 starts its post-norms at zero
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1, 0.3)
    return model


def torchvision_swin(v2: bool, size: int) -> nn.Module:
    from torchvision.models import swin_transformer

    torch.manual_seed(0)
    extra = {"block": swin_transformer.SwinTransformerBlockV2,
             "downsample_layer": swin_transformer.PatchMergingV2} if v2 else {}
    model = swin_transformer.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                             window_size=[4, 4], num_classes=5, **extra)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1, 0.3)
    return model


def hf_swin(v2: bool, size: int) -> nn.Module:
    names = ("Swinv2ForImageClassification", "Swinv2Config") if v2 else ("SwinForImageClassification", "SwinConfig")
    return hf_model(*names, **{**HF_SWIN, "image_size": size})


BUILDERS: dict[str, tuple[Callable[[bool, int], nn.Module], bool, str | None]] = {
    "timm-swin": (timm_swin, False, None), "timm-swinv2": (timm_swin, True, None),
    "torchvision-swin": (torchvision_swin, False, None), "torchvision-swinv2": (torchvision_swin, True, None),
    "hf-swin": (hf_swin, False, "logits"), "hf-swinv2": (hf_swin, True, "logits"),
}
# 32 px: 8 × 8 then 4 × 4 tokens, windows of 4, the last stage one window; 40 px: 10 × 10 then 5 × 5 tokens, padded
# to whole windows and shifted in both stages
CASES = [(name, size) for name in BUILDERS for size in (32, 40)]


@functools.lru_cache(maxsize=None)
def built(name: str, size: int) -> nn.Module:
    build, v2, _ = BUILDERS[name]
    return build(v2, size).double().eval()


def images(size: int, count: int = 3) -> Tensor:
    torch.manual_seed(1)
    return torch.randn(count, 3, size, size, dtype=torch.float64)


def recorded_attention(model: nn.Module, x: Tensor):
    """(probabilities per attention call, the partitions explain reads, the window blocks in call order)."""
    with CallScope(model) as scope:
        watch = watch_windows(scope, model)
        with torch.no_grad(), explain.capture_attention(model) as attention:
            model(x)
    return attention.probabilities, watch.partitions(attention.modules), watch


def _perturbed(block: nn.Module, grid: tuple[int, int], token: int):
    """A forward pre-hook adding a random vector (not a constant, which a LayerNorm removes) to one token of the
    block's input: (N, H, W, C) or (N, H·W, C)."""
    def hook(module, args, kwargs):
        tokens = args[0].clone()
        delta = torch.randn(tokens.shape[-1], dtype=tokens.dtype)
        if tokens.dim() == 4:
            tokens[:, token // grid[1], token % grid[1]] += delta
        else:
            tokens[:, token] += delta
        return (tokens, *args[1:]), kwargs

    return block.register_forward_pre_hook(hook, with_kwargs=True)


@functools.lru_cache(maxsize=None)
def positions_by_perturbation(name: str, size: int) -> tuple[tuple[tuple[int, int], Tensor], ...]:
    """Per attention call: (grid, (windows, w²) flat grid index of each window token, −1 where no grid token is),
    found by perturbing each grid token at the block's input in turn."""
    model = built(name, size)
    x = images(size, count=1)
    probabilities, partitions, watch = recorded_attention(model, x)
    found = []
    for call, (plain, partition) in enumerate(zip(probabilities, partitions)):
        assert partition is not None
        grid, block = partition.grid, watch.blocks[partition.block]
        positions = torch.full((plain.shape[0], plain.shape[-1]), -1, dtype=torch.long)
        torch.manual_seed(2)
        for token in range(grid[0] * grid[1]):
            with torch.no_grad():
                handle = _perturbed(block, grid, token)
                try:
                    with explain.capture_attention(model) as attention:
                        model(x)
                finally:
                    handle.remove()
            changed_attention = attention.probabilities[call]
            difference = (changed_attention - plain).abs().flatten(1).amax(dim=1)
            windows = (difference > 1e-12).nonzero().flatten().tolist()
            assert len(windows) == 1, f"{name} call {call}: token {token} changed windows {windows}"
            window = windows[0]
            log_change = (changed_attention[window, 0].log() - plain[window, 0].log())
            finite = torch.isfinite(log_change)
            votes = []
            for row, finite_row in zip(log_change, finite):
                values = row[finite_row]
                if values.numel() < 2:
                    continue
                deviation = (row - values.median()).abs().masked_fill(~finite_row, -1)
                if deviation.max() > 1e-9:
                    votes.append(int(deviation.argmax()))
            column = max(set(votes), key=votes.count)
            assert positions[window, column] == -1, "two grid tokens at one window token"
            positions[window, column] = token
        found.append((grid, positions))
    return tuple(found)


@pytest.mark.parametrize("name,size", CASES)
def test_each_window_token_lies_where_perturbing_the_grid_shows(name, size):
    model = built(name, size)
    probabilities, partitions, _ = recorded_attention(model, images(size, count=1))
    expected = positions_by_perturbation(name, size)
    assert len(partitions) == len(expected) == 4
    for partition, (grid, positions) in zip(partitions, expected):
        assert partition is not None and partition.grid == grid
        assert torch.equal(partition.positions(torch.device("cpu")), positions)
    if size == 40:  # the case that needs padding and shifted windows in both stages
        assert [partition.shift != (0, 0) for partition in partitions] == [False, True, False, True]
        assert all(partition.padded != partition.grid for partition in partitions)


def rollout_with_whole_matrices(model: nn.Module, name: str, size: int, x: Tensor, targets: list[int]) -> Tensor:
    """(N, K, H0, W0): Chefer et al.'s rollout with each block's Ā as a whole (T, T) matrix."""
    explainer = explain.TransformerAttribution(model, normalize=None, output=BUILDERS[name][2])
    with torch.enable_grad():
        recorded = explainer._record(x, targets, None, detach=False)
        gradients, _, _ = explainer._gradients(recorded.selected, recorded.probabilities)
        relevances = explainer._relevances(x, targets, None, recorded)
    layouts = positions_by_perturbation(name, size)
    count, first_grid = x.shape[0], layouts[0][0]
    maps = torch.zeros(count, 1, *first_grid, dtype=torch.float64)
    for n in range(count):
        tokens = first_grid[0] * first_grid[1]
        rolled = torch.eye(tokens, dtype=torch.float64)
        grid = first_grid
        for (block_grid, positions), relevance, gradient in zip(layouts, relevances[0], gradients[0]):
            if block_grid != grid:  # patch merging: each merged token's row is the mean of its 2 × 2 tokens' rows
                merged_grid = (math.ceil(grid[0] / 2), math.ceil(grid[1] / 2))
                merging = torch.zeros(merged_grid[0] * merged_grid[1], grid[0] * grid[1], dtype=torch.float64)
                for y in range(grid[0]):
                    for x_ in range(grid[1]):
                        merging[(y // 2) * merged_grid[1] + x_ // 2, y * grid[1] + x_] = 1.0
                merging = merging / merging.sum(dim=1, keepdim=True)
                assert merged_grid == block_grid
                rolled, grid = merging @ rolled, block_grid
            weighted = (gradient * relevance).clamp(min=0).mean(dim=1)
            windows = positions.shape[0]
            whole = torch.zeros(grid[0] * grid[1], grid[0] * grid[1], dtype=torch.float64)
            for window in range(windows):
                for i, row in enumerate(positions[window].tolist()):
                    for j, column in enumerate(positions[window].tolist()):
                        if row >= 0 and column >= 0:
                            whole[row, column] = weighted[n * windows + window, i, j]
            rolled = rolled + whole @ rolled
        maps[n, 0] = rolled.mean(dim=0).view(*first_grid)
    return maps


@pytest.mark.parametrize("name,size", [("timm-swin", 40), ("torchvision-swinv2", 40), ("hf-swin", 40),
                                       ("hf-swinv2", 32)])
def test_transformer_attribution_equals_the_rollout_with_whole_matrices(name, size):
    model = built(name, size)
    x = images(size)
    targets = [0, 3, 1]
    explanation = explain.TransformerAttribution(model, normalize=None, output=BUILDERS[name][2]).explain(
        x, target=targets)
    maps = explanation.low_res_maps[0]
    expected = rollout_with_whole_matrices(model, name, size, x, targets)
    assert maps.shape == expected.shape == (3, 1, *positions_by_perturbation(name, size)[0][0])
    assert (expected.flatten(1).std(dim=1) > 0).all()  # not a uniform map
    torch.testing.assert_close(maps, expected.to(maps.dtype), rtol=1e-6, atol=1e-12)


def _skip_block(module, args, kwargs, output):
    """A forward hook that makes a block pass its input on unchanged (its attention still recorded)."""
    tokens = args[0] if args else kwargs["hidden_states"]
    return (tokens, *output[1:]) if isinstance(output, tuple) else tokens


def whole_block(model: nn.Module, window_module: str) -> nn.Module:
    """The transformer block around a window module: torchvision's ShiftedWindowAttention is the block's ``attn``."""
    name = window_module.removesuffix(".attn")
    return model.get_submodule(name)


def legrad_with_whole_matrices(model: nn.Module, name: str, size: int, x: Tensor, targets: list[int]) -> Tensor:
    """(N, T) LeGrad over the last stage, layer by layer: blocks after layer l pass their input on, ∂s_l/∂A_l by
    autograd, its positive part averaged over heads, each key token's column summed over the rows (placed on the
    grid by the perturbation positions) and divided by the grid's tokens."""
    layouts = positions_by_perturbation(name, size)
    _, partitions, watch = recorded_attention(model, x[:1])
    last_grid = layouts[-1][0]
    last_stage = [index for index, (grid, _) in enumerate(layouts) if grid == last_grid]
    total = torch.zeros(x.shape[0], last_grid[0] * last_grid[1], dtype=torch.float64)
    output = BUILDERS[name][2]
    for layer in last_stage:
        later = [whole_block(model, partitions[index].block) for index in last_stage if index > layer]
        handles = [block.register_forward_hook(_skip_block, with_kwargs=True) for block in later]
        try:
            with explain.capture_attention(model, detach=False) as attention:
                logits = model(x)
                logits = getattr(logits, output) if output else logits
                scores = logits[torch.arange(len(targets)), torch.tensor(targets)]
            (gradient,) = torch.autograd.grad(scores.sum(), attention.probabilities[layer])
        finally:
            for handle in handles:
                handle.remove()
        positive = gradient.clamp(min=0).mean(dim=1)
        positions = layouts[layer][1]
        windows = positions.shape[0]
        for n in range(x.shape[0]):
            for window in range(windows):
                for j, column in enumerate(positions[window].tolist()):
                    if column >= 0:
                        total[n, column] += positive[n * windows + window, :, j].sum() / total.shape[1]
    return total


@pytest.mark.parametrize("name,size", [("timm-swin", 40), ("torchvision-swin", 40), ("hf-swinv2", 40),
                                       ("timm-swinv2", 32)])
def test_legrad_reads_the_last_stage_and_equals_a_layer_by_layer_computation(name, size):
    model = built(name, size)
    x = images(size)
    targets = [0, 3, 1]
    explanation = explain.LeGrad(model, normalize=None, output=BUILDERS[name][2]).explain(x, target=targets)
    last_grid = positions_by_perturbation(name, size)[-1][0]
    assert len(explanation.diagnostics["attention_blocks"]) == 2  # the last stage's two blocks
    expected = legrad_with_whole_matrices(model, name, size, x, targets).view(3, 1, *last_grid)
    assert (expected.flatten(1).std(dim=1) > 0).all()
    torch.testing.assert_close(explanation.low_res_maps[0], expected.float(), rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("method", [explain.TransformerAttribution, explain.LeGrad])
@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.windows])
def test_every_swin_a_batch_equals_its_images_alone_and_the_model_is_left_as_found(name, method):
    family = FAMILIES[name]
    model = family.model()
    x, targets, alone = family.inputs(model)
    before = model_state(model)
    explainer = method(model, output=family.output, normalize=None)
    together = explainer.explain(x, target=targets).low_res_maps[0]
    assert (together.flatten(1).std(dim=1) > 0).all()
    for i in range(len(x)):
        single = explainer.explain(x[i : i + 1], target=alone(i)).low_res_maps[0]
        torch.testing.assert_close(together[i], single[0], rtol=1e-6, atol=1e-9 * single.abs().amax().item())
    assert_state_equal(before, model_state(model))


def test_swin_t_at_224_px_gets_maps_on_its_first_and_last_grids():
    """torchvision's swin_t (random weights): 56 × 56 tokens in windows of 7 × 7, 7 × 7 in the last stage."""
    model = torchvision.models.swin_t(num_classes=10).eval()
    x = torch.randn(2, 3, 224, 224)
    before = model_state(model)
    rolled = explain.TransformerAttribution(model).explain(x, target=[1, 2])
    assert rolled.low_res_maps[0].shape == (2, 1, 56, 56) and len(rolled.diagnostics["attention_blocks"]) == 12
    legrad = explain.LeGrad(model).explain(x, target=[1, 2])
    assert legrad.low_res_maps[0].shape == (2, 1, 7, 7) and len(legrad.diagnostics["attention_blocks"]) == 2
    assert rolled.maps.shape == legrad.maps.shape and rolled.maps.shape[-2:] == (224, 224)
    assert_state_equal(before, model_state(model))


@pytest.mark.parametrize("method", [explain.AttentionRollout, explain.GradientAttentionRollout])
def test_the_rollouts_keep_their_error_naming_the_methods_that_read_windows(method):
    model = built("timm-swin", 32)
    with pytest.raises(ValueError, match=r"looks like window attention.*TransformerAttribution, AttnLRP or LeGrad"):
        method(model).explain(images(32, count=1))


def test_row_class_on_swin_is_an_error_saying_it_has_no_class_token():
    model = built("hf-swin", 32)
    for method in (explain.TransformerAttribution, explain.LeGrad):
        with pytest.raises(ValueError, match="row='class' needs a class token"):
            method(model, output="logits", row="class").explain(images(32, count=1))
