"""Session 9: lining each per-token map of ``GenerationExplainer`` up with the answer token it explains, and hostile
uses of the per-token maps (tiny random-weight models, nothing downloaded).

Each test states the correct behaviour; those marked "bug" failed on the code they were written against:

1. (bug) where tokens of the answer are not explained (SmolVLM / Idefics3's ``<row_i_col_j>``, end of sequence),
   map k is not ``token_ids[k]``: the result said nothing of which token each map is, so a user reading
   ``maps[0, k]`` beside ``diagnostics["token_ids"][0, k]`` got another token's map, and the figure captioned map k
   with answer position k. Expected: ``diagnostics["target_positions"]`` / ``"target_token_ids"`` /
   ``"target_tokens"`` say which token each map is, checked here against the gradient, worked by hand, of that
   position's log-probability; the figure's captions give those positions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
import vlm_tiny  # noqa: E402
import vlm_tiny_more  # noqa: E402

from explain import GenerationExplainer  # noqa: E402
from explain.vlm import token_figure  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]

PROMPT = "what is it?"


def random_image(height: int = 40, width: int = 50, seed: int = 0) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3)).astype(np.uint8)
    return Image.fromarray(pixels)


def input_x_gradient_by_hand(model: nn.Module, processor: Any, image: Image.Image, prompt: str, answer: Tensor,
                             position: int) -> Tensor:
    """(image tokens,) Σ_d e_{i,d} ∂ log p(answer[position] | prompt, answer[:position]) / ∂e_{i,d}, worked apart
    from the explainer: the chat-templated prompt through the processor, the answer appended, the language model's
    input embeddings read by ``vlm_tiny.language_model_embeddings``, then the decoder and the head run on them."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = dict(processor(images=[image], text=[text], return_tensors="pt"))
    prompt_length = inputs["input_ids"].shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], answer[None]], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    embeddings = vlm_tiny.language_model_embeddings(model, inputs).requires_grad_(True)
    with torch.enable_grad():
        hidden = model.get_decoder()(inputs_embeds=embeddings, attention_mask=inputs["attention_mask"],
                                     use_cache=False).last_hidden_state
        log_probabilities = F.log_softmax(model.lm_head(hidden)[0].float(), dim=-1)
        score = log_probabilities[prompt_length - 1 + position, answer[position]]
        (gradient,) = torch.autograd.grad(score, embeddings)
    image_positions = inputs["input_ids"][0] == model.config.image_token_id
    return (embeddings[0, image_positions] * gradient[0, image_positions]).sum(dim=-1).detach()


# ------------------------------------------------------------------ 1: which token each map is


def test_smolvlm_each_map_names_the_token_whose_log_probability_it_differentiates() -> None:
    """Bug: the tiny SmolVLM (seed 2) answers ``<row_6_col_2> <row_4_col_2> A <row_1_col_3> <row_5_col_2> d``;
    two maps, of "A" (answer position 2) and "d" (5). Map k's image-token relevance is the gradient × input, by
    hand, of the log-probability at ``target_positions[k]``, and not at position k (the drift); its token id and
    text are that position's; the figure captions the maps "2: A" and "5: d"."""
    from explain.vlm import token_positions

    model, processor = vlm_tiny_more.tiny_smolvlm(seed=2)
    image = random_image()
    explanation = GenerationExplainer(model, processor).explain(image, PROMPT, max_new_tokens=6)
    ids = explanation.diagnostics["token_ids"][0]
    tokens = processor.tokenizer.convert_ids_to_tokens(ids.tolist())
    shown = [k for k, token in enumerate(tokens) if not token.startswith("<")]
    assert shown != list(range(len(shown))), f"the premise: a hidden token before a shown one, {tokens}"

    positions = explanation.diagnostics["target_positions"]
    assert positions.tolist() == [shown] == [token_positions(explanation)]
    assert explanation.diagnostics["target_token_ids"].tolist() == [ids[shown].tolist()]
    assert explanation.diagnostics["target_tokens"].tolist() == [[[t == k for t in range(len(ids))] for k in shown]]
    assert explanation.class_names == [tokens[k] for k in shown]
    relevance = explanation.diagnostics["image_token_relevance"][0]
    for k, position in enumerate(shown):
        expected = input_x_gradient_by_hand(model, processor, image, PROMPT, ids, position)
        scale = float(expected.abs().max())
        torch.testing.assert_close(relevance[k], expected, rtol=1e-4, atol=1e-5 * scale)
        drifted = input_x_gradient_by_hand(model, processor, image, PROMPT, ids, k)  # the token k misreading
        assert float((relevance[k] - drifted).abs().max()) > 0.1 * scale

    figure = token_figure(explanation, show_image=False)
    captions = [text.get_text() for text in figure.axes[0].texts]
    assert [caption.split("\n")[0] for caption in captions] == [f"{k}: {tokens[k]}" for k in shown]
    # the titles of explain.figure / save name the answer position too (they said "(k)", the map's number)
    assert [explanation.title(0, k).split(":")[0] for k in range(len(shown))] == \
        [f"{tokens[k]} (token {k})" for k in shown]


