"""Vision-language models: a map over the image for each generated token (``GenerationExplainer``), its figure and
hover page (``token_figure``, ``write_token_html``), and loading a HuggingFace model with its processor."""

from .generation import GenerationExplainer
from .hf import load_vision_language_model
from .layout import ImageLayout, TokenGrid
from .view import token_figure, token_positions, write_token_html

__all__ = ["GenerationExplainer", "ImageLayout", "TokenGrid", "load_vision_language_model", "token_figure",
           "token_positions", "write_token_html"]
