"""Attacks on explain.metrics with transformers (timm / HuggingFace ViT, Swin, CLIP) built with random weights.

Each test asserts the correct behaviour: a value equal to a hand computation, the model left bit-identical, equal
values in the caller's contexts, or a clear error where no value can be right. Tiny models, CPU, one thread.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import explain
from explain import metrics
from explain.metrics.randomisation import discrete_entropy
from explain.metrics.sanity import default_stages, randomized_copies

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(threads)


def _timm_vit() -> nn.Module:
    torch.manual_seed(123)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             embed_dim=32, num_heads=2, num_classes=5, dynamic_img_size=True).eval()


def _hf_vit(**extra) -> nn.Module:
    torch.manual_seed(123)
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, num_labels=5, **extra)
    return transformers.ViTForImageClassification(config).eval()


def _hf_swin() -> nn.Module:
    torch.manual_seed(123)
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                     window_size=4, num_labels=5)
    return transformers.SwinForImageClassification(config).eval()


def _clip() -> nn.Module:
    torch.manual_seed(123)
    return transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=1000, bos_token_id=0, eos_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8), projection_dim=16)).eval()


def _images(count: int = 2, height: int = 32, width: int = 32) -> torch.Tensor:
    return torch.rand(count, 3, height, width, generator=torch.Generator().manual_seed(0))


def _as_if_trained(model: nn.Module) -> nn.Module:
    """Move every parameter away from its initial value, as training does (LayerNorm weights no longer 1, ...)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


def _state(model: nn.Module):
    return ({name: value.detach().clone() for name, value in model.state_dict(keep_vars=True).items()},
            {name: module.training for name, module in model.named_modules()},
            {name: parameter.requires_grad for name, parameter in model.named_parameters()},
            {name: (len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks))
             for name, module in model.named_modules()})


def _assert_same_state(before, after) -> None:
    assert before[0].keys() == after[0].keys()
    changed = [name for name in before[0] if not torch.equal(before[0][name], after[0][name])]
    assert not changed, f"parameters or buffers changed: {changed}"
    assert before[1:] == after[1:]


# ---------------------------------------------------------------- randomisation re-initialises every parameter


@pytest.mark.parametrize("build, owned_alone", [
    (_timm_vit, ["cls_token", "pos_embed"]),
    (_hf_vit, ["vit.embeddings.cls_token", "vit.embeddings.position_embeddings"]),
    (_hf_swin, ["relative_position_bias_table"]),
])
def test_randomisation_reinitialises_parameters_held_by_no_resettable_module(build, owned_alone):
    """efficient_mprt says it randomises "every layer", smooth_mprt / cascading_randomization the stages below the
    top-level children: a ViT's class token and position embeddings (timm: parameters of the root module itself;
    HuggingFace: of an embeddings module with no reset_parameters) and Swin's relative position bias tables must be
    re-initialised too, or the randomised model still carries what the trained one learned there."""
    model = _as_if_trained(build())
    before = _state(model)
    last = None
    for _, _, randomized in randomized_copies(explain.Saliency(model), _images(1), default_stages(model),
                                              order="bottom_up"):
        last = randomized
    assert last is not None
    trained = dict(model.named_parameters())
    kept = [name for name, parameter in last.model.named_parameters() if torch.equal(parameter, trained[name])]
    assert not kept, f"left as trained after randomising every stage: {kept}"
    assert any(any(part in name for part in owned_alone) for name in trained)
    _assert_same_state(before, _state(model))  # the copy was randomised, not the model


def test_randomisation_of_clip_reinitialises_class_embedding_and_logit_scale():
    clip = _clip()
    prompts = torch.randint(2, 1000, (3, 7), generator=torch.Generator().manual_seed(1))

    class ImageTextLogits(nn.Module):
        def __init__(self):
            super().__init__()
            self.clip = clip
            self.register_buffer("prompts", prompts)

        def forward(self, pixels):
            return self.clip(pixel_values=pixels, input_ids=self.prompts).logits_per_image

    model = _as_if_trained(ImageTextLogits().eval())
    for _, _, randomized in randomized_copies(explain.Saliency(model), _images(1), default_stages(model)):
        last = randomized
    trained = dict(model.named_parameters())
    kept = [name for name, parameter in last.model.named_parameters() if torch.equal(parameter, trained[name])]
    assert not kept, f"left as trained after randomising every stage: {kept}"


# ---------------------------------------------------------------- eMPRT of a constant map


