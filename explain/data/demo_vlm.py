"""A tiny vision-language demo: a LLaVA (CLIP vision tower, Llama language model) that answers "what color is it ?"
about synthetic scenes.

Each scene (64×64 RGB) holds one shape (a square or a circle, 14–22 px, red, green, blue or yellow) on a noisy light
background. To answer, the model must find the shape: the map of the colour word should lie on it. The weights
(float16, made by ``python -m explain.data.train_vlm``) ship with the package; model, tokenizer and processor are
built from configs here, so nothing is downloaded. It needs ``transformers`` (``pip install transformers``).

    from explain.data.demo_vlm import load_vlm_demo, make_scene
    model, processor = load_vlm_demo()
    scene = make_scene(np.random.default_rng(0))
    GenerationExplainer(model, processor).explain(scene.image, QUESTIONS["color"])
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from PIL import Image, ImageDraw

VLM_WEIGHTS_PATH = Path(__file__).with_name("demo_vlm.pt")
IMAGE_SIZE = 64
PATCH_SIZE = 8
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30),
}
SHAPES = ("square", "circle")
WORDS = ["user", "assistant", ":", "?", "what", "color", "shape", "is", "it", *SHAPES, *COLORS]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<image>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }}{% endif %}{% endfor %} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
HELD_OUT_SEED = 12345


QUESTIONS = {"color": "what color is it ?"}
"""The one question the demo was trained on (its answer: the shape's colour, then the end of sequence). Asked
anything else ("what shape is it ?"), it still answers with a colour: it has never learnt to name the shape."""


@dataclass
class Scene:
    """One scene: ``image`` (64×64 RGB), its shape ("square" or "circle"), colour, and box (left, top, right,
    bottom) in pixels."""

    image: Image.Image
    shape: str
    color: str
    box: tuple[int, int, int, int]

    def answer(self, question: str) -> str:
        """The right answer to ``QUESTIONS[question]``."""
        return self.color if question == "color" else self.shape

    def mask(self) -> np.ndarray:
        """(64, 64) bool: the shape's pixels."""
        return (np.asarray(self.image).astype(int) - np.asarray(self.background)).any(axis=2)

    background: Image.Image = None  # type: ignore[assignment]


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - transformers is a test dependency
        raise ImportError("the vision-language demo needs transformers: pip install transformers") from error
    return transformers


def make_scene(rng: np.random.Generator) -> Scene:
    """A random scene: one square or circle, 14–22 px, of a random colour, at a random place."""
    background = Image.fromarray(rng.integers(200, 246, size=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))
    image = background.copy()
    shape = SHAPES[int(rng.integers(0, 2))]
    color = list(COLORS)[int(rng.integers(0, len(COLORS)))]
    size = int(rng.integers(14, 23))
    left, top = (int(value) for value in rng.integers(1, IMAGE_SIZE - size - 1, size=2))
    box = (left, top, left + size - 1, top + size - 1)
    draw = ImageDraw.Draw(image)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLORS[color])
    return Scene(image, shape, color, box, background)


def build_tokenizer() -> Any:
    """A word-level tokenizer over ``WORDS`` (split at spaces and punctuation); ``<image>`` is id 4."""
    transformers = _require_transformers()
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIALS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"})


def build_processor() -> Any:
    """A LlavaProcessor: CLIPImageProcessor at 64 px (resize shortest edge, centre crop), the word tokenizer."""
    transformers = _require_transformers()
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return transformers.LlavaProcessor(image_processor=image_processor, tokenizer=build_tokenizer(),
                                       patch_size=PATCH_SIZE, num_additional_image_tokens=1,
                                       vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE)


def build_model() -> torch.nn.Module:
    """The untrained LLaVA: CLIP vision (hidden 64, 2 layers, 8 px patches: 8×8 image tokens), Llama (hidden 64,
    2 layers, 4 heads). The vision encoder's attention output projections are zero (and stay so in training): its
    image tokens each describe their own patch only, so the language model must read the shape's own tokens to
    name its colour, and where its answer came from is known (the shape)."""
    transformers = _require_transformers()
    vision = transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                                           projection_dim=64)
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=4, vocab_size=len(SPECIALS) + len(WORDS),
                                    max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=SPECIALS.index("<image>"), vision_feature_layer=-1,
                                      pad_token_id=0)
    model = transformers.LlavaForConditionalGeneration(config)
    for parameter in local_vision_parameters(model):
        with torch.no_grad():
            parameter.zero_()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval()


def local_vision_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The vision encoder's attention output projections (weights and biases): zero in the demo."""
    return [parameter for name, parameter in model.named_parameters()
            if name.startswith("model.vision_tower.") and ".self_attn.out_proj." in name]


def load_vlm_demo(path: Union[Path, str] = VLM_WEIGHTS_PATH) -> tuple[torch.nn.Module, Any]:
    """The trained demo: ``(model, processor)``, the model in eval mode, float32, on the CPU."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no vision-language demo weights at {path}: make them with "
                                "python -m explain.data.train_vlm")
    model = build_model()
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({name: value.float() for name, value in state.items()})
    return model.eval(), build_processor()


def held_out_scenes(count: int = 200, seed: int = HELD_OUT_SEED) -> list[Scene]:
    """``count`` scenes from a seed the training never used."""
    rng = np.random.default_rng(seed)
    return [make_scene(rng) for _ in range(count)]
