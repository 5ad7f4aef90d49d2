"""Which image regions each generated token of a vision-language model came from.

``GenerationExplainer(model, processor).explain(image, prompt)`` generates the answer greedily (or takes a given
answer), runs the model once over prompt and answer, and gives one map per answer token (or span of tokens) over
the image. The relevance is computed at the image tokens where they enter the language model (the embeddings the
vision encoder and projector produced) and laid on the image by the model family's layout (``explain.vlm.layout``).

Methods:

- ``"input_x_gradient"``: Σ_d e_{i,d} · ∂ log p(y_t | y_<t, image, prompt) / ∂e_{i,d} for each image token i
  (signed);
- ``"attention"``: gradient-weighted attention through the language model, mean over layers and heads of
  ReLU(A ⊙ ∂ log p(y_t) / ∂A) in the row of the position that predicts y_t, at the image tokens' columns
  (non-negative; the weighting of Chefer et al. 2021, "Generic attention-model explainability"). A span S is one
  target, s = Σ_{t∈S} log p(y_t): Σ over the rows that predict its tokens of the mean over layers and heads of
  ReLU(A ⊙ ∂s/∂A). It is not the sum of its tokens' maps: the row predicting an earlier token of S is weighted by
  the gradient of the later tokens' log-probabilities too (attention there changes what later positions read),
  and the ReLU of that sum is not the sum of ReLUs;
- ``"attnlrp"``: AttnLRP (Achtibat et al. 2024) through the language model: e_i · (modified gradient) of the token's
  logit, summed over the embedding (signed).

Input × gradient and AttnLRP are linear in the target's gradient, so a span's map is the sum of its tokens' maps.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from ..core.attention import capture_attention
from ..core.caller import warn_at_callers_line
from ..core.capture import model_device, model_dtype
from ..core.scope import CallScope
from ..io.explanation import Explanation
from ..io.inputs import DisplayImages, _checked_rgb, image_to_tensor, load_image
from ..io.page_text import LONE_SURROGATE
from ..methods.maps import NORMALIZATIONS, check_finite_maps, normalize_maps
from ..methods.passes import check_parameters_usable, reduced_precision
from .families import layout_for
from .layout import ImageLayout, paint
from .view import visible_token

METHODS = ("input_x_gradient", "attention", "attnlrp")
DISPLAY_LONGEST_SIDE = 768
"""Maps and the display image are the original image scaled down so its longer side is at most this."""

NEUTRAL_DECODING_SETTINGS = {"penalty_alpha": 0.0, "guidance_scale": 1.0, "use_mtp": False}
"""Generation settings that choose another decoding than greedy (contrastive search, classifier-free guidance,
multi-token prediction) → the value that turns them off, which ``generate`` gives them."""
OTHER_DECODING_SETTINGS = ("dola_layers", "prompt_lookup_num_tokens", "assistant_early_exit")
"""Generation settings that choose another decoding than greedy (DoLa, assisted decoding) with no value that turns
them off but None; ``generate`` unsets them."""

ImageSource = Union[str, "Image.Image", np.ndarray, Tensor]
Span = Union[str, tuple[int, int]]
"""A target made of several answer tokens: ``(start, end)`` token positions (end excluded), or a piece of the
answer's text (its first occurrence; the tokens that overlap it)."""


def checked_spans(spans: Optional[Sequence[Span]]) -> Optional[list[Span]]:
    """``spans`` as a list of spans, or a clear error: a non-empty list of answer texts (str) and (start, end) int
    pairs."""
    if spans is None:
        return None
    form = "spans must be a non-empty list of spans, each a piece of the answer's text or a (start, end) pair " \
           "of token positions, e.g. spans=[\"red car\"] or spans=[(0, 3)]"
    if isinstance(spans, (str, tuple)) or not isinstance(spans, Sequence) or len(spans) == 0:
        raise TypeError(f"{form}; got {spans!r}.")
    checked: list[Span] = []
    for span in spans:
        if isinstance(span, str):
            checked.append(span)
        elif (isinstance(span, (tuple, list)) and len(span) == 2
              and all(isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
                      for value in span)):  # positions counted with NumPy too
            checked.append((int(span[0]), int(span[1])))
        else:
            raise TypeError(f"{form}; got the span {span!r}.")
    return checked


@dataclass
class PreparedPrompt:
    """The processor's output for one image and one prompt, on the model's device, and the image itself."""

    inputs: dict[str, Any]
    image: Image.Image
    prompt_length: int


def as_pil_image(image: ImageSource) -> Image.Image:
    """A path, PIL image, (H, W, 3) ndarray or (3, H, W) tensor → an RGB PIL image (the processor's input); a clear
    error for an image with no pixels."""
    if (isinstance(image, np.ndarray) and image.size == 0) or (isinstance(image, Tensor) and image.numel() == 0):
        raise ValueError(f"the image is empty (shape {tuple(image.shape)}): give an image with at least one pixel.")
    picture = _pil_image(image)
    if picture.width == 0 or picture.height == 0:
        raise ValueError(f"the image is empty ({picture.height}×{picture.width} pixels, height × width): give an "
                         "image with at least one pixel.")
    return picture