class _EvenLinear(nn.Module):
    """A linear classifier whose first class weighs every input value alike: its saliency map is constant."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(3, 3 * 8 * 8, generator=torch.Generator().manual_seed(0)))
            self.fc.weight[0] = 0.5

    def forward(self, x):
        return self.fc(x.flatten(1))


def test_efficient_mprt_of_a_constant_trained_map_is_not_minus_infinity():
    """A constant trained map has entropy 0; its randomised map does not. The docstring says the rise is then "inf
    (NaN)"; "higher is better", so -inf ranks the method worst for the trained model's best-case map. The entropy of
    a constant map comes out as -0.0 (discrete_entropy negates a zero sum), and x / -0.0 = -inf."""
    model = _EvenLinear().eval()
    x = _images(2, 8, 8)
    result = metrics.efficient_mprt(explain.Saliency(model), x, target=[0, 0])
    assert torch.equal(result.entropy, torch.zeros(2, dtype=result.entropy.dtype))
    assert (result.randomized_entropy > 0).all()
    assert not torch.isneginf(result.rise).any(), f"rise {result.rise.tolist()}"
    assert not torch.signbit(result.entropy).any(), "the entropy of a constant map is -0.0"
    assert bool(((result.rise == float("inf")) | result.rise.isnan()).all())
    assert not torch.signbit(discrete_entropy(torch.zeros(1, 4, 4))).any()


# ---------------------------------------------------------------- CLIP, explained as the docs say (forward_kwargs)


def _clip_call():
    clip = _clip()
    prompts = torch.randint(2, 1000, (3, 7), generator=torch.Generator().manual_seed(1))
    options = {"forward_kwargs": {"input_ids": prompts}, "input_position": "pixel_values", "per_image": []}
    return clip, explain.Saliency(clip, output="logits_per_image"), options


def test_random_logit_on_clip_takes_the_prompts_of_explain_options():
    """max_sensitivity, continuity and the local Lipschitz estimate accept CLIP's prompts in explain_options; the
    random logit test runs a bare model(batch) to count the classes and fails inside transformers
    ('NoneType' object has no attribute 'shape')."""
    clip, explainer, options = _clip_call()
    x = _images(2)
    result = metrics.random_logit(explainer, x, target=[0, 2], other_classes=[1, 0], explain_options=options)
    first = explainer.explain(x, [0, 2], **options).raw_map_grid[:, 0]
    second = explainer.explain(x, [1, 0], **options).raw_map_grid[:, 0]

    def scaled(maps):
        magnitude = maps.abs()
        return magnitude / magnitude.flatten(1).amax(dim=1).view(-1, 1, 1)
    expected = metrics.ssim(scaled(first), scaled(second))
    torch.testing.assert_close(result.similarity, expected, atol=1e-5, rtol=1e-4)


def test_input_invariance_and_empirt_on_clip_take_the_prompts_of_explain_options():
    clip, explainer, options = _clip_call()
    x = _images(2)
    before = _state(clip)
    invariance = metrics.input_invariance(explainer, x, target=[0, 2], explain_options=options)
    assert invariance.invariant.tolist() == [1.0, 1.0]  # gradients are invariant (the docstring)
    reference = explainer.explain(x, [0, 2], **options).raw_map_grid[:, 0]
    mprt = metrics.efficient_mprt(explainer, x, target=[0, 2], explain_options=options)
    torch.testing.assert_close(mprt.entropy, discrete_entropy(reference, 100))
    _assert_same_state(before, _state(clip))


# ---------------------------------------------------------------- an explanation of another model or method


def test_robustness_and_randomisation_refuse_an_explanation_made_by_another_model():
    """explanation= is documented as "the images' explanation by this explainer": one made on another model (or by
    another method) is taken silently, and the metric compares this explainer's maps of noisy copies with the other
    model's map. Explanation.scores (and .method) tell them apart."""
    model, other = _hf_vit(), _hf_vit()
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.5)
    x = _images(2)
    explainer = explain.Saliency(model)
    foreign = explain.Saliency(other).explain(x)
    with pytest.raises(ValueError):
        metrics.max_sensitivity(explainer, x, samples=2, explanation=foreign)
    with pytest.raises(ValueError):
        metrics.efficient_mprt(explainer, x, explanation=foreign)
    with pytest.raises(ValueError):
        metrics.random_logit(explainer, x, explanation=explain.GradCAM(model).explain(x))


# ---------------------------------------------------------------- clear errors


