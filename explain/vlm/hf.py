"""Loading a HuggingFace vision-language model and its processor from ``hf:DIRECTORY`` or ``hf:HUB_ID``.

A directory is what ``model.save_pretrained(DIR)`` and ``processor.save_pretrained(DIR)`` write (config.json, the
weights as model.safetensors, the tokenizer and image processor files). A hub id is fetched by transformers into its
cache (or read from the cache), which needs the network the first time.
"""

from __future__ import annotations

import pickle
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from ..models import WeightsUnavailableError, _first_line, _refuse_pickled_weights, hub_offline_when_unreachable

VLM_AUTO_CLASSES = ("AutoModelForImageTextToText", "AutoModelForVision2Seq")
"""The transformers Auto classes that build a vision-language model, tried in this order (the second is the older
name, gone from transformers 5)."""

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The names that ``dtype`` may be given by."""


def load_vision_language_model(
    source: str,
    *,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
    allow_pickle: bool = False,
) -> tuple[nn.Module, Any]:
    """Load ``source``, "hf:DIRECTORY" or "hf:HUB_ID", as ``(model, processor)``: the model built by
    ``AutoModelForImageTextToText`` (``AutoModelForVision2Seq`` in older transformers), in eval mode, on ``device``
    (None: where it loads, the CPU) in ``dtype`` (a torch dtype or "float32", "float16", "bfloat16"; None: the
    saved one as transformers reads it, float32 for most), and its ``AutoProcessor``.

    allow_pickle: read weights that are only pickled (pytorch_model.bin); unpickling can run code from the file.
    Raises ValueError for a source that is not "hf:...", a folder that holds no model, a model that is not a
    vision-language model, or a folder without the processor; WeightsUnavailableError when the weights cannot be
    read or a hub id cannot be fetched (download it first, or pass a local directory).
    """
    try:
        import transformers
    except ImportError:
        raise ValueError("vision-language models need the transformers package: pip install transformers") from None
    identifier = _identifier(source)
    torch_dtype = _dtype(dtype)
    target_device = None if device is None else torch.device(device)
    local = Path(identifier).expanduser()
    where = str(local) if local.is_dir() else identifier
    if local.is_dir():
        _check_directory(local, allow_pickle)
    elif _looks_like_a_path(identifier):
        raise ValueError(f"hf:{identifier}: there is no directory {str(local.resolve())!r}. Give the directory that "
                         "model.save_pretrained(DIR) and processor.save_pretrained(DIR) wrote.")
    with nullcontext(False) if local.is_dir() else hub_offline_when_unreachable():  # a hub id: no long retries
        model, processor = _model_and_processor(transformers, where, identifier, local, torch_dtype, allow_pickle)
    model.eval()
    if target_device is not None:
        model.to(target_device)
    return model, processor


def _model_and_processor(transformers: Any, where: str, identifier: str, local: Path,
                         torch_dtype: Optional[torch.dtype], allow_pickle: bool) -> tuple[nn.Module, Any]:
    """The model (``_auto_class`` of its config) and its processor, from ``where`` (a directory or a hub id)."""
    try:
        config = transformers.AutoConfig.from_pretrained(where)
    except OSError as error:
        raise _unavailable(identifier, local, error) from error
    except ValueError as error:  # a config.json naming a model type transformers does not know
        raise ValueError(f"transformers cannot read the config of {identifier!r}: {_first_line(error)}. A newer "
                         "transformers may know this model (pip install -U transformers).") from None
    auto_class = _auto_class(transformers, config, identifier)
    options: dict[str, Any] = {"use_safetensors": None if allow_pickle else True}
    if torch_dtype is not None:  # transformers 4.56 renamed torch_dtype to dtype
        options["dtype" if _transformers_at_least(transformers, (4, 56)) else "torch_dtype"] = torch_dtype
    try:
        model = auto_class.from_pretrained(where, **options)
    except OSError as error:
        raise _unavailable(identifier, local, error) from error
    except Exception as error:  # a damaged weights file: safetensors' SafetensorError, a torch.load error
        if type(error).__name__ != "SafetensorError" and not isinstance(error, (pickle.UnpicklingError, EOFError)):
            raise
        raise WeightsUnavailableError(
            f"could not read the weights of {identifier!r} ({_first_line(error)}): the file is damaged or incomplete "
            "(an interrupted download or copy?). Save or download the model again.") from error
    processor = _processor(transformers, where, identifier)
    return model, processor


def _identifier(source: str) -> str:
    """The directory or hub id of "hf:...", or a ValueError saying how to write it."""
    if not isinstance(source, str):
        raise TypeError(f"the model source must be a string such as 'hf:DIRECTORY'; got {type(source).__name__}.")
    if not source.startswith("hf:") or not source.removeprefix("hf:").strip():
        hint = f" (write hf:{source})" if source and Path(source).expanduser().is_dir() else ""
        raise ValueError(f"vision-language models are loaded from hf:DIRECTORY or hf:HUB_ID; got {source!r}{hint}.")
    return source.removeprefix("hf:").strip()


def _dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)} (or a torch dtype).")


def _looks_like_a_path(identifier: str) -> bool:
    """Whether ``identifier`` is written as a file-system path rather than a hub id ("name" or "owner/name")."""
    return identifier.startswith(("/", ".", "~")) or identifier.count("/") > 1 or "\\" in identifier


def _check_directory(directory: Path, allow_pickle: bool) -> None:
    """A ValueError when ``directory`` holds no saved model (no config.json), or only pickled weights unless
    ``allow_pickle``."""
    if not (directory / "config.json").is_file():
        present = sorted(path.name for path in directory.iterdir())[:8]
        found = f"it holds {', '.join(present)}" if present else "it is empty"
        raise ValueError(
            f"{str(directory)!r} holds no HuggingFace model: there is no config.json ({found}). Save the model and "
            "its processor there with model.save_pretrained(DIR) and processor.save_pretrained(DIR).")
    if not allow_pickle:
        _refuse_pickled_weights(directory)


def _unavailable(identifier: str, local: Path, error: BaseException) -> WeightsUnavailableError:
    """The error for a model whose files could not be read (a directory) or fetched (a hub id)."""
    if local.is_dir():
        return WeightsUnavailableError(
            f"could not load the model in {str(local)!r} ({_first_line(error)}). The directory should hold what "
            "model.save_pretrained(DIR) writes (config.json and model.safetensors): save it again.")
    return WeightsUnavailableError(
        f"could not fetch {identifier!r} from the HuggingFace hub, nor find it in the local cache "
        f"({_first_line(error)}). Download it first where there is network: "
        f"`huggingface-cli download {identifier}` (into the cache), or save it with model.save_pretrained(DIR) and "
        "processor.save_pretrained(DIR) and pass hf:DIR (a local directory).")


def _auto_class(transformers: Any, config: Any, identifier: str) -> Any:
    """The first Auto class of ``VLM_AUTO_CLASSES`` (those this transformers has) that builds ``config``'s model;
    a ValueError naming the model when none does."""
    classes = [getattr(transformers, name) for name in VLM_AUTO_CLASSES if hasattr(transformers, name)]
    for auto_class in classes:
        if type(config) in auto_class._model_mapping:
            return auto_class
    architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architecture named"
    raise ValueError(
        f"{identifier!r} is not a vision-language model: its config is a {type(config).__name__} "
        f"(model type {config.model_type!r}; {architectures}), which {' and '.join(VLM_AUTO_CLASSES[:len(classes)])} "
        "do not build. Give a model that generates text from an image and a prompt (LLaVA, LLaVA-NeXT, "
        "Qwen2-VL, Idefics3, PaliGemma, ...); image classifiers are explained with `explain IMAGE --model hf:DIR`.")


def _processor(transformers: Any, where: str, identifier: str) -> Any:
    """The model's AutoProcessor, with an image processor and a tokenizer; a ValueError saying what is missing."""
    fix = ("save it there with processor.save_pretrained(DIR) (the processor of the model: "
           "AutoProcessor.from_pretrained(HUB_ID) where there is network)")
    try:
        processor = transformers.AutoProcessor.from_pretrained(where)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"{identifier!r} has the model but its processor could not be loaded "
                         f"({_first_line(error)}): {fix}.") from None
    missing = [part for part in ("image_processor", "tokenizer") if getattr(processor, part, None) is None]
    if missing:
        raise ValueError(f"{identifier!r} has the model but no full processor (AutoProcessor gave a "
                         f"{type(processor).__name__}, without {' and '.join(missing)}): {fix}.")
    return processor


def _transformers_at_least(transformers: Any, version: tuple[int, int]) -> bool:
    parts = transformers.__version__.split(".")[:2]
    return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in parts) >= version
