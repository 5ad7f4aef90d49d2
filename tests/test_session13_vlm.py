"""Session 13 attacks on the vision-language per-token maps (explain.vlm): what the figure and the page draw for maps
that are not normalised, and what a model that ends its answer at once is told."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import vlm_tiny
from PIL import Image

from explain import GenerationExplainer
from explain.vlm.view import display_maps, token_html

PROMPT = "what is it?"


def random_image(height: int = 40, width: int = 52, seed: int = 0) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3)).astype(np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("method", ["input_x_gradient", "attention"])
def test_the_figure_and_page_draw_raw_maps_scaled_to_their_largest_value_not_clamped_to_nothing(method: str) -> None:
    """(fixed) With normalize=None the maps keep their raw values (1e-5 on the tiny LLaVA): the token figure and the
    page drew them clamped to [-1, 1], i.e. as nothing (every pixel the colour of 0), while their colour bar reads
    "relevance / largest |value|". They now draw each map scaled to its own largest |value|, as every other drawing
    of an Explanation does (``drawn_map_grid``), with a warning at the caller's line; by hand: raw / max |raw|."""
    model, processor = vlm_tiny.tiny_llava()
    image = random_image()
    raw = GenerationExplainer(model, processor, method, normalize=None).explain(image, PROMPT, answer="ab")
    scaled = GenerationExplainer(model, processor, method).explain(image, PROMPT, answer="ab")
    maps = raw.raw_maps[0].double()
    largest = maps.abs().amax(dim=(-2, -1), keepdim=True)
    assert float(largest.max()) < 1e-2  # raw values that clamping leaves near 0
    by_hand = maps / largest
    signed = bool((maps < 0).any())
    with pytest.warns(UserWarning, match=r"not normalised.*scaled to its own largest \|value\|") as caught:
        values, colour_map = display_maps(raw)
    assert caught[0].filename == __file__
    expected = (by_hand + 1) / 2 if signed else by_hand
    torch.testing.assert_close(values.double(), expected, rtol=1e-5, atol=1e-6)
    assert colour_map == display_maps(scaled)[1]
    torch.testing.assert_close(values, display_maps(scaled)[0], rtol=1e-5, atol=1e-6)
    with pytest.warns(UserWarning, match="not normalised"):
        page = token_html(raw)
    assert page == token_html(scaled)


def model_that_ends_at_once() -> tuple[torch.nn.Module, object]:
    """The tiny LLaVA with its end-of-sequence row 3 × that of the token it answers first: it answers the end of
    sequence first."""
    model, processor = vlm_tiny.tiny_llava()
    first = int(GenerationExplainer(model, processor).explain(random_image(), PROMPT, max_new_tokens=1)
                .diagnostics["token_ids"][0, 0])
    with torch.no_grad():
        model.lm_head.weight[processor.tokenizer.eos_token_id] = 3.0 * model.lm_head.weight[first]
    return model, processor


def test_a_model_that_ends_its_answer_at_once_is_not_told_to_raise_max_new_tokens() -> None:
    """(fixed) A model whose first token is the end of sequence stops there: the error said "raise max_new_tokens",
    which gives the same answer. It now says the model ended its answer before max_new_tokens, names the token, and
    says how to go on: an answer text, or skip_special_tokens=False, which explains the end of sequence itself (its
    log-probability is generate's)."""
    model, processor = model_that_ends_at_once()
    explainer = GenerationExplainer(model, processor)
    image = random_image()
    eos = processor.tokenizer.eos_token_id
    prepared = explainer.prepare(image, PROMPT)
    with torch.no_grad():
        plain = model.generate(**prepared.inputs, max_new_tokens=8, do_sample=False)[0, prepared.prompt_length:]
    assert plain.tolist() == [eos]  # the model ends at once, whatever max_new_tokens is
    with pytest.raises(ValueError, match=r"no token to explain.*</s> \(id 2\).*ended its answer there, before "
                                         r"max_new_tokens=8.*skip_special_tokens=False") as error:
        explainer.explain(image, PROMPT, max_new_tokens=8)
    assert "raise max_new_tokens" not in str(error.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        explained = explainer.explain(image, PROMPT, max_new_tokens=8, skip_special_tokens=False)
    assert explained.diagnostics["token_ids"].tolist() == [[eos]]
    assert explained.diagnostics["target_pieces"] == ["</s>"]
    with torch.no_grad():
        logits = model(**explainer._teacher_forced_inputs(prepared, plain)).logits[0, prepared.prompt_length - 1]
    torch.testing.assert_close(explained.scores[0, 0], torch.log_softmax(logits, -1)[eos], rtol=1e-5, atol=1e-6)


def test_a_model_cut_off_by_max_new_tokens_is_still_told_to_raise_it() -> None:
    """(fixed with the above) Where generation stopped at max_new_tokens on a hidden token, a larger max_new_tokens
    can give text: the error still says so, and now names the limit it stopped at."""
    model, processor = vlm_tiny.tiny_llava()
    model.generation_config.forced_eos_token_id = processor.tokenizer.eos_token_id
    with pytest.raises(ValueError, match=r"up to max_new_tokens=1: give an answer text, or raise max_new_tokens"):
        GenerationExplainer(model, processor).explain(random_image(), PROMPT, max_new_tokens=1)