def test_input_invariance_under_bf16_autocast_does_not_blame_an_affine_layer():
    """Under torch.autocast(bfloat16) the shifted copy's scores differ by bf16 rounding, and input_invariance says
    "that layer is not affine in its input. Name the model's first affine layer" of a convolution that is affine:
    the advice leads nowhere. It should say the autocast is the cause (or compare within bf16's precision)."""
    model = _timm_vit()
    x = _images(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            result = metrics.input_invariance(explain.Saliency(model), x)
        except ValueError as error:
            assert "autocast" in str(error) or "bfloat16" in str(error), str(error)
        else:
            assert torch.isfinite(result.difference).all()


def test_evaluate_with_class_names_as_labels_says_labels_must_be_indices():
    model = _hf_vit()
    with pytest.raises((ValueError, TypeError), match="(?i)label"):
        explain.evaluate(model, {"saliency": explain.Saliency(model)}, (_images(2), ["LABEL_1", "LABEL_2"]),
                         metrics=["deletion"], progress=False)


# ---------------------------------------------------------------- what held: guards


def test_deletion_on_hf_vit_equals_a_hand_computed_curve():
    model = _hf_vit()
    x = _images(2)
    maps = torch.rand(2, 32, 32, generator=torch.Generator().manual_seed(5))
    steps, pixels = 4, 32 * 32
    curve = metrics.deletion(model, x, maps, target=[1, 3], steps=steps)
    rows = []
    with torch.no_grad():
        for n, cls in enumerate([1, 3]):
            order = torch.argsort(-maps[n].flatten())
            row = []
            for step in range(steps + 1):
                image = x[n].clone().reshape(3, -1)
                image[:, order[: round(step * pixels / steps)]] = 0
                row.append(model(image.reshape(1, 3, 32, 32)).logits.softmax(-1)[0, cls].item())
            rows.append(row)
    hand = torch.tensor(rows)
    torch.testing.assert_close(curve.curves, hand, atol=1e-6, rtol=1e-5)
    area = ((hand[:, 1:] + hand[:, :-1]) / 2).mean(dim=1)
    torch.testing.assert_close(curve.area, area, atol=1e-6, rtol=1e-5)


def test_sparseness_and_complexity_equal_their_formulas_on_a_transformer_map():
    maps = explain.AttnLRP(_timm_vit()).explain(_images(2)).map_grid[:, 0]
    values = maps.abs().flatten(1).double()
    count = values.shape[1]
    ordered = values.sort(dim=1).values
    k = torch.arange(1, count + 1, dtype=torch.float64)
    gini = ((2 * k - count - 1) * ordered).sum(1) / (count * ordered.sum(1))
    shares = values / values.sum(1, keepdim=True)
    entropy = -torch.where(shares > 0, shares * shares.clamp_min(1e-300).log(), 0.0).sum(1)
    torch.testing.assert_close(metrics.sparseness(maps).double(), gini, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(metrics.complexity(maps).double(), entropy, atol=1e-5, rtol=1e-5)


def test_explainer_metrics_are_equal_under_no_grad_and_inference_mode_on_swin():
    model = _hf_swin()
    x = _images(2)
    explainer = explain.LeGrad(model)
    before = _state(model)

    def values():
        return torch.cat([
            metrics.max_sensitivity(explainer, x, samples=3, generator=torch.Generator().manual_seed(3)),
            metrics.random_logit(explainer, x).similarity,
            metrics.efficient_mprt(explainer, x).rise,
            metrics.input_invariance(explainer, x).difference,
        ])
    plain = values()
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            torch.testing.assert_close(values(), plain, equal_nan=True)
    _assert_same_state(before, _state(model))


def test_evaluate_leaves_a_training_vit_with_frozen_embeddings_bit_identical():
    model = _hf_vit(hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    model.train()
    model.vit.embeddings.eval()
    for parameter in model.vit.embeddings.parameters():
        parameter.requires_grad_(False)
    before = _state(model)
    chosen = ["deletion", "efficient_mprt", "cascading_randomization", "input_invariance", "random_logit"]
    runs = [explain.evaluate(model, {"gradcam": explain.GradCAM(model)}, (_images(2), torch.tensor([1, 2])),
                             metrics=chosen, progress=False).values["gradcam"] for _ in range(2)]
    for name in chosen:  # dropout is off in the metrics' passes: the same values twice
        torch.testing.assert_close(runs[0][name], runs[1][name], equal_nan=True)
    _assert_same_state(before, _state(model))
