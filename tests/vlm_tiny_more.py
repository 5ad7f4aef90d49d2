"""Tiny random-weight Qwen2-VL, Qwen2.5-VL, Idefics3 and SmolVLM models and their processors, built from configs.

Same pattern as ``vlm_tiny``: the character tokenizer with each family's special tokens, the family's own image
processor with small sizes, a chat template written for the character tokenizer. ``token_local=True`` zeroes every
attention output projection of the vision encoder, so each image token sees only its own pixels: for Qwen the
2×2 patch group the merger joins, for Idefics3/SmolVLM the scale_factor² patches the pixel shuffle joins.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from vlm_tiny import tiny_llama_config, tiny_tokenizer, zero_attention_outputs

QWEN_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><image><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""Qwen's prompt: the image token between vision start and end tokens."""

IDEFICS3_SPECIALS = ("<fake_token_around_image>", "<global-img>", "<end_of_utterance>", "<video>") + tuple(
    f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))
IDEFICS3_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}:{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
"""Idefics3's prompt: one ``<image>`` per image, which the processor expands into tiles and the global image."""


def _tokenizer(specials: tuple[str, ...]) -> transformers.PreTrainedTokenizerFast:
    """The character tokenizer with ``specials`` kept whole in text (registered as added special tokens)."""
    tokenizer = tiny_tokenizer(extra_specials=specials)
    return tokenizer


def _qwen_text_settings(vocab_size: int) -> dict[str, Any]:
    # head_dim 8: the multimodal rotary sections (temporal, height, width) share its 4 frequencies
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})


def _qwen_processor(processor_class: type, patch_size: int, min_pixels: int, max_pixels: int) -> Any:
    tokenizer = _tokenizer(QWEN_SPECIALS)
    image_processor = transformers.Qwen2VLImageProcessor(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                                                         min_pixels=min_pixels, max_pixels=max_pixels)
    video_processor = transformers.Qwen2VLVideoProcessor(patch_size=patch_size, merge_size=2, temporal_patch_size=2)
    return processor_class(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                           chat_template=QWEN_CHAT_TEMPLATE)


def _qwen_token_ids(tokenizer: Any) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    return dict(image_token_id=ids("<image>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def tiny_qwen2_vl(*, token_local: bool = False, seed: int = 0, patch_size: int = 8, min_pixels: int = 32 * 32,
                  max_pixels: int = 64 * 64) -> tuple[torch.nn.Module, Any]:
    """Qwen2-VL: images smart-resized to multiples of 2·patch_size with min_pixels ≤ h·w ≤ max_pixels; one token
    per 2×2 patch group (with the defaults a 40×50 image gives 32×48 pixels, 2×3 tokens)."""
    processor = _qwen_processor(transformers.Qwen2VLProcessor, patch_size, min_pixels, max_pixels)
    vision = transformers.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                                              patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2)
    text = transformers.Qwen2VLTextConfig(**_qwen_text_settings(len(processor.tokenizer)))
    config = transformers.Qwen2VLConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                        **_qwen_token_ids(processor.tokenizer))
    torch.manual_seed(seed)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    if token_local:
        zero_attention_outputs(model.model.visual.blocks, "proj")
    return model, processor


def tiny_qwen2_5_vl(*, token_local: bool = False, seed: int = 0, patch_size: int = 8, min_pixels: int = 32 * 32,
                    max_pixels: int = 64 * 64) -> tuple[torch.nn.Module, Any]:
    """Qwen2.5-VL: Qwen2-VL's geometry; the vision encoder attends within windows of 2×2 tokens except in its
    last block (full attention), and puts the tokens back in row order after the merger."""
    processor = _qwen_processor(transformers.Qwen2_5_VLProcessor, patch_size, min_pixels, max_pixels)
    vision = transformers.Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=32,
                                                 num_heads=2, patch_size=patch_size, spatial_merge_size=2,
                                                 temporal_patch_size=2, window_size=4 * patch_size,
                                                 fullatt_block_indexes=[1])
    text = transformers.Qwen2_5_VLTextConfig(**_qwen_text_settings(len(processor.tokenizer)))
    config = transformers.Qwen2_5_VLConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                           **_qwen_token_ids(processor.tokenizer))
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    if token_local:
        zero_attention_outputs(model.model.visual.blocks, "proj")
    return model, processor


def _idefics3_config(tokenizer: Any, tile: int, patch_size: int, scale_factor: int) -> dict[str, Any]:
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=tile,
                  patch_size=patch_size)
    return dict(vision_config=vision, text_config=tiny_llama_config(len(tokenizer)).to_dict(),
                scale_factor=scale_factor, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=0)


def tiny_idefics3(*, token_local: bool = False, seed: int = 0, tile: int = 64, longest_edge: int = 192,
                  patch_size: int = 16, scale_factor: int = 2) -> tuple[torch.nn.Module, Any]:
    """Idefics3: the image's longest edge resized to ``longest_edge``, both sides rounded up to multiples of
    ``tile``, cut into tiles (row by row) followed by the whole image squeezed to one tile; each tile gives
    (tile / patch_size / scale_factor)² tokens (with the defaults 2×2, a 200×260 image 3×3 tiles)."""
    tokenizer = _tokenizer(IDEFICS3_SPECIALS)
    image_processor = transformers.Idefics3ImageProcessor(size={"longest_edge": longest_edge},
                                                          max_image_size={"longest_edge": tile})
    processor = transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                               image_seq_len=(tile // patch_size // scale_factor) ** 2,
                                               chat_template=IDEFICS3_CHAT_TEMPLATE)
    config = transformers.Idefics3Config(**_idefics3_config(tokenizer, tile, patch_size, scale_factor))
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    if token_local:
        zero_attention_outputs(model.model.vision_model, "out_proj")
    return model, processor


def tiny_smolvlm(*, token_local: bool = False, seed: int = 0, tile: int = 64, longest_edge: int = 192,
                 patch_size: int = 16, scale_factor: int = 2) -> tuple[torch.nn.Module, Any]:
    """SmolVLM: Idefics3's geometry and prompt, its own classes (the processor needs the num2words package)."""
    tokenizer = _tokenizer(IDEFICS3_SPECIALS)
    image_processor = transformers.SmolVLMImageProcessor(size={"longest_edge": longest_edge},
                                                         max_image_size={"longest_edge": tile})
    video_processor = transformers.SmolVLMVideoProcessor(size={"longest_edge": longest_edge},
                                                         max_image_size={"longest_edge": tile})
    processor = transformers.SmolVLMProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                              video_processor=video_processor,
                                              image_seq_len=(tile // patch_size // scale_factor) ** 2,
                                              chat_template=IDEFICS3_CHAT_TEMPLATE)
    config = transformers.SmolVLMConfig(**_idefics3_config(tokenizer, tile, patch_size, scale_factor))
    torch.manual_seed(seed)
    model = transformers.SmolVLMForConditionalGeneration(config).eval()
    if token_local:
        zero_attention_outputs(model.model.vision_model, "out_proj")
    return model, processor