def _pil_image(image: ImageSource) -> Image.Image:
    if isinstance(image, (str, bytes)) or hasattr(image, "__fspath__"):
        return load_image(image)
    if isinstance(image, Image.Image):
        return _checked_rgb(image, source="the PIL image")
    if isinstance(image, (list, tuple)):
        raise ValueError(f"got a {type(image).__name__} of {len(image)} images: a vision-language model takes one "
                         "image per call here. Explain each image in turn.")
    if isinstance(image, Tensor) and image.dim() == 4:
        if image.shape[0] != 1:
            raise ValueError(f"got a batch of {image.shape[0]} images, shape {tuple(image.shape)}: give one (3, H, W) "
                             "RGB image; a vision-language model takes one image per call here.")
        image = image[0]
    if isinstance(image, np.ndarray) and image.ndim == 4:
        if image.shape[0] != 1:
            raise ValueError(f"got a batch of {image.shape[0]} images, shape {image.shape}: give one (H, W, 3) RGB "
                             "image; a vision-language model takes one image per call here.")
        image = image[0]
    if isinstance(image, Tensor) and image.is_floating_point():
        if image.dim() != 3 or image.shape[0] != 3:
            raise ValueError(f"a float image tensor must be one (3, H, W) RGB image in [0, 1]; got shape "
                             f"{tuple(image.shape)}. A vision-language model takes one image per call here.")
        if not bool(torch.isfinite(image).all()):
            raise ValueError("the image tensor contains NaN or inf values.")
        low, high = float(image.min()), float(image.max())
        if low < 0.0 or high > 1.0:
            raise ValueError(f"a float image tensor must lie in [0, 1] (the processor normalises it); this one "
                             f"spans [{low:.3g}, {high:.3g}]. Pass the image before normalisation.")
        pixels = image.detach().float().cpu()
    elif isinstance(image, (np.ndarray, Tensor)):
        pixels = image_to_tensor(image)
    else:
        raise TypeError(f"cannot explain a {type(image).__name__}: give a path, a PIL image, an (H, W, 3) ndarray or a "
                        "(3, H, W) tensor.")
    array = (pixels.permute(1, 2, 0).numpy() * 255.0).round().clip(0, 255).astype(np.uint8)
    return Image.fromarray(array, mode="RGB")


def image_token_id(model: nn.Module) -> int:
    """The id of the image placeholder token in ``input_ids``, from the model's config."""
    config = model.config
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(model).__name__}'s config names no image token (image_token_id / image_token_index): "
                     "is it a vision-language model?")


def predicting_rows(logits: Tensor, predicting: Tensor, length: int, model_name: str) -> Tensor:
    """(T, vocab) the rows of a forward's (1, rows, vocab) ``logits`` that predict the answer's T tokens, at sequence
    positions ``predicting`` of a ``length``-token sequence: rows for the whole sequence, or for its last rows only
    (``logits_to_keep``; a model may ignore it and give them all); a clear error for other rows."""
    rows = int(logits.shape[1]) if logits.dim() == 3 else -1
    if rows == length:
        return logits[0, predicting]
    first = length - rows  # the sequence position of the first row kept
    if rows < 0 or first < 0 or first > int(predicting[0]):
        raise RuntimeError(f"{model_name} returned logits of shape {tuple(logits.shape)} for a sequence of {length} "
                           f"tokens: explain needs the rows of positions {int(predicting[0])} to "
                           f"{int(predicting[-1])}, which predict the answer.")
    return logits[0, predicting - first]


def precision_effect(method: str, precision: str) -> str:
    """What reduced precision did to the maps of the tiny test models (tests/test_session8_vlm.py measures it)."""
    if method == "input_x_gradient" and "autocast" not in precision:
        return ("on the tiny test models a model in bfloat16 moved input × gradient maps by up to 50 % of their "
                "maximum: the gradient of a log-probability is a small difference of large terms, and the model's "
                "own weights and embeddings are rounded; attention and AttnLRP maps by up to 5 %")
    return "on the tiny test models bfloat16 moved maps by up to 5 % of their maximum"


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level tokenizer's pieces."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[chr(byte)] = byte
        else:
            characters[chr(256 + extra)] = byte
            extra += 1
    return characters


BYTE_LEVEL_BYTES = _bytes_to_unicode()
"""A byte-level (GPT-2, Qwen) tokenizer's piece character → the byte it stands for ("Ġ" → 0x20, "ç" → 0xE7)."""


