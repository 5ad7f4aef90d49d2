"""Session 11: how the per-token maps of ``GenerationExplainer`` name their tokens.

- A token with no text (an id the tokenizer lacks, a special token or a byte piece that decodes to nothing) is
  named by its piece of the vocabulary and its id ("<|im_end|> (id 76)", "<0xE7> (id 232)"), in the figure's
  captions and the page; only a token with no piece either (an id beyond the tokenizer) warns.
- A character cut between byte tokens ("猫" = three byte-level tokens) is the text of the token that completes it,
  the tokens before it are named by their bytes: the texts join to the decoded answer (no "�"), so a span of the
  answer's text finds its tokens.
- Markup in token texts and pieces is escaped in the page.
"""

from __future__ import annotations

import html
import warnings
from html.parser import HTMLParser
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import transformers
import vlm_tiny
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from explain import GenerationExplainer
from explain.io.explanation import Explanation
from explain.io.inputs import DisplayImages
from explain.vlm import view
from explain.vlm.view import token_figure, token_html

PROMPT = "what is it?"


def random_image(height: int = 40, width: int = 50, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, size=(height, width, 3)).astype(np.uint8))


def byte_level_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """GPT-2 style: one piece per byte ("猫" → "ç", "Į", "«"), no merges."""
    vocabulary = {character: index for index, character in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocabulary, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)


