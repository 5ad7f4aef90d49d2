"""GenerationExplainer on tiny random-weight vision-language models of every family it supports.

Specifications checked against computations that share no code with explain.vlm:
- input × gradient per image token = a forward hook on the image features (the projector's output), autograd of
  the token's log-probability, the features' rows matched to the sequence's image tokens by their values;
- the layout: a model whose tokens each see only their own pixels, with every token that sees the right half of the
  image blanked before the language model, gives zero relevance on the right half (and some on the left);
- generation under explain = plain greedy ``model.generate``;
- gradient-weighted attention = the formula on the attention probabilities of an eager-attention copy of the model.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import vlm_tiny
import vlm_tiny_more
from PIL import Image
from test_attnlrp import lxt_efficient, restored  # noqa: F401  (a fixture and its helper)
from torch import Tensor, nn

from explain import GenerationExplainer
from explain.vlm.generation import PreparedPrompt

Builder = Callable[..., tuple[nn.Module, Any]]
FAMILIES: dict[str, Builder] = {
    "llava": vlm_tiny.tiny_llava,
    "llava_next": vlm_tiny.tiny_llava_next,
    "paligemma": vlm_tiny.tiny_paligemma,
    "qwen2_vl": vlm_tiny_more.tiny_qwen2_vl,
    "qwen2_5_vl": vlm_tiny_more.tiny_qwen2_5_vl,
    "idefics3": vlm_tiny_more.tiny_idefics3,
    "smolvlm": vlm_tiny_more.tiny_smolvlm,
}
IMAGE_FEATURES = {  # the module whose output is the image tokens' embeddings (up to order and scale)
    "llava": "multi_modal_projector", "llava_next": "multi_modal_projector", "paligemma": "multi_modal_projector",
    "qwen2_vl": "visual.merger", "qwen2_5_vl": "visual.merger", "idefics3": "connector", "smolvlm": "connector",
}
SIZES = [(80, 100), (100, 72), (74, 122)]
"""Images large enough that every family gives several token columns on each side of the middle."""
PROMPT = "what is it?"


def random_image(height: int, width: int, seed: int = 0) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3)).astype(np.uint8)
    return Image.fromarray(pixels)


def module_named(model: nn.Module, suffix: str) -> nn.Module:
    matches = [module for name, module in model.named_modules() if name == suffix or name.endswith("." + suffix)]
    assert len(matches) == 1, f"{suffix}: {len(matches)} modules"
    return matches[0]


def full_inputs(explainer: GenerationExplainer, prepared: PreparedPrompt, ids: Tensor) -> dict[str, Any]:
    return explainer._teacher_forced_inputs(prepared, ids)


def language_model_inputs(model: nn.Module, inputs: dict[str, Any]) -> Tensor:
    """(T, d) the embeddings the language model receives, by a pre-hook of this test."""
    return vlm_tiny.language_model_embeddings(model, inputs)[0]


def by_hand_input_x_gradient(family: str, model: nn.Module, inputs: dict[str, Any], prompt_length: int, ids: Tensor,
                             image_token: int) -> Tensor:
    """(K, I) Σ_d f·∂log p/∂f per answer token and image token, from a forward hook on the image features."""
    features: dict[str, Tensor] = {}

    def leaf(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        features["f"] = output.detach().requires_grad_(True)
        return features["f"]

    handle = module_named(model, IMAGE_FEATURES[family]).register_forward_hook(leaf)
    try:
        with torch.enable_grad():
            logits = model(**inputs, use_cache=False).logits[0].float()
    finally:
        handle.remove()
    flat = features["f"].reshape(-1, features["f"].shape[-1])
    sequence = language_model_inputs(model, inputs)
    image_rows = sequence[inputs["input_ids"][0] == image_token]  # (I, d)
    cosine = F.normalize(image_rows.double(), dim=-1) @ F.normalize(flat.detach().double(), dim=-1).T  # (I, rows)
    best, match = cosine.max(dim=1)
    relevance = torch.full((ids.numel(), image_rows.shape[0]), float("nan"), dtype=torch.float64)
    for k in range(ids.numel()):
        log_probability = F.log_softmax(logits[prompt_length - 1 + k], dim=-1)[ids[k]]
        (gradient,) = torch.autograd.grad(log_probability, features["f"], retain_graph=True)
        per_row = (features["f"].detach() * gradient).reshape(-1, flat.shape[-1]).sum(dim=-1).double()
        relevance[k] = torch.where(best > 1 - 1e-6, per_row[match], torch.full_like(best, float("nan")))
    return relevance


@pytest.mark.parametrize("family", list(FAMILIES))
def test_input_x_gradient_equals_a_hook_on_the_image_features(family: str) -> None:
    model, processor = FAMILIES[family]()
    explainer = GenerationExplainer(model, processor)
    image = random_image(40, 50)
    explanation = explainer.explain(image, PROMPT, answer="a cat.")
    ids = explanation.diagnostics["token_ids"][0]
    prepared = explainer.prepare(image, PROMPT)
    expected = by_hand_input_x_gradient(family, model, full_inputs(explainer, prepared, ids), prepared.prompt_length,
                                        ids, explainer.image_token)
    ours = explanation.diagnostics["image_token_relevance"][0].double()
    matched = ~torch.isnan(expected[0])
    assert matched.sum() >= 0.8 * matched.numel(), "most image tokens are copies of image features"
    scale = expected[:, matched].abs().max()
    assert scale > 0
    torch.testing.assert_close(ours[:, matched], expected[:, matched], rtol=1e-4, atol=1e-5 * float(scale))
    assert explanation.maps.shape[:2] == (1, ids.numel())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("size", SIZES)
def test_only_the_left_half_reaching_the_model_leaves_the_right_half_without_relevance(
        family: str, size: tuple[int, int]) -> None:
    model, processor = FAMILIES[family](token_local=True)
    explainer = GenerationExplainer(model, processor)
    height, width = size
    image = random_image(height, width, seed=1)
    changed = np.asarray(image).copy()
    changed[:, width // 2:] = 255 - changed[:, width // 2:]
    prepared = explainer.prepare(image, PROMPT)
    image_positions = prepared.inputs["input_ids"][0] == explainer.image_token
    before = language_model_inputs(model, prepared.inputs)[image_positions]
    after = language_model_inputs(model, explainer.prepare(Image.fromarray(changed), PROMPT).inputs)[image_positions]
    sees_right = (before - after).abs().amax(dim=1) > 1e-6  # found by perturbation, not by explain's layout
    assert sees_right.any() and not sees_right.all()
    blanked = torch.nonzero(image_positions).squeeze(1)[sees_right]

    def right_half_never_arrives(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        embeddings = kwargs["inputs_embeds"].clone()
        embeddings[:, blanked] = 0.0
        return args, {**kwargs, "inputs_embeds": embeddings}

    handle = model.get_decoder().register_forward_pre_hook(right_half_never_arrives, with_kwargs=True)
    try:
        explanation = explainer.explain(image, PROMPT, answer="a cat.")
    finally:
        handle.remove()
    maps = explanation.raw_maps[0]
    assert maps.shape[-2:] == (height, width)
    assert float(maps[..., width - width // 2:].abs().max()) == 0.0
    assert float(maps[..., : width // 2].abs().amax(dim=(-2, -1)).min()) > 0.0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_under_explain_gives_the_plain_greedy_tokens(family: str) -> None:
    model, processor = FAMILIES[family]()
    explainer = GenerationExplainer(model, processor)
    image = random_image(37, 61, seed=2)
    explanation = explainer.explain(image, PROMPT, max_new_tokens=6)
    prepared = explainer.prepare(image, PROMPT)
    with torch.no_grad():
        plain = model.generate(**prepared.inputs, max_new_tokens=6, do_sample=False)[0, prepared.prompt_length:]
    assert torch.equal(explanation.diagnostics["token_ids"][0], plain)
    answer = processor.tokenizer.decode(plain.tolist(), skip_special_tokens=True)
    assert explanation.diagnostics["answer"] == [answer]
    assert "".join(explanation.class_names) == answer  # a target per token the decoded answer shows (issue 39)
    shown = [k for k in range(plain.numel()) if processor.tokenizer.decode([int(plain[k])], skip_special_tokens=True)]
    assert explanation.class_names == [explainer.token_texts(plain)[k] for k in shown]


def test_a_span_is_the_sum_of_its_tokens() -> None:
    model, processor = vlm_tiny.tiny_llava()
    explainer = GenerationExplainer(model, processor)
    image = random_image(40, 50)
    tokens = explainer.explain(image, PROMPT, answer="a cat sat")
    spans = explainer.explain(image, PROMPT, answer="a cat sat", spans=["cat", (0, 9), "t s"])
    assert spans.class_names == ["cat", "a cat sat", "t s"]
    relevance = tokens.diagnostics["image_token_relevance"][0]
    for k, positions in enumerate([[2, 3, 4], list(range(9)), [4, 5, 6]]):
        torch.testing.assert_close(spans.diagnostics["image_token_relevance"][0, k], relevance[positions].sum(0),
                                   rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(spans.scores[0, k], tokens.scores[0, positions].sum(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(spans.raw_maps[0, k], tokens.raw_maps[0, positions].sum(0), rtol=1e-4, atol=1e-7)


def test_gradient_weighted_attention_equals_the_formula_on_eager_attention() -> None:
    model, processor = vlm_tiny.tiny_llava()
    eager, _ = vlm_tiny.tiny_llava()
    eager.set_attn_implementation("eager")
    explainer = GenerationExplainer(model, processor, method="attention")
    image = random_image(40, 50)
    explanation = explainer.explain(image, PROMPT, answer="a cat.")
    ids = explanation.diagnostics["token_ids"][0]
    prepared = explainer.prepare(image, PROMPT)
    inputs = full_inputs(explainer, prepared, ids)
    image_positions = torch.nonzero(inputs["input_ids"][0] == explainer.image_token).squeeze(1)
    with torch.enable_grad():
        output = eager(**inputs, use_cache=False, output_attentions=True)
        attentions = output.attentions  # the language model's layers, (1, heads, T, T) each
        assert len(attentions) == eager.config.text_config.num_hidden_layers
        for k in range(ids.numel()):
            row = prepared.prompt_length - 1 + k
            log_probability = F.log_softmax(output.logits[0, row].float(), dim=-1)[ids[k]]
            grads = torch.autograd.grad(log_probability, attentions, retain_graph=True)
            per_layer = [(a[0, :, row, image_positions] * g[0, :, row, image_positions]).clamp(min=0).mean(dim=0)
                         for a, g in zip(attentions, grads)]
            expected = torch.stack(per_layer).mean(dim=0)
            torch.testing.assert_close(explanation.diagnostics["image_token_relevance"][0, k], expected.detach(),
                                       rtol=1e-4, atol=1e-8)


def test_attnlrp_through_the_language_model_equals_lxt(lxt_efficient: Any) -> None:  # noqa: F811
    """AttnLRP at the image tokens = lxt 2.x (the authors' library) on the same LLaVA's Llama: its patches of the
    gated MLP (identity rule on SiLU, uniform rule on the product), RMSNorm (divisor held constant) and attention
    (query and key gradients ÷ 4, value ÷ 2), frozen parameters, embeddings × their gradient of the token's logit."""
    model, processor = vlm_tiny.tiny_llava()
    model = model.double()
    explainer = GenerationExplainer(model, processor, method="attnlrp")
    image = random_image(40, 50)
    explanation = explainer.explain(image, PROMPT, answer="a cat.")
    ids = explanation.diagnostics["token_ids"][0]
    prepared = explainer.prepare(image, PROMPT)
    inputs = full_inputs(explainer, prepared, ids)
    image_positions = inputs["input_ids"][0] == explainer.image_token

    patches = lxt_efficient("patches")
    from transformers.models.llama import modeling_llama

    reference_model, _ = vlm_tiny.tiny_llava()
    reference_model = reference_model.double()
    reference_model.set_attn_implementation("eager")
    for parameter in reference_model.parameters():
        parameter.requires_grad_(False)
    leaf: dict[str, Tensor] = {}

    def embeddings_leaf(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaf["e"] = kwargs["inputs_embeds"].detach().requires_grad_(True)
        return args, {**kwargs, "inputs_embeds": leaf["e"]}

    with restored(*[(cls, name) for cls in (modeling_llama.LlamaMLP, modeling_llama.LlamaRMSNorm)
                    for name in ("forward", "original_forward")], (modeling_llama, "eager_attention_forward")):
        patches.patch_method(patches.gated_mlp_forward, modeling_llama.LlamaMLP)
        patches.patch_method(patches.rms_norm_forward, modeling_llama.LlamaRMSNorm)
        modeling_llama.eager_attention_forward = patches.wrap_attention_forward(modeling_llama.eager_attention_forward)
        handle = reference_model.get_decoder().register_forward_pre_hook(embeddings_leaf, with_kwargs=True)
        try:
            expected = []
            for k in range(ids.numel()):
                with torch.enable_grad():
                    logits = reference_model(**inputs, use_cache=False).logits[0, prepared.prompt_length - 1 + k]
                    (gradient,) = torch.autograd.grad(logits[ids[k]], leaf["e"])
                expected.append((leaf["e"].detach() * gradient)[0, image_positions].sum(dim=-1))
        finally:
            handle.remove()
    ours = explanation.diagnostics["image_token_relevance"][0].double()
    reference = torch.stack(expected)
    error = float((ours - reference).norm() / reference.norm())
    assert error <= 1e-6, f"relative error {error:.3g}"  # measured 6e-8: lxt computes its RMSNorm in float32