def test_idefics3_spans_record_every_token_they_sum_over() -> None:
    """A text span across a hidden ``<row_3_col_3>`` sums the tokens on either side: ``target_tokens`` marks those
    two, ``target_positions`` the first; a (start, end) span of tokens marks the explained ones in it."""
    model, processor = vlm_tiny_more.tiny_idefics3(seed=0)
    tokenizer = processor.tokenizer
    explainer = GenerationExplainer(model, processor)
    image = random_image()
    ids = explainer.explain(image, PROMPT, max_new_tokens=6).diagnostics["token_ids"][0].tolist()
    where = ids.index(tokenizer.convert_tokens_to_ids("<row_3_col_3>"))  # the premise (tests/test_issue39_vlm.py)
    around = tokenizer.decode(ids[where - 1:where + 2], skip_special_tokens=True)
    spans = explainer.explain(image, PROMPT, max_new_tokens=6, spans=[around, (where, len(ids))])
    marked = [[t for t in range(len(ids)) if spans.diagnostics["target_tokens"][0, k, t]] for k in range(2)]
    hidden = explainer.hidden_tokens(torch.tensor(ids))
    assert marked == [[where - 1, where + 1], [t for t in range(where, len(ids)) if not hidden[t]]]
    assert spans.diagnostics["target_positions"].tolist() == [[where - 1, where + 1]]
    assert spans.diagnostics["target_token_ids"].tolist() == [[ids[where - 1], ids[where + 1]]]


def test_the_token_page_and_an_explanation_of_one_image_keep_the_positions(tmp_path: Path) -> None:
    """The hover page's data give each token's answer position beside its map; ``explanation[0]`` keeps them; with
    ``skip_special_tokens=False`` every token is explained, map k being token k."""
    from explain.vlm import write_token_html
    from explain.vlm.view import token_html

    model, processor = vlm_tiny_more.tiny_smolvlm(seed=2)
    explainer = GenerationExplainer(model, processor)
    explanation = explainer.explain(random_image(), PROMPT, max_new_tokens=6)
    positions = explanation.diagnostics["target_positions"][0].tolist()
    page = token_html(explanation)
    data = json.loads(page.split('<script type="application/json" id="token-data">')[1].split("</script>")[0])
    assert [token["position"] for token in data["tokens"]] == positions and len(data["maps"]) == len(positions)
    write_token_html(explanation[0], tmp_path / "page.html")
    assert explanation[0].diagnostics["target_positions"].tolist() == [positions]
    everything = explainer.explain(random_image(), PROMPT, max_new_tokens=6, skip_special_tokens=False)
    count = everything.diagnostics["token_ids"].shape[1]
    assert everything.diagnostics["target_positions"].tolist() == [list(range(count))]
    assert torch.equal(everything.diagnostics["target_token_ids"], everything.diagnostics["token_ids"])


# ------------------------------------------------------------------ hostile uses


@pytest.mark.parametrize("image", [np.zeros((0, 0, 3), np.uint8), np.zeros((0, 5, 3), np.uint8),
                                   np.zeros((4, 0, 3), np.float32), torch.zeros(3, 0, 4), Image.new("RGB", (0, 0))],
                         ids=["0x0 array", "0x5 array", "4x0 float array", "3x0x4 tensor", "0x0 PIL"])
def test_an_empty_image_is_refused_clearly(image: Any) -> None:
    """Bug: an image with no pixels crashed with "ZeroDivisionError: division by zero" (or torch's "min(): Expected
    reduction dim", numpy's "zero-size array to reduction operation"). Expected: a ValueError saying it is empty."""
    model, processor = vlm_tiny.tiny_llava()
    with pytest.raises(ValueError, match="the image is empty"):
        GenerationExplainer(model, processor).explain(image, PROMPT, max_new_tokens=2)


@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp"])
def test_a_model_whose_config_asks_for_tuples_gets_the_same_maps(method: str) -> None:
    """Bug: a SmolVLM with ``config.return_dict = False`` (its forward then returns a tuple; its ``generate`` still
    works) crashed with "'tuple' object has no attribute 'logits'". Expected: the maps it gets with the default
    config, and the config left as found."""
    model, processor = vlm_tiny_more.tiny_smolvlm(seed=2)
    explainer = GenerationExplainer(model, processor, method=method)
    expected = explainer.explain(random_image(), PROMPT, max_new_tokens=4)
    model.config.return_dict = False
    explanation = explainer.explain(random_image(), PROMPT, max_new_tokens=4)
    assert model.config.return_dict is False
    assert torch.equal(explanation.diagnostics["token_ids"], expected.diagnostics["token_ids"])
    torch.testing.assert_close(explanation.raw_maps, expected.raw_maps, rtol=0, atol=0)