def byte_fallback_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """SentencePiece style: "<0xE7>" pieces for bytes of characters it has no piece for."""
    vocabulary = {"<unk>": 0, **{f"<0x{byte:02X}>": byte + 1 for byte in range(256)}, "▁a": 257}
    backend = Tokenizer(models.BPE(vocabulary, [], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def explainer_with(tokenizer: Any) -> GenerationExplainer:
    """A GenerationExplainer of the tiny LLaVA whose token texts and pieces come from ``tokenizer``."""
    model, processor = vlm_tiny.tiny_llava()
    explainer = GenerationExplainer(model, processor)
    explainer.processor = SimpleNamespace(tokenizer=tokenizer)
    return explainer


# ---- Characters cut between byte tokens ---------------------------------------------------------------------


@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer])
def test_a_character_cut_between_byte_tokens_is_the_text_of_the_token_completing_it(make: Any) -> None:
    """The bytes of "猫" (E7 8C AB) and "é" (C3 A9) and the 4 bytes of "🐱" (F0 9F 90 B1): each character is the
    text of its last byte's token, the others have no text and are named by their byte; the texts join to the
    decoded answer (before: "�" for every byte, and the texts joined to "������ a")."""
    tokenizer = make()
    explainer = explainer_with(tokenizer)
    answer = "猫é🐱 a" if make is byte_level_tokenizer else "猫é🐱"
    ids = torch.tensor(tokenizer(answer, add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(ids.tolist()) == answer  # the premise
    bytes_of = {"猫": ["E7", "8C", "AB"], "é": ["C3", "A9"], "🐱": ["F0", "9F", "90", "B1"]}
    expected_texts = [text for character in "猫é🐱" for text in [""] * (len(bytes_of[character]) - 1) + [character]]
    expected_pieces = [f"<0x{byte}>" for character in "猫é🐱" for byte in bytes_of[character]]
    if make is byte_level_tokenizer:
        expected_texts += [" ", "a"]
        expected_pieces += ["␣", "a"]
    assert explainer.token_texts(ids) == expected_texts
    assert "".join(explainer.token_texts(ids)) == answer
    assert explainer.token_pieces(ids) == expected_pieces
    targets = explainer._targets(list(range(len(ids))), explainer.token_texts(ids), ["猫", "é"])
    assert targets == [("猫", [0, 1, 2]), ("é", [3, 4])]


def test_a_byte_piece_is_named_by_its_bytes_not_by_its_alphabet_character() -> None:
    """A byte-level piece "ç" stands for the byte E7, no "ç" of the answer; a piece of whole characters is their
    text ("Ġa" → " a", shown "␣a")."""
    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(["Ġa"])  # a piece of two byte-level characters: " a"
    explainer = explainer_with(tokenizer)
    ids = torch.tensor([tokenizer.convert_tokens_to_ids("ç"), tokenizer.convert_tokens_to_ids("Ġa")])
    assert tokenizer.convert_ids_to_tokens(ids.tolist())[0] == "ç"  # the premise
    assert explainer.token_pieces(ids)[0] == "<0xE7>"


# ---- Tokens with no text, end to end -------------------------------------------------------------------------


def llava_generating(extra: str, special: bool) -> tuple[GenerationExplainer, int]:
    """The tiny LLaVA made to generate ``extra`` first: a token added to the tokenizer (special or not), or where
    ``extra`` is "", an id the tokenizer lacks (the model's vocabulary grown by 8)."""
    model, processor = vlm_tiny.tiny_llava()
    tokenizer = processor.tokenizer
    first = int(GenerationExplainer(model, processor).explain(random_image(), PROMPT, max_new_tokens=1)
                .diagnostics["token_ids"][0, 0])
    if extra:
        tokenizer.add_tokens([extra], special_tokens=special)
        token = tokenizer.convert_tokens_to_ids(extra)
        model.resize_token_embeddings(len(tokenizer))
    else:
        token = len(tokenizer) + 3
        model.resize_token_embeddings(len(tokenizer) + 8)
    with torch.no_grad():
        model.lm_head.weight[token] = 3.0 * model.lm_head.weight[first]
    return GenerationExplainer(model, processor), token


def captions(explanation: Explanation) -> list[str]:
    figure = token_figure(explanation, show_image=False)
    return [text.get_text() for text in figure.axes[0].texts]


def test_an_id_the_tokenizer_lacks_warns_and_is_named_by_its_id() -> None:
    """A random model's id beyond the tokenizer (75 tokens; the model's output 83) has no text and no piece: the
    explanation warns, naming the id, and the figure and page label its map "∅ no text (id 78)" (before: "∅", no
    warning)."""
    explainer, token = llava_generating("", special=False)
    assert (token, len(explainer.tokenizer)) == (78, 75)
    with pytest.warns(UserWarning, match=r"tokenizer has no text for \(id 78; .*has 75 tokens.*output 83\)"):
        explanation = explainer.explain(random_image(), PROMPT, max_new_tokens=3)
    assert explanation.diagnostics["token_ids"][0, 0] == token and explanation.class_names[0] == ""
    assert explanation.diagnostics["target_pieces"][0] == ""
    assert view.token_labels(explanation)[0] == f"∅ no text (id {token})"
    assert captions(explanation)[0].startswith(f"0: ∅ no text\nid {token} · p = ")
    assert f"token 1: ∅ no text (id {token}), probability" in token_html(explanation)
    assert explanation.title(0, 0).startswith(f"∅ no text (id {token}) (token 0): ")  # before: " (token 0): "


def test_a_special_token_that_decodes_to_nothing_is_named_by_its_piece_without_warning() -> None:
    """A special token whose tokenizer decodes it to nothing (its decoder drops "<|im_end|>"), explained with
    skip_special_tokens=False: its map is labelled "<|im_end|> (id 75)" in the figure and page, no warning."""
    explainer, token = llava_generating("<|im_end|>", special=True)
    tokenizer = explainer.tokenizer
    tokenizer.backend_tokenizer.decoder = decoders.Sequence([decoders.Replace("<|im_end|>", ""), decoders.Fuse()])
    assert tokenizer.decode([token]) == ""  # the premise
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        explanation = explainer.explain(random_image(), PROMPT, max_new_tokens=3, skip_special_tokens=False)
    assert explanation.diagnostics["token_ids"][0, 0] == token and explanation.class_names[0] == ""
    assert view.token_labels(explanation)[0] == f"<|im_end|> (id {token})"
    assert captions(explanation)[0].startswith(f"0: <|im_end|>\nid {token} · p = ")
    page = token_html(explanation)
    assert f'aria-label="token 1: &lt;|im_end|&gt; (id {token}), probability' in page
    assert '<span class="token ws notext"' in page
    assert explanation.title(0, 0).startswith(f"<|im_end|> (id {token}) (token 0): ")


# ---- Explanations made by hand -------------------------------------------------------------------------------


def hand_made(texts: list[str], diagnostics: dict[str, Any]) -> Explanation:
    count = len(texts)
    maps = torch.rand(1, count, 8, 8, generator=torch.Generator().manual_seed(0))
    scores = torch.log(torch.linspace(0.9, 0.3, count))[None]
    return Explanation(map_grid=maps, raw_map_grid=maps.clone(), scores=scores,
                       class_indices=torch.arange(count)[None], display=DisplayImages(torch.rand(1, 8, 8, 3)),
                       method="generation:input_x_gradient", keep_target_dim=True, probabilities=scores.exp(),
                       diagnostics=diagnostics, class_names=list(texts))


def test_a_hand_made_token_with_no_text_and_no_piece_warns() -> None:
    """An explanation with an empty token text and no pieces: a warning naming the map and id, the label
    "∅ no text (id 7)"; with the pieces named, no warning."""
    ids = {"target_token_ids": torch.tensor([[5, 7]])}
    with pytest.warns(UserWarning, match=r"maps 1 \(id 7\) are labelled '∅ no text'"):
        assert view.token_labels(hand_made(["a", ""], ids)) == ["a", "∅ no text (id 7)"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert view.token_labels(hand_made(["a", ""], {**ids, "target_pieces": ["a", "<0x0A>"]})) == [
            "a", "<0x0A> (id 7)"]


class Spans(HTMLParser):
    """The answer's token spans of a page: (text, aria-label) each."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[list[str]] = []
        self.inside = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Any]]) -> None:
        attributes = dict(attrs)
        if tag == "span" and "token" in (attributes.get("class") or "").split():
            self.spans.append(["", attributes["aria-label"]])
            self.inside = True

    def handle_endtag(self, tag: str) -> None:
        self.inside = False

    def handle_data(self, data: str) -> None:
        if self.inside:
            self.spans[-1][0] += data


def test_markup_in_texts_and_pieces_is_escaped_in_the_page() -> None:
    """Token texts "<script>", "&amp;", '"q"', whitespace, and a text-less token whose piece is "</script>": the
    page parses back to exactly those texts and labels (the markup is text, not elements)."""
    texts = ["<script>alert(1)</script>", "&amp;", '"q\'', "\n", " ", ""]
    pieces = ["", "", "", "", "", "</script><b>"]
    diagnostics = {"target_token_ids": torch.tensor([[1, 2, 3, 4, 5, 6]]), "target_pieces": pieces,
                   "prompt": ["<i>p</i>"], "answer": ["".join(texts)]}
    page = token_html(hand_made(texts, diagnostics))
    parser = Spans()
    parser.feed(page)
    probabilities = torch.linspace(0.9, 0.3, len(texts)).tolist()
    shown = ["<script>alert(1)</script>", "&amp;", '"q\'', "⏎", "␣", "</script><b> (id 6)"]
    assert parser.spans == [[("</script><b>" if k == 5 else text if text.strip() else shown[k]),
                             f"token {k + 1}: {shown[k]}, probability {probabilities[k]:.3f}"]
                            for k, text in enumerate(texts)]
    assert "<b>" not in page and "<script>alert" not in page and "<i>p" not in page
    assert html.escape("<i>p</i>") in page


def test_a_caption_of_wide_characters_is_cut_to_the_room_of_16_latin_letters() -> None:
    """A CJK character or emoji takes two columns: 18 "猫" are cut to 7 and "…" (15 columns), 20 "🐱" likewise,
    40 "a" to 15 and "…" (before: 15 wide characters and "…", twice the room, running into the next panel)."""
    texts = ["猫" * 18, "🐱" * 20, "a" * 40, "猫a"]
    explanation = hand_made(texts, {"target_token_ids": torch.tensor([[1, 2, 3, 4]])})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # glyphs missing from matplotlib's font
        shown = [caption.split("\n")[0] for caption in captions(explanation)]
    assert shown == ["0: " + "猫" * 7 + "…", "1: " + "🐱" * 7 + "…", "2: " + "a" * 15 + "…", "3: 猫a"]