def _byte_level_decoding(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` decodes its pieces as GPT-2's byte-level alphabet."""
    if getattr(tokenizer, "byte_decoder", None):  # a slow GPT-2 style tokenizer
        return True
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


def bytes_text(data: bytes) -> str:
    """``data`` as UTF-8 text, each byte that is no part of a whole character written "<0xE7>"."""
    parts, start = [], 0
    while start < len(data):
        for length in (1, 2, 3, 4):
            try:
                parts.append(data[start:start + length].decode("utf-8"))
            except UnicodeDecodeError:
                continue
            start += length
            break
        else:
            parts.append(f"<0x{data[start]:02X}>")
            start += 1
    return "".join(parts)


def check_text(text: str, what: str) -> None:
    """A ValueError when ``text`` (the prompt, the answer) holds a lone surrogate: a byte that is not UTF-8, as
    Python reads it from a command line or file in another encoding, which no tokenizer can encode."""
    found = LONE_SURROGATE.search(text)
    if found is None:
        return
    code = ord(found.group())
    character = f"the byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else f"half a character, U+{code:04X},"
    raise ValueError(f"the {what} {text!r} holds {character} at character {found.start()}, which is not UTF-8 text "
                     f"(a command line, terminal or file in another encoding gives such bytes): write the {what} in "
                     "UTF-8.")


class GenerationExplainer:
    """Maps over the image for each token a vision-language model generates.

    model: a HuggingFace vision-language model (LLaVA, LLaVA-NeXT, Qwen2-VL / Qwen2.5-VL, PaliGemma, Idefics3 /
        SmolVLM), any device and dtype; it is left as found.
    processor: the model's own processor (``AutoProcessor.from_pretrained``): it prepares image and text.
    method: "input_x_gradient" (default), "attention" or "attnlrp" (see the module's docstring).
    normalize: how each map is scaled for display: "max" (by the largest |value|: [0, 1], or [-1, 1] for the
        signed methods), "minmax" or None (``raw_maps`` are never scaled).
    """

    def __init__(self, model: nn.Module, processor: Any, method: str = "input_x_gradient", *,
                 normalize: Optional[str] = "max"):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}.")
        if normalize not in NORMALIZATIONS:  # refused before, not after, a generation
            raise ValueError(f"normalize must be one of {NORMALIZATIONS}; got {normalize!r}.")
        if not hasattr(model, "get_decoder") or not hasattr(model, "generate"):
            raise TypeError(f"{type(model).__name__} is not a HuggingFace generation model (no get_decoder / "
                            "generate): GenerationExplainer takes a vision-language model such as "
                            "LlavaForConditionalGeneration.")
        if not callable(processor) or getattr(processor, "tokenizer", None) is None:
            raise TypeError("processor must be the model's own processor (AutoProcessor.from_pretrained(...)), with "
                            "an image processor and a tokenizer.")
        self.model = model
        self.processor = processor
        self.method = method
        self.normalize = normalize
        self.layout_function = layout_for(model)
        self.image_token = image_token_id(model)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    # ------------------------------------------------------------------ prompt and generation

    def prompt_text(self, prompt: str) -> str:
        """The text given to the processor: the prompt in the chat template (with one image) when the processor
        has one and the prompt has no image token of its own; else the prompt as given."""
        image_text = getattr(self.processor, "image_token", None) or getattr(self.tokenizer, "image_token", None)
        has_template = bool(getattr(self.processor, "chat_template", None)
                            or getattr(self.tokenizer, "chat_template", None))
        if has_template and not (image_text and image_text in prompt):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
            return str(self.processor.apply_chat_template(messages, add_generation_prompt=True))
        return prompt

    def prepare(self, image: ImageSource, prompt: str) -> PreparedPrompt:
        """Image and prompt through the model's processor, onto the model's device (floats in its dtype)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str; got {type(prompt).__name__}.")
        check_text(prompt, "prompt")
        picture = as_pil_image(image)
        unknown = self.unknown_words(prompt)
        if unknown:
            warn_at_callers_line(f"the prompt {prompt!r} has {len(unknown)} word(s) the model's tokenizer does not "
                                 f"know, {', '.join(repr(word) for word in unknown)}: the model reads "
                                 f"{self.tokenizer.unk_token!r} in their place. Write the prompt in words the model "
                                 f"knows{self._vocabulary_hint()}.", UserWarning)
        text = self.prompt_text(prompt)
        try:
            processed = self.processor(images=[picture], text=[text], return_tensors="pt")
        except (ValueError, TypeError) as error:
            raise ValueError(f"the processor refused the image and prompt: {error}{self._image_token_hint(text)}"
                             ) from error
        device, dtype = model_device(self.model), model_dtype(self.model)
        inputs: dict[str, Any] = {}
        for name, value in dict(processed).items():
            if name == "labels":  # PaliGemma's processor adds training labels: no loss is wanted here
                continue
            if isinstance(value, Tensor):
                value = value.to(device)
                if value.is_floating_point():
                    value = value.to(dtype)
            inputs[name] = value
        input_ids = inputs["input_ids"]
        if int((input_ids == self.image_token).sum()) == 0:
            raise ValueError("no image token reached the model: write the processor's image token in the prompt "
                             f"({getattr(self.processor, 'image_token', '<image>')!r}) or use a processor with a chat "
                             "template.")
        return PreparedPrompt(inputs, picture, input_ids.shape[1])

    def _image_token_hint(self, text: str) -> str:
        """How to fix a prompt ``text`` that does not hold the processor's image token exactly once; "" if it
        does."""
        image_text = getattr(self.processor, "image_token", None) or getattr(self.tokenizer, "image_token", None)
        count = text.count(image_text) if isinstance(image_text, str) and image_text else 1
        if count == 1:
            return ""
        where = "holds no image token" if count == 0 else f"holds {count} image tokens"
        return (f" The prompt {where} {image_text!r} and one image is given: "
                "write the image token once in the prompt (a vision-language model takes one image per call here), "
                "or use a processor with a chat template, which places it.")

    def generate(self, prepared: PreparedPrompt, max_new_tokens: int) -> Tensor:
        """Greedy generation: (T,) the new token ids, as ``model.generate(do_sample=False)`` gives them. The model's
        generation config is kept for its stopping and logits settings (end of sequence, stop strings, repetition
        penalty: ``_choice_settings``), not for other decoding strategies (sampling, beams, contrastive search, DoLa,
        guidance, assisted decoding) nor for output forms (several sequences, a dict)."""
        model: Any = self.model  # a HuggingFace generation model
        config = copy.deepcopy(model.generation_config)
        for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):  # greedy: no sampling settings
            if hasattr(config, name):
                setattr(config, name, None)
        config.do_sample, config.num_beams, config.max_new_tokens = False, 1, max_new_tokens
        config.num_return_sequences, config.return_dict_in_generate = 1, False
        for name, neutral in NEUTRAL_DECODING_SETTINGS.items():
            if getattr(config, name, None) is not None:
                setattr(config, name, neutral)
        # unset as arguments: transformers 5 fills a given config's None entries from model.generation_config
        arguments: dict[str, Any] = {name: None for name in OTHER_DECODING_SETTINGS
                                 if getattr(config, name, None) is not None}
        if getattr(config, "stop_strings", None):  # generate finds them with the tokenizer
            arguments["tokenizer"] = self.tokenizer
        with torch.no_grad():
            output = model.generate(**prepared.inputs, generation_config=config, **arguments)
        return output[0, prepared.prompt_length:]

    def answer_ids(self, answer: str) -> Tensor:
        """(T,) the token ids of a given answer; a ValueError for an empty answer, or one with words the tokenizer
        does not know (their map would be the unknown token's, not theirs)."""
        check_text(answer, "answer")
        ids = self.tokenizer(answer, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        if ids.numel() == 0:
            raise ValueError("the given answer has no tokens: pass a non-empty answer text.")
        unknown = self.unknown_words(answer)
        if unknown:
            raise ValueError(f"the answer {answer!r} has {len(unknown)} word(s) the model's tokenizer does not know, "
                             f"{', '.join(repr(word) for word in unknown)}: it would turn them into "
                             f"{self.tokenizer.unk_token!r} and explain the model's score of that token instead. Give "
                             f"the answer in words the model knows{self._vocabulary_hint()}.")
        return ids

    def unknown_words(self, text: str) -> list[str]:
        """The pieces of ``text`` that the tokenizer has no token for and turns into its unknown token (``<unk>``),
        in order; [] for a tokenizer without one (byte-level tokenizers never need it) and for the unknown token
        written out."""
        unknown = getattr(self.tokenizer, "unk_token_id", None)
        if unknown is None:
            return []
        written = getattr(self.tokenizer, "unk_token", None)
        try:
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            pieces = [text[start:end] for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"])
                      if token == unknown]
        except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer: no offsets
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            pieces = [str(written)] * (ids.count(unknown) - text.count(str(written)))
        return [piece for piece in pieces if piece != written]

    def _vocabulary_hint(self) -> str:
        """": its words are ..." for a small vocabulary (a demo's), else ""."""
        vocabulary: dict[str, int] = getattr(self.tokenizer, "get_vocab", dict)()
        if not 0 < len(vocabulary) <= 100:
            return ""
        special = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        words = [word for word, _ in sorted(vocabulary.items(), key=lambda item: item[1]) if word not in special]
        return f" (its words: {' '.join(words)})"

    def token_texts(self, ids: Tensor, *, skip_special_tokens: bool = False) -> list[str]:
        """Each token's own piece of the decoded text (a SentencePiece space stays with its token); with
        ``skip_special_tokens`` of the text decoded as the answer shows it, where hidden tokens (``hidden_tokens``)
        have the empty text. A token that begins a character later tokens complete (the three byte tokens of "猫"
        in a byte-level tokenizer) has the empty text, and the token that completes it the character: the texts
        join to the decoded answer, with no "�" for a character cut between tokens."""
        count = ids.numel()
        decoded = [self.tokenizer.decode(ids[:end].tolist(), skip_special_tokens=skip_special_tokens)
                   for end in range(count + 1)]
        texts, before = [], ""
        for end in range(1, count + 1):
            text = decoded[end]
            # "�" at the end that one of the next (up to 3: a UTF-8 character has at most 4 bytes) tokens rewrites
            if text.endswith("\ufffd") and any(not later.startswith(text) for later in decoded[end + 1:end + 4]):
                texts.append("")
                continue
            texts.append(text[len(before):] if text.startswith(before) else
                         self.tokenizer.decode(ids[end - 1:end].tolist(), skip_special_tokens=skip_special_tokens))
            before = text
        return texts

    def token_pieces(self, ids: Tensor) -> list[str]:
        """Each token's piece of the tokenizer's vocabulary (``convert_ids_to_tokens``: "<|im_end|>", "<0x0A>",
        "▁the"), whitespace made visible (``visible_token``); a byte-level tokenizer's piece as the text of its
        bytes, a byte that is no whole character written "<0xE7>" (its own piece, "ç", is no text of the answer);
        "" for an id the tokenizer has no piece for (a random model's vocabulary ids beyond the tokenizer's)."""
        pieces = self.tokenizer.convert_ids_to_tokens(ids.tolist())
        byte_level = _byte_level_decoding(self.tokenizer)
        shown = []
        for piece in pieces:
            if not isinstance(piece, str) or not piece:
                shown.append("")
            elif byte_level and all(character in BYTE_LEVEL_BYTES for character in piece):
                shown.append(visible_token(bytes_text(bytes(BYTE_LEVEL_BYTES[character] for character in piece))))
            else:
                shown.append(visible_token(piece))
        return shown

    def hidden_tokens(self, ids: Tensor) -> list[bool]:
        """Per token of ``ids``: whether the decoded answer (``decode(..., skip_special_tokens=True)``) hides it:
        the tokenizer's special tokens (``all_special_ids``: end of sequence, padding, ...), tokens added as special
        (Idefics3's ``<row_i_col_j>``, which ``all_special_ids`` does not list), and any other token that decodes to
        text alone but to nothing with special tokens skipped."""
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        hidden: dict[int, bool] = {}
        for token in set(ids.tolist()):
            entry = added.get(token)
            hidden[token] = (token in special or bool(getattr(entry, "special", False))
                             or (self.tokenizer.decode([token], skip_special_tokens=True) == ""
                                 and self.tokenizer.decode([token]) != ""))
        return [hidden[token] for token in ids.tolist()]

    # ------------------------------------------------------------------ explain

    def explain(self, image: ImageSource, prompt: str, *, answer: Optional[str] = None, max_new_tokens: int = 32,
                spans: Optional[Sequence[Span]] = None, skip_special_tokens: bool = True) -> Explanation:
        """Generate (or take) an answer and explain each of its tokens.

        image: a path, PIL image, (H, W, 3) ndarray or (3, H, W) tensor: one image.
        prompt: the question; put in the processor's chat template when it has one.
        answer: a given answer text to explain instead of generating one (greedy, ``max_new_tokens``).
        spans: targets made of several tokens (``(start, end)`` or a piece of the answer's text; see ``Span``);
            default: each token. ``spans=[answer_text]`` explains the whole answer as one target: the summed
            log-probability (logit for "attnlrp") of its tokens, in one backward pass. For "input_x_gradient" and
            "attnlrp" its map is the sum of its tokens' maps; for "attention" it is not (the ReLU comes after
            weighting by the span's gradient, which at an earlier token's row also holds the later tokens' part).
        skip_special_tokens: leave the generated tokens that the decoded answer hides (``hidden_tokens``: end of
            sequence, tokens added as special such as Idefics3's ``<row_i_col_j>``) out of the targets, the spans
            and the texts, as ``tokenizer.decode(..., skip_special_tokens=True)`` leaves them out of the answer; a
            given ``answer`` is explained token by token as given.
        Returns an Explanation of 1 image and K targets: maps (1, K, H, W) over the image (the longer side at most
        768 px), ``class_names`` the targets' texts, ``scores`` their log-probabilities (the summed log-probability
        of a span; the logit for "attnlrp"), ``diagnostics``: "token_ids" (1, T) the answer (hidden tokens
        included, so map k is not token k where some are left out), "target_positions" (1, K) the answer position
        (index into "token_ids") of map k's token (a span's first token), "target_token_ids" (1, K) that token's
        id, "target_tokens" (1, K, T) bool the answer tokens whose scores target k sums, "target_pieces" (K
        strings) those tokens' pieces of the vocabulary (``token_pieces``: "<|im_end|>", "<0xE7>"; "" for ids the
        tokenizer has none for; what names a target with no text), "generated" whether it
        was generated, "prompt" / "answer" texts (the answer decoded as the targets see it: without the hidden
        tokens where they were left out), "unplaced_relevance" (1, K) relevance on image tokens with no place on
        the image, "image_relevance" (1, K) the relevance summed over all image tokens, "image_token_relevance"
        (1, K, I) each of the I image tokens' relevance, in sequence order.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int; got {type(max_new_tokens).__name__}.")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1; got {max_new_tokens}.")
        if answer is not None and not isinstance(answer, str):
            raise TypeError(f"answer must be the answer's text, a str; got {type(answer).__name__}. To explain token "
                            "ids, decode them first: processor.tokenizer.decode(ids).")
        spans = checked_spans(spans)
        check_parameters_usable(self.model)  # before generating: parameters made in inference mode take no gradient
        scope = CallScope(self.model, eval_mode=True)
        with scope:
            for module in self.model.modules():  # state transformers keeps between calls (Qwen2-VL's rope offset)
                if "rope_deltas" in vars(module):
                    scope.add_undo(partial(setattr, module, "rope_deltas", vars(module)["rope_deltas"]))
            if torch.is_inference_mode_enabled():  # the caller's inference_mode(): no graph could be built
                scope.enter(torch.inference_mode(False))
            prepared = self.prepare(image, prompt)
            generated = answer is None
            ids = (self.generate(prepared, max_new_tokens) if generated else self.answer_ids(str(answer)))
            ids = ids.to(prepared.inputs["input_ids"].device)
            skip_hidden = skip_special_tokens and generated
            explained = self._explained_positions(ids, skip_hidden)
            if not explained:
                raise ValueError(self._nothing_to_explain(ids, max_new_tokens))
            texts = self.token_texts(ids, skip_special_tokens=skip_hidden)
            targets = self._targets(explained, texts, spans)
            pieces = self._target_pieces(ids, targets)
            layout = self.layout_function(self.model, self.processor, prepared.inputs,
                                          (prepared.image.height, prepared.image.width))
            relevance, scores, replayed = self._relevance(prepared, ids, targets)
            if generated and not torch.equal(replayed, ids):
                first = int(torch.nonzero(replayed != ids)[0, 0])
                settings = self._choice_settings()
                cause = (f"the model's generation settings ({settings}) change generation's choice from the most "
                         "likely token" if settings else "two tokens scored within float rounding, or the model "
                         "computes differently with and without its cache")
                warnings.warn(f"the forward pass over prompt and answer would pick a different token at answer "
                              f"position {first} than generation did ({int(replayed[first])} instead of "
                              f"{int(ids[first])}): {cause}. The maps explain the generated tokens.",
                              RuntimeWarning, stacklevel=2)
            precision = reduced_precision(self.model, prepared.inputs["input_ids"])
            if precision is not None:
                warnings.warn(f"generation:{self.method} ran in {precision}: the forward and backward passes round to "
                              f"{8 if precision.startswith('bfloat16') else 11} significant bits, so the image "
                              "tokens' gradients, and the maps made of them, carry that rounding "
                              f"({precision_effect(self.method, precision)}). For exact maps, run the model in "
                              "float32.", RuntimeWarning, stacklevel=2)
        return self._explanation(prepared, layout, relevance, scores, ids, targets, pieces, generated, skip_hidden,
                                 prompt)

    # ------------------------------------------------------------------ pieces of explain

    def _choice_settings(self) -> str:
        """The model's generation settings that make generation pick other than the most likely token, as text."""
        config: Any = getattr(self.model, "generation_config", None)
        neutral = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                   "min_new_tokens": 0, "min_length": 0, "bad_words_ids": None, "suppress_tokens": None,
                   "begin_suppress_tokens": None, "sequence_bias": None, "forced_bos_token_id": None,
                   "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "watermarking_config": None}
        active = [f"{name}={getattr(config, name)!r}" for name, value in neutral.items()
                  if getattr(config, name, None) not in (value, None)]
        return ", ".join(active)

    def _nothing_to_explain(self, ids: Tensor, max_new_tokens: int) -> str:
        """Why a generated answer of only hidden tokens (``ids``) has no target, and how to go on: a larger
        ``max_new_tokens`` only where generation stopped at it, not where the model ended its answer itself (its
        end of sequence first)."""
        pieces = ", ".join(f"{piece or '∅'} (id {int(token)})"
                           for piece, token in zip(self.token_pieces(ids[:4]), ids[:4]))
        generated = f"{pieces}{', ...' if ids.numel() > 4 else ''}"
        special = "skip_special_tokens=False to explain the special tokens themselves"
        if ids.numel() < max_new_tokens:  # generation stopped on its own: the end of sequence (or a stop string)
            return (f"the answer has no token to explain: the model generated only special tokens, which the decoded "
                    f"answer hides ({generated}), and ended its answer there, before max_new_tokens="
                    f"{max_new_tokens}, so a larger max_new_tokens gives the same answer: give an answer text "
                    f"(answer=...), or pass {special}.")
        return (f"the answer has no token to explain: the model generated only special tokens, which the decoded "
                f"answer hides ({generated}), up to max_new_tokens={max_new_tokens}: give an answer text, or raise "
                f"max_new_tokens (or pass {special}).")

    def _explained_positions(self, ids: Tensor, skip_hidden: bool) -> list[int]:
        """The answer positions that get a target: all, or with ``skip_hidden`` those the decoded answer shows."""
        if not skip_hidden:
            return list(range(ids.numel()))
        return [k for k, hidden in enumerate(self.hidden_tokens(ids)) if not hidden]

    def _targets(self, explained: list[int], texts: list[str], spans: Optional[Sequence[Span]]
                 ) -> list[tuple[str, list[int]]]:
        """(name, answer positions) per target: each explained token, or each span's explained tokens (tokens the
        decoded answer hides, which ``explained`` leaves out, are in no span)."""
        if spans is None:
            return [(texts[k], [k]) for k in explained]
        targets = []
        kept = set(explained)
        answer = "".join(texts)
        starts = np.cumsum([0] + [len(text) for text in texts])
        for span in spans:
            if isinstance(span, str):
                where = answer.find(span)
                if not span or where < 0:
                    raise ValueError(f"the span {span!r} is not in the answer {answer!r}.")
                # the tokens that overlap it, and those with no text within it (the first bytes of a character)
                positions = [k for k in explained if starts[k] < where + len(span)
                             and (starts[k + 1] > where or starts[k] == starts[k + 1] == where)]
                name = span
            else:
                start, end = (int(value) for value in span)
                if not 0 <= start < end <= len(texts):
                    raise ValueError(f"the span {span} is not a range of the answer's {len(texts)} tokens "
                                     "(start, end) with 0 <= start < end.")
                positions = [k for k in range(start, end) if k in kept]
                name = "".join(texts[start:end])
            if not positions:
                raise ValueError(f"the span {span!r} holds only special tokens, which the decoded answer hides and "
                                 "which are not explained: choose a span with answer text in it, or pass "
                                 "skip_special_tokens=False to explain special tokens too.")
            targets.append((name, positions))
        return targets

    def _target_pieces(self, ids: Tensor, targets: list[tuple[str, list[int]]]) -> list[str]:
        """Each target's tokens' pieces (``token_pieces``), joined: what names a target with no text (a token that
        decodes to nothing, a byte that only begins a character); a warning for targets with no text and no
        piece either (ids the tokenizer does not have: a random model's, or a model whose vocabulary outgrew its
        tokenizer's)."""
        pieces = self.token_pieces(ids)
        joined = ["".join(pieces[position] for position in positions) for _, positions in targets]
        nameless = [k for k, (name, _) in enumerate(targets) if not name and not joined[k]]
        if nameless:
            unknown = sorted({int(ids[position]) for k in nameless for position in targets[k][1]})
            listed = ", ".join(str(token) for token in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
            warn_at_callers_line(
                f"{len(nameless)} of the {len(targets)} maps explain tokens that the tokenizer has no text for "
                f"(id{'s' if len(unknown) > 1 else ''} {listed}; the tokenizer has {len(self.tokenizer)} tokens, "
                f"the model's output {self._output_size()}): the model generated ids its tokenizer does not know "
                "(random weights, or a processor that is not the model's own?). Their maps are labelled by id "
                "alone.", UserWarning)
        return joined

    def _output_size(self) -> str:
        """The number of scores the model's output head gives (its vocabulary), as text; "?" where unknown."""
        model: Any = self.model  # a HuggingFace generation model
        weight = getattr(model.get_output_embeddings(), "weight", None)
        return str(weight.shape[0]) if isinstance(weight, Tensor) else "?"

    def _media_tokens(self) -> list[int]:
        """Ids that the model's forward takes as places of image or video features."""
        config = self.model.config
        names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
        return sorted({value for value in (getattr(config, name, None) for name in names) if isinstance(value, int)})

    def _answer_placeholders(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The answer as the forward pass over prompt and answer takes it: generated image or video placeholder
        ids (a random or confused model may generate one) replaced by the pad id, since the forward would look
        for features there; generation embedded them as text, which the embeddings hook puts back. Returns the
        answer ids to run and (P,) the answer positions replaced."""
        replaced = torch.isin(ids, torch.tensor(self._media_tokens(), device=ids.device))
        pad = self.tokenizer.pad_token_id
        substitute = int(pad) if pad is not None and pad not in self._media_tokens() else 0
        return torch.where(replaced, torch.full_like(ids, substitute), ids), torch.nonzero(replaced).squeeze(1)

    def _teacher_forced_inputs(self, prepared: PreparedPrompt, ids: Tensor) -> dict[str, Any]:
        """The processor's inputs with the answer appended (the (1, prompt length) tensors, one entry per token,
        extended; not others whose last side happens to be as long, e.g. Qwen2-VL's (patches, 1176) pixels)."""
        inputs = dict(prepared.inputs)
        per_token = (1, prepared.prompt_length)
        for name, value in prepared.inputs.items():
            if not isinstance(value, Tensor) or tuple(value.shape) != per_token:
                continue
            if name == "input_ids":
                extension = self._answer_placeholders(ids)[0][None]
            elif name == "attention_mask":
                extension = torch.ones(1, ids.numel(), dtype=value.dtype, device=value.device)
            elif name == "token_type_ids" and getattr(self.model.config, "model_type", "") == "paligemma":
                extension = torch.ones(1, ids.numel(), dtype=value.dtype, device=value.device)  # the suffix
            else:
                extension = torch.zeros(1, ids.numel(), dtype=value.dtype, device=value.device)
            inputs[name] = torch.cat([value, extension], dim=1)
        return inputs

    def _relevance(self, prepared: PreparedPrompt, ids: Tensor, targets: list[tuple[str, list[int]]]
                   ) -> tuple[Tensor, Tensor, Tensor]:
        """(K, image tokens) relevance, (K,) scores, and (T,) the greedy choice at each answer position."""
        inputs = self._teacher_forced_inputs(prepared, ids)
        image_positions = torch.nonzero(inputs["input_ids"][0] == self.image_token).squeeze(1)
        predicting = prepared.prompt_length - 1 + torch.arange(ids.numel(), device=ids.device)  # row → token k
        placeholders = prepared.prompt_length + self._answer_placeholders(ids)[1]
        placeholder_ids = ids[placeholders - prepared.prompt_length]
        model: Any = self.model  # a HuggingFace generation model
        decoder = model.get_decoder()
        captured: dict[str, Tensor] = {}
        scope = CallScope(self.model)
        with scope:
            scope.frozen_parameters(self.model)  # the graph is for the embeddings' gradient only

            def leaf_embeddings(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                embeddings = kwargs.get("inputs_embeds")
                if embeddings is None:
                    raise RuntimeError(f"{type(module).__name__} was called without inputs_embeds: explain cannot "
                                       "find the image tokens' embeddings of this model.")
                torch.set_grad_enabled(True)  # the vision encoder ran without a graph; the language model with
                embeddings = embeddings.detach()
                if placeholders.numel():  # generated placeholder ids: embedded as text, as generation did
                    embeddings = embeddings.clone()
                    text_embeddings = model.get_input_embeddings()(placeholder_ids)
                    embeddings[0, placeholders] = text_embeddings.to(embeddings.dtype)
                leaf = embeddings.requires_grad_(True)
                captured["embeddings"] = leaf
                if rules is not None:
                    rules.follow(leaf)
                return args, {**kwargs, "inputs_embeds": leaf}

            rules = None
            attention = None
            if self.method == "attnlrp":
                from ..methods._attnlrp_rules import AttnLrpRules, AttnLrpScope

                rules = AttnLrpRules(self.model)
                scope.enter(AttnLrpScope(self.model, rules))
            elif self.method == "attention":
                decoder_name = next(name for name, module in self.model.named_modules() if module is decoder)
                attention = scope.enter(capture_attention(self.model, decoder_name, detach=False))
            scope.forward_pre_hook(decoder, leaf_embeddings, with_kwargs=True)
            torch.set_grad_enabled(False)
            length = int(inputs["input_ids"].shape[1])
            options: dict[str, Any] = {"use_cache": False, "return_dict": True}  # an output, whatever the config
            if "logits_to_keep" in inspect.signature(model.forward).parameters:  # the answer's rows' logits only:
                options["logits_to_keep"] = ids.numel() + 1  # (sequence × vocabulary) is GBs on 7B models
            logits = model(**inputs, **options).logits
            logits = predicting_rows(logits, predicting, length, type(self.model).__name__)  # (T, vocab)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 / fp16 models: in float32
            embeddings = captured["embeddings"]
            replayed = logits.argmax(dim=-1).detach()
            if self.method == "attnlrp":
                token_scores = logits.gather(1, ids[:, None])[:, 0]
            else:
                token_scores = F.log_softmax(logits, dim=-1).gather(1, ids[:, None])[:, 0]
            relevances, scores = [], []
            for index, (_, positions) in enumerate(targets):
                score = token_scores[positions].sum()
                last = index == len(targets) - 1
                if self.method == "attention":
                    assert attention is not None
                    probabilities = attention.probabilities
                    grads = torch.autograd.grad(score, probabilities, retain_graph=not last, allow_unused=True)
                    rows = predicting[positions]
                    weighted = [(p[0][:, rows][:, :, image_positions] * g[0][:, rows][:, :, image_positions]).clamp(
                        min=0).mean(dim=0).sum(dim=0) for p, g in zip(probabilities, grads) if g is not None]
                    relevances.append(torch.stack(weighted).mean(dim=0) if weighted
                                      else score.new_zeros(image_positions.numel()))
                else:
                    (gradient,) = torch.autograd.grad(score, embeddings, retain_graph=not last)
                    precise = torch.promote_types(embeddings.dtype, torch.float32)  # bf16 sums: 8 bits
                    relevances.append((embeddings[0, image_positions].to(precise)
                                       * gradient[0, image_positions].to(precise)).sum(dim=-1))
                scores.append(score.detach())
        relevance = torch.stack(relevances).detach()
        return relevance.to(torch.promote_types(relevance.dtype, torch.float32)), torch.stack(scores), replayed

    def _explanation(self, prepared: PreparedPrompt, layout: ImageLayout, relevance: Tensor, scores: Tensor,
                     ids: Tensor, targets: list[tuple[str, list[int]]], pieces: list[str], generated: bool,
                     skip_hidden: bool, prompt: str) -> Explanation:
        height, width = prepared.image.height, prepared.image.width
        scale = min(1.0, DISPLAY_LONGEST_SIDE / max(height, width))
        size = (max(1, round(height * scale)), max(1, round(width * scale)))
        placed = layout.placed().to(relevance.device)
        if relevance.shape[1] != layout.token_count:
            raise RuntimeError(f"the layout places {layout.token_count} image tokens but the sequence has "
                               f"{relevance.shape[1]}: explain's layout of {type(self.model).__name__} does not "
                               "match this model; please report it.")
        raw = paint(relevance, layout, size)[None]  # (1, K, H, W)
        method = f"generation:{self.method}"
        check_finite_maps(raw, method)
        display = prepared.image
        if scale < 1.0:
            display = display.resize((size[1], size[0]), Image.Resampling.BILINEAR)
        images = torch.from_numpy(np.asarray(display, dtype=np.float32) / 255.0)[None]
        count = len(targets)
        positions = torch.tensor([answer_positions[0] for _, answer_positions in targets], device=ids.device)
        covered = torch.zeros(count, ids.numel(), dtype=torch.bool, device=ids.device)
        for k, (_, answer_positions) in enumerate(targets):
            covered[k, answer_positions] = True
        probabilities = scores.exp() if self.method != "attnlrp" else None
        return Explanation(
            map_grid=normalize_maps(raw, self.normalize),
            raw_map_grid=raw,
            scores=scores.float()[None],
            class_indices=torch.arange(count, device=raw.device)[None],
            display=DisplayImages(images),
            method=method,
            layer=None,
            keep_target_dim=True,
            probabilities=None if probabilities is None else probabilities.float()[None],
            diagnostics={
                "token_ids": ids[None].detach(),
                "target_positions": positions[None],
                "target_token_ids": ids[positions][None].detach(),
                "target_tokens": covered[None],
                "target_pieces": pieces,
                "generated": torch.tensor([generated]),
                "prompt": [prompt],
                "answer": [self.tokenizer.decode(ids.tolist(), skip_special_tokens=skip_hidden)],
                "unplaced_relevance": relevance[:, ~placed].sum(dim=1)[None],
                "image_relevance": relevance.sum(dim=1)[None],
                "image_token_relevance": relevance[None],
            },
            class_names=[name for name, _ in targets],
        )