def test_an_answer_of_only_hidden_tokens_is_refused_clearly() -> None:
    """(holds) A model that ends its answer at once (its end-of-sequence row made the largest) has no token to
    explain: a ValueError saying so and how to go on, not an empty explanation; a given answer is explained."""
    model, processor = vlm_tiny.tiny_llava()
    explainer = GenerationExplainer(model, processor)
    first = int(explainer.explain(random_image(), PROMPT, max_new_tokens=1).diagnostics["token_ids"][0, 0])
    eos = processor.tokenizer.eos_token_id
    with torch.no_grad():
        model.lm_head.weight[eos] = 3.0 * model.lm_head.weight[first]
    with pytest.raises(ValueError, match="no token to explain.*give an answer text"):
        explainer.explain(random_image(), PROMPT, max_new_tokens=3)
    given = explainer.explain(random_image(), PROMPT, answer="ab")
    assert given.class_names == ["a", "b"] and given.diagnostics["target_positions"].tolist() == [[0, 1]]


def model_state(model: nn.Module) -> tuple[Any, ...]:
    """What explain must leave as found: modes, gradient flags and gradients, hooks, configs, weights."""
    modules = list(model.named_modules())
    hooks = [(name, len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks),
              len(module._backward_pre_hooks)) for name, module in modules]
    return (hooks, [(name, module.training) for name, module in modules],
            [(name, parameter.requires_grad, parameter.grad is None) for name, parameter in model.named_parameters()],
            model.config.to_json_string(), model.generation_config.to_json_string(),
            [(name, value.clone()) for name, value in model.state_dict().items()])


@pytest.mark.parametrize("method", ["input_x_gradient", "attention", "attnlrp"])
def test_no_grad_and_inference_mode_give_the_same_maps_and_leave_model_and_grad_mode_as_found(method: str) -> None:
    """(holds) A SmolVLM half frozen, in training mode: explained inside ``torch.no_grad()`` and
    ``torch.inference_mode()`` it gets the maps it gets outside them, and the model, the grad mode and the inference
    mode are as found after each call (compared after one call, as transformers adds its own hooks on the first)."""
    model, processor = vlm_tiny_more.tiny_smolvlm(seed=2)
    model.train()
    model.model.vision_model.requires_grad_(False)
    explainer = GenerationExplainer(model, processor, method=method)
    expected = explainer.explain(random_image(), PROMPT, max_new_tokens=4)
    before = model_state(model)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            explanation = explainer.explain(random_image(), PROMPT, max_new_tokens=4)
            assert not torch.is_grad_enabled()
            assert torch.is_inference_mode_enabled() == (context is torch.inference_mode)
        assert torch.equal(explanation.raw_maps, expected.raw_maps)
        assert torch.equal(explanation.diagnostics["target_positions"], expected.diagnostics["target_positions"])
        after = model_state(model)
        assert after[:5] == before[:5]
        assert all(name == other and torch.equal(value, kept)
                   for (name, value), (other, kept) in zip(after[5], before[5]))


@pytest.mark.parametrize("prompt, found", [("<image><image> what", "holds 2 image tokens '<image>'"),
                                           ("what", "holds no image token '<image>'")])
def test_a_prompt_with_two_images_or_none_says_how_to_write_it(prompt: str, found: str) -> None:
    """Bug: a prompt with two image tokens, or none with a processor that has no chat template, was refused with
    the processor's count alone. Expected: the refusal also says what the prompt holds and how to write it."""
    model, processor = vlm_tiny.tiny_llava()
    processor.chat_template = None
    with pytest.raises(ValueError, match=f"{found} and one image is given: write the image token once"):
        GenerationExplainer(model, processor).explain(random_image(), prompt, max_new_tokens=2)


def test_a_span_of_numpy_integer_positions_is_the_span_of_those_positions() -> None:
    """Bug: ``spans=[(np.int64(0), np.int64(2))]`` (positions found with NumPy, e.g. ``np.flatnonzero``) was refused
    as not a (start, end) pair. Expected: the span of Python ints (0, 2); a NumPy bool is still refused."""
    model, processor = vlm_tiny.tiny_llava()
    explainer = GenerationExplainer(model, processor)
    expected = explainer.explain(random_image(), PROMPT, answer="abc", spans=[(0, 2)])
    explanation = explainer.explain(random_image(), PROMPT, answer="abc", spans=[(np.int64(0), np.int64(2))])
    assert explanation.class_names == expected.class_names == ["ab"]
    assert torch.equal(explanation.raw_maps, expected.raw_maps)
    assert explanation.diagnostics["target_tokens"].tolist() == [[[True, True, False]]]
    with pytest.raises(TypeError, match="spans must be"):
        explainer.explain(random_image(), PROMPT, answer="abc", spans=[(np.bool_(False), 2)])
