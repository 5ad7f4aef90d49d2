"""Tiny random-weight vision-language models and their processors, built from configs (nothing downloaded).

A character-level tokenizer (one token per character, plus the special tokens) stands in for each model's own;
the image processors are each model's own classes with small sizes. ``tiny_<family>(token_local=...)``
returns ``(model, processor)``, the model in eval mode; ``token_local=True`` gives image tokens that each see only
their own patch (group) of pixels (every attention output projection of the vision encoder zeroed, so no token
mixes with another), used to find by perturbation which part of the image each token sees.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

CHARACTERS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!:'\n")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<image>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""A chat template that writes the image token where the message has an image."""


def tiny_tokenizer(extra_specials: tuple[str, ...] = ()) -> transformers.PreTrainedTokenizerFast:
    """One token per character; ``<image>`` (id 4) and ``extra_specials`` (ids from 5) are single tokens."""
    specials = SPECIALS + list(extra_specials)
    vocab = {token: index for index, token in enumerate(specials + CHARACTERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"}, additional_special_tokens=list(extra_specials))
    fast.add_tokens(list(extra_specials), special_tokens=True)  # matched whole (transformers 5); ids kept
    return fast


def tiny_llama_config(vocab_size: int, **overrides: Any) -> transformers.LlamaConfig:
    settings: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512)
    settings.update(overrides)
    return transformers.LlamaConfig(**settings)


def tiny_llava(*, token_local: bool = False, seed: int = 0, image_size: int = 32, patch_size: int = 8
               ) -> tuple[torch.nn.Module, Any]:
    """LLaVA (CLIP vision tower, Llama language model), CLIPImageProcessor: shortest edge to ``image_size``, centre
    crop; (image_size / patch_size)² image tokens (the class token dropped)."""
    tokenizer = tiny_tokenizer()
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": image_size},
                                                      crop_size={"height": image_size, "width": image_size})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                            patch_size=patch_size, num_additional_image_tokens=1,
                                            vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=image_size, patch_size=patch_size,
                                           projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=tiny_llama_config(len(tokenizer)),
                                      image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                                      vision_feature_layer=-1, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    if token_local:
        zero_attention_outputs(model.model.vision_tower, "out_proj")
    return model, processor


def zero_attention_outputs(vision_encoder: torch.nn.Module, projection_name: str) -> None:
    """Zero the weight and bias of every linear layer named ``projection_name`` inside an attention module of
    ``vision_encoder``: attention then adds nothing to the residual stream, and each token sees its own patch."""
    zeroed = 0
    with torch.no_grad():
        for name, module in vision_encoder.named_modules():
            if name.rsplit(".", 1)[-1] == projection_name and isinstance(module, torch.nn.Linear):
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()
                zeroed += 1
    assert zeroed, f"no {projection_name} in the vision encoder"



def tiny_llava_next(*, token_local: bool = False, seed: int = 0, image_size: int = 32, patch_size: int = 8,
                    pinpoints: tuple[tuple[int, int], ...] = ((32, 64), (64, 32), (64, 64)), vision: str = "clip"
                    ) -> tuple[torch.nn.Module, Any]:
    """LLaVA-NeXT (Llama language model), LlavaNextImageProcessor: a base view resized to ``image_size``² and
    ``image_size``-pixel tiles of the best of ``pinpoints`` ((height, width) resolutions); a newline token after
    each row of the (unpadded) tiles. ``vision`` "clip": a CLIP tower, its class token dropped ("default" strategy);
    "siglip": a SigLIP tower (no class token), all its tokens kept ("full" strategy)."""
    tokenizer = tiny_tokenizer()
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        image_grid_pinpoints=[list(point) for point in pinpoints])
    towers = {"clip": (transformers.CLIPVisionConfig, "default", 1),
              "siglip": (transformers.SiglipVisionConfig, "full", 0)}
    tower, strategy, class_tokens = towers[vision]
    processor = transformers.LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                                patch_size=patch_size, num_additional_image_tokens=class_tokens,
                                                vision_feature_select_strategy=strategy, chat_template=CHAT_TEMPLATE)
    vision_config = tower(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          image_size=image_size, patch_size=patch_size)
    config = transformers.LlavaNextConfig(vision_config=vision_config, text_config=tiny_llama_config(len(tokenizer)),
                                          image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                                          image_grid_pinpoints=[list(point) for point in pinpoints],
                                          vision_feature_layer=-1, vision_feature_select_strategy=strategy,
                                          pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    if token_local:
        zero_attention_outputs(model.model.vision_tower, "out_proj")
    return model, processor


PALIGEMMA_CHAT_TEMPLATE = (
    "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% endif %}{% endfor %}"
    "{% endfor %}{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endfor %}"
)
"""PaliGemma has no chat: its prompt is the image tokens, then the text (the processor adds the begin-of-sequence
token after the last image token and a newline at the end, and writes image_seq_length tokens per ``<image>``)."""


def tiny_paligemma(*, token_local: bool = False, seed: int = 0, image_size: int = 32, patch_size: int = 8
                   ) -> tuple[torch.nn.Module, Any]:
    """PaliGemma (SigLIP vision tower without a class token, Gemma language model), SiglipImageProcessor: resized
    to ``image_size``² (the aspect not kept); (image_size / patch_size)² image tokens, all the patches."""
    tokenizer = tiny_tokenizer()
    image_processor = transformers.SiglipImageProcessor(size={"height": image_size, "width": image_size})
    image_processor.image_seq_length = (image_size // patch_size) ** 2
    processor = transformers.PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                                chat_template=PALIGEMMA_CHAT_TEMPLATE)  # adds <loc…>, <seg…> tokens
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=image_size, patch_size=patch_size,
                                             vision_use_head=False)
    text = transformers.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer),
                                    max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = transformers.PaliGemmaConfig(vision_config=vision, text_config=text, projection_dim=32, hidden_size=32,
                                          vocab_size=len(tokenizer),
                                          image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                                          pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    if token_local:
        zero_attention_outputs(model.model.vision_tower, "out_proj")
    return model, processor


class _Captured(Exception):
    """Stops a forward pass once the language model's input is read."""


def language_model_embeddings(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """(batch, sequence, hidden): what the language model receives, read by a pre-hook on the decoder (the forward
    stops there)."""
    captured = {}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        captured["embeds"] = kwargs["inputs_embeds"].detach().clone()
        raise _Captured

    handle = model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    except _Captured:
        pass
    finally:
        handle.remove()
    return captured["embeds"]


def image_token_embeddings(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """(batch, image tokens, hidden): what the language model receives at the image tokens' positions."""
    embeds = language_model_embeddings(model, inputs)
    mask = torch.as_tensor(inputs["input_ids"]) == model.config.image_token_id
    return embeds[mask].view(embeds.shape[0], -1, embeds.shape[-1])


def picture(height: int = 40, width: int = 52, seed: int = 0) -> Image.Image:
    """A random RGB test image of ``height`` × ``width`` pixels."""
    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8))
