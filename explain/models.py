"""Load a model as users have it, for Python (``explain.load_model``) and the command line's ``--model``.

Sources:

- ``"demo"``, ``"demo-vit"``, ``"demo-vit2"``, ``"demo-watermark"``: the shipped CNN and transformers, and the CNN
  trained with a watermark on one class (``explain.data.demo_watermark``; no network);
- a torchvision model name (``"resnet50"``, also ``"torchvision:resnet50"``);
- ``"timm:NAME"``: a timm model (``timm.create_model``);
- ``"hf:ID_OR_DIRECTORY"``: a HuggingFace transformers model, the class its config names (else the
  Auto classes): an image classifier, a segmenter, or any other model (a bare backbone, CLIP)
  whose output to explain ``output=`` names;
- a file: a whole pickled model (only with ``allow_pickle=True``: unpickling runs code from the
  file); TorchScript files are refused (hooks do not run inside them).

Weights (``weights=``): None or ``"random"`` (random weights; the shipped models, a file and an
``hf:`` directory bring their own), a state-dict file for the named architecture (``.pt``,
``.pth``, ``.bin``, ``.safetensors``; wrappers such as ``{"state_dict": ...}`` and prefixes such
as ``module.`` are handled; ``num_classes=`` for a fine-tuned head), or a pretrained name
(``"DEFAULT"``, a torchvision weights name, or ``"pretrained"`` for timm), downloaded by its
library. A download that fails says so and how to pass a local file instead. The command line
asks for ``--weights`` where the architecture alone would be random (torchvision, timm).
Torchvision segmentation and detection models are built without their backbone's pretrained
weights unless pretrained weights are named (no download). An ``hf:`` directory whose weights
are pickled (``pytorch_model.bin``) is loaded only with ``allow_pickle=True``; the class that
its config's ``architectures`` names is built (a segmenter keeps its decode head).

Each model comes with its own preprocessing (torchvision ``weights.transforms()``, timm's data
config, the HF image processor) and class names (the weights' metadata, the timm or HF config's
labels), both of which can be overridden.
"""

from __future__ import annotations

import difflib
import inspect
import json
import math
import numbers
import os
import pickle
import re
import socket
import urllib.request
import zipfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union
from urllib.parse import urlsplit

import torch
import torchvision
from torch import nn

from .core.targets import OutputSelector, model_class_names
from .data.demo import DemoNet, load_demo_model
from .data.demo_detector import DETECTOR_CAM_LAYER, DemoDetector, load_demo_detector
from .data.demo_vit import DemoViT, load_demo_vit
from .data.demo_vit2 import DemoViT2, load_demo_vit2
from .data.demo_watermark import load_watermark_demo
from .data.synthetic import CLASS_NAMES
from .io.inputs import ImageProcessorPreprocess, Normalize, Preprocess, TransformPreprocess, resizing_preprocess
from .io.loaded_model import LoadedModel

STATE_DICT_WRAPPERS = ("state_dict", "model_state_dict", "model", "module", "net", "ema")
PREFIXES = ("module.", "model.", "_orig_mod.")
PRETRAINED_NAMES = ("DEFAULT", "pretrained")
RANDOM_WEIGHTS = "random"
PICKLED_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
HF_TASK_HEADS = {"ForImageClassification": "classification", "ForSemanticSegmentation": "segmentation",
                 "ForObjectDetection": "detection"}
"""The endings of HuggingFace task model class names, and the task each names."""
DEMO_MODELS: dict[str, tuple[type[nn.Module], Callable[[], nn.Module]]] = {
    "demo": (DemoNet, load_demo_model), "demo-vit": (DemoViT, load_demo_vit), "demo-vit2": (DemoViT2, load_demo_vit2),
    "demo-watermark": (DemoNet, load_watermark_demo), "demo-detector": (DemoDetector, load_demo_detector)}
"""The shipped models: name → (architecture, loader of the trained weights)."""
SOURCES_TEXT = ("'demo', 'demo-vit', 'demo-vit2', 'demo-watermark', 'demo-detector', a torchvision model name "
                "(resnet50), 'timm:NAME' (timm:vit_small_patch16_224), 'hf:ID_OR_DIRECTORY' (a HuggingFace model), "
                "'yolo:FILE' (an Ultralytics YOLO .yaml or .pt) or a file holding a whole model")
YOLO_INPUT_SIZE = 640
"""The input size of the Ultralytics YOLO models: images resized to 640 × 640, RGB in [0, 1] (no mean or std)."""


HUB_PROBE_SECONDS = 3.0
"""How long ``hub_offline_when_unreachable`` waits for the HuggingFace hub to answer before loading from the cache
alone, and a torchvision weights download for its server to accept a connection (``url_reachable``)."""


def hub_reachable(timeout: float = HUB_PROBE_SECONDS) -> bool:
    """Whether the HuggingFace hub (``HF_ENDPOINT``, huggingface.co by default) answers one request within
    ``timeout`` seconds, through the hub client's own session (its proxies and certificates). Any answer counts,
    an error status too; no answer (no network, no name resolution, a firewall) does not."""
    try:
        from huggingface_hub import constants, get_session
    except ImportError:
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout, follow_redirects=False)
    except Exception:  # any failure to get an answer (connection, DNS, timeout, TLS) means no hub
        return False
    return True


def url_reachable(url: str, timeout: float = HUB_PROBE_SECONDS) -> bool:
    """Whether the server of ``url`` accepts a connection within ``timeout`` seconds (torch's download, which
    torchvision's weights use, has no timeout: on a network that drops connections it would wait forever)."""
    parts = urlsplit(url)
    if not parts.hostname:
        return False
    proxy = urllib.request.getproxies().get(parts.scheme)  # a proxy the download would go through: probe it instead
    if proxy and not urllib.request.proxy_bypass(parts.hostname):
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError:  # no network, no name resolution, a firewall, no answer in time
        return False
    return True


@contextmanager
def hub_offline_when_unreachable() -> Iterator[bool]:
    """Within the block, the HuggingFace hub client in offline mode when the hub does not answer within
    ``HUB_PROBE_SECONDS`` (``hub_reachable``): files already in its cache still load, and a file that is not fails
    at once instead of after the client's retries (five per file with back-off, about 50 s for timm's two
    candidate files). Yields whether the hub was found unreachable. Already offline (``HF_HUB_OFFLINE=1``): left
    as it is. The setting is the client's, for the whole process, while the block runs."""
    try:
        from huggingface_hub import constants
    except ImportError:
        yield False
        return
    if constants.is_offline_mode() or hub_reachable():
        yield False
        return
    earlier = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield True
    finally:
        constants.HF_HUB_OFFLINE = earlier


class WeightsUnavailableError(RuntimeError):
    """Pretrained weights that could not be downloaded or read, or a file that cannot be loaded."""


def load_model(
    source: Union[str, "os.PathLike[str]"],
    weights: Union[str, "os.PathLike[str]", None] = None,
    *,
    num_classes: Optional[int] = None,
    output: OutputSelector = None,
    allow_pickle: bool = False,
    class_names: Union[str, Path, Sequence[str], None] = None,
    size: Union[int, Sequence[int], None] = None,
    mean: Union[float, Sequence[float], None] = None,
    std: Union[float, Sequence[float], None] = None,
) -> LoadedModel:
    """Load a model from any source (see the module's docstring), in eval mode.

    weights: None or "random" (random weights), a state-dict file, or a pretrained name ("DEFAULT",
        "pretrained", a torchvision weights name). num_classes: the number of classes of a
        fine-tuned head (torchvision, timm).
    output: which part of the output to explain (an HF backbone's "pooler_output", ...).
    allow_pickle: load a whole pickled model from a file, or an hf: directory's pickled weights
        (pytorch_model.bin) (unpickling can run code from the file: trusted files only).
    class_names: a list of names, or a text file (one name per line, or a JSON list).
    size: S or (S,) resize the shorter side to S and centre-crop S × S, or (H, W) resize to exactly
        H × W (a torchvision ViT without pretrained weights is built for S × S); mean, std: per-channel
        normalisation in [0, 1] units (one value for all channels, or three). Each replaces the model's own.
    Raises WeightsUnavailableError when weights cannot be downloaded or read, with the fix.
    """
    source = os.fspath(source)
    weights = None if weights is None else os.fspath(weights)
    size, mean, std = _checked_preprocessing(size, mean, std)
    if num_classes is not None and num_classes < 1:
        raise ValueError(f"num_classes must be at least 1; got {num_classes}.")
    if weights == RANDOM_WEIGHTS and source.startswith("hf:"):
        raise ValueError(f"weights={RANDOM_WEIGHTS!r} is for an architecture (a torchvision or timm name); "
                         f"{source!r} brings its own weights.")
    if num_classes is not None and not (source.startswith(("timm:", "torchvision:", "yolo:"))
                                        or source in torchvision.models.list_models() or source in DEMO_MODELS):
        raise ValueError(f"num_classes goes with an architecture (a torchvision or timm name, or a shipped model with "
                         f"a weights file); {source!r} brings its own classifier.")
    if source in DEMO_MODELS:
        loaded = _load_demo(source, weights, num_classes, allow_pickle)
    elif source.startswith("timm:"):
        loaded = _load_timm(source.removeprefix("timm:"), weights, num_classes, allow_pickle)
    elif source.startswith("yolo:"):
        loaded = _load_ultralytics(source.removeprefix("yolo:"), weights, num_classes, allow_pickle)
    elif source.startswith("hf:"):
        loaded = _load_huggingface(source.removeprefix("hf:"), weights, output, allow_pickle)
    elif source.startswith("torchvision:") or source in torchvision.models.list_models():
        loaded = _load_torchvision(source.removeprefix("torchvision:"), weights, num_classes, allow_pickle, size)
    elif Path(source).expanduser().is_file():
        if weights is not None:
            raise ValueError(f"{source!r} is a whole model, with its own weights: leave out weights (--weights), or "
                             "name its architecture with the weights file: --model resnet18 --weights FILE.")
        loaded = _load_whole_model(Path(source).expanduser(), allow_pickle)
    else:
        raise ValueError(_unknown_source_message(source))
    if output is not None:
        loaded.output = output
    if class_names is not None:
        loaded.class_names = read_class_names(class_names)
    if loaded.class_names is not None:
        check_class_count(loaded.class_names, loaded.model)
    if size is not None or mean is not None or std is not None:
        loaded.preprocess = resizing_preprocess(loaded.preprocess, size, mean, std)
        if size is not None:
            loaded.input_size = (3, *_size_pair(size))
    loaded.model.eval()
    return loaded


Statistics = Optional[tuple[float, ...]]


def _checked_preprocessing(size: Union[int, Sequence[int], None], mean: Union[float, Sequence[float], None],
                           std: Union[float, Sequence[float], None]
                           ) -> tuple[Optional[tuple[int, ...]], Statistics, Statistics]:
    """size, mean and std as tuples (a single number as one value), checked: sizes whole numbers ≥ 1, mean in
    [0, 1] and std in (0, 1] (the units of an image in [0, 1]: 0–255 statistics would give a meaningless map)."""
    def values(name: str, given: Any) -> Optional[tuple[Any, ...]]:
        if given is None:
            return None
        if isinstance(given, numbers.Real):
            return (given,)
        if isinstance(given, str) or not isinstance(given, Sequence):
            raise TypeError(f"{name} takes a number or a sequence of numbers; got {given!r}.")
        return tuple(given)

    sizes, means, stds = values("size", size), values("mean", mean), values("std", std)
    if sizes is not None and (len(sizes) not in (1, 2) or any(
            isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1 for value in sizes)):
        raise ValueError(f"--size takes S (shorter side, centre crop S × S) or H W, whole numbers of at least 1; got "
                         f"{list(sizes)} (size=).")
    for name, statistics in (("mean", means), ("std", stds)):
        if statistics is None:
            continue
        if len(statistics) not in (1, 3):
            raise ValueError(f"--{name} takes 1 or 3 values (one per RGB channel); got {len(statistics)} ({name}=).")
        if any(isinstance(value, bool) or not isinstance(value, numbers.Real) for value in statistics):
            raise TypeError(f"--{name} takes numbers; got {list(statistics)} ({name}=).")
        lowest = 0.0 if name == "mean" else math.nextafter(0.0, 1.0)  # a mean may be 0, a std may not
        if not all(math.isfinite(value) and lowest <= value <= 1.0 for value in statistics):
            scaled = (" Statistics in 0–255 units, such as ImageNet's 123.7 116.3 103.5, are given divided by 255 "
                      "(0.485 0.456 0.406)." if any(math.isfinite(value) and value > 1 for value in statistics) else "")
            raise ValueError(f"--{name} values lie in {'[0, 1]' if name == 'mean' else '(0, 1]'}, in the units of an "
                             f"image in [0, 1]; got {list(statistics)} ({name}=).{scaled}")
    return (None if sizes is None else tuple(int(value) for value in sizes),
            None if means is None else tuple(float(value) for value in means),
            None if stds is None else tuple(float(value) for value in stds))


def names_an_architecture(source: str) -> bool:
    """Whether a source names a known torchvision or timm architecture, whose weights are random
    unless weights are given (the shipped models, ``hf:`` models and model files bring their own)."""
    if source.startswith("timm:"):
        try:
            import timm
        except ImportError:
            return False
        name = source.removeprefix("timm:")
        return timm.is_model(name)
    return source.removeprefix("torchvision:") in torchvision.models.list_models()


def weights_choices(source: str) -> str:
    """The ``--weights`` values an architecture takes, as a sentence: its pretrained names, a file, random."""
    name = source.removeprefix("torchvision:").removeprefix("timm:")
    choices = []
    if source.startswith("timm:"):
        choices.append("--weights pretrained (timm's trained weights, downloaded from the HuggingFace hub)")
    else:
        enum = _weights_enum(name)
        if enum is not None:
            names = ", ".join(member.name for member in enum)
            choices.append(f"--weights DEFAULT (torchvision's trained weights, downloaded; or a weights name: {names})")
    choices.append("--weights FILE (your state dict: .pt, .pth, .bin, .safetensors)")
    choices.append(f"--weights {RANDOM_WEIGHTS} (random weights: the maps and classes mean nothing; to try the "
                   "command)")
    return "; ".join(choices)


# ---------------------------------------------------------------- sources


def _load_demo(name: str, weights: Optional[str], num_classes: Optional[int] = None,
               allow_pickle: bool = False) -> LoadedModel:
    architecture, load_trained = DEMO_MODELS[name]
    head: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    model: nn.Module
    if weights is None:
        if num_classes is not None:
            raise ValueError(f"num_classes goes with a weights file for {name!r} (a fine-tuned copy); the shipped "
                             f"weights have {len(CLASS_NAMES)} classes.")
        model = load_trained()
    elif weights == RANDOM_WEIGHTS:
        model = architecture(**head)
    elif weights in PRETRAINED_NAMES and not Path(weights).expanduser().is_file():
        raise ValueError(f"{name!r} is a shipped model and comes with its trained weights: leave out --weights "
                         f"(weights=), or give {RANDOM_WEIGHTS!r} or a state-dict file of a copy you trained.")
    else:
        model = architecture(**head)
        load_state_dict(model, read_state_dict(Path(weights).expanduser(), allow_pickle), weights, name)
    names = list(CLASS_NAMES) if num_classes in (None, len(CLASS_NAMES)) else None
    if name == "demo-detector":  # synthetic scenes of 96 px (explain.data.detection_scenes)
        return LoadedModel(model, Normalize(), names, name, input_size=(3, 96, 96), default_layer=DETECTOR_CAM_LAYER,
                           task="detection", random_weights=weights == RANDOM_WEIGHTS)
    return LoadedModel(model, Normalize(), names, name, input_size=(3, 64, 64),
                       default_layer="layer4" if name == "demo" else None, random_weights=weights == RANDOM_WEIGHTS)


def _weights_enum(name: str) -> Any:
    try:
        return torchvision.models.get_model_weights(name)
    except (ValueError, KeyError):
        return None


def _torchvision_weights(model_name: str, weights: str) -> Any:
    enum = _weights_enum(model_name)
    if "." in weights and not weights.startswith("."):
        if weights.count(".") != 1:  # not Enum.MEMBER: a file name
            raise FileNotFoundError(f"no weights file at {weights!r}.")
        try:
            chosen = torchvision.models.get_weight(weights)
        except (ValueError, KeyError, AttributeError):
            chosen = None
        if enum is not None and isinstance(chosen, enum):
            return chosen
        known = "" if enum is None else f" {model_name} takes {enum.__name__}: " + ", ".join(
            f"{enum.__name__}.{member.name}" for member in enum) + "."
        what = "weights of another architecture" if chosen is not None else "not torchvision weights"
        raise ValueError(f"--weights {weights!r} are {what}, and no such file exists.{known}")
    if enum is None:
        raise ValueError(f"torchvision has no pretrained weights for {model_name!r}; give a state-dict file.")
    try:
        return enum[weights]
    except KeyError:
        known = ", ".join(["DEFAULT"] + [member.name for member in enum])
        raise ValueError(
            f"{model_name!r} has no weights named {weights!r}; known: {known}, or give a path to a file."
        ) from None


def _vision_transformer_size(name: str, size: Optional[Sequence[int]]) -> dict[str, Any]:
    """The ``image_size`` that builds a torchvision ViT (whose position embeddings fix its input size) for --size S,
    or {} for another model or no size; an error for a size the ViT cannot take (not square, not whole patches)."""
    if size is None or not name.startswith("vit_"):
        return {}
    height, width = _size_pair(size)
    match = re.search(r"_(\d+)$", name)  # vit_b_16: patches of 16 px
    patch = int(match.group(1)) if match else 1
    if height != width or height % patch:
        raise ValueError(f"{name} takes square inputs of whole {patch}-pixel patches: give --size S (size=) with S a "
                         f"multiple of {patch}, e.g. {max(patch, round(height / patch) * patch)}; got {list(size)}.")
    return {"image_size": height}


def _load_torchvision(name: str, weights: Optional[str], num_classes: Optional[int],
                      allow_pickle: bool = False, size: Optional[Sequence[int]] = None) -> LoadedModel:
    if name not in torchvision.models.list_models():
        raise ValueError(_unknown_source_message(name))
    enum = _weights_enum(name)
    chosen = enum.DEFAULT if enum is not None else None  # its transforms and categories
    head: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    weights = None if weights == RANDOM_WEIGHTS else weights
    if weights is None or _is_weights_file(weights):
        head.update(_vision_transformer_size(name, size))
        # segmentation and detection builders download their backbone's ImageNet weights by default
        parameters = inspect.signature(torchvision.models.get_model_builder(name)).parameters
        if "weights_backbone" in parameters:
            head["weights_backbone"] = None
        model = torchvision.models.get_model(name, weights=None, **head)
        if weights is not None:
            load_state_dict(model, read_state_dict(Path(weights).expanduser(), allow_pickle), weights, name)
    else:
        if num_classes is not None:
            raise ValueError(f"--num-classes {num_classes} goes with a fine-tuned state-dict file, not with the "
                             f"pretrained weights {weights!r} (their head has its own classes).")
        chosen = _torchvision_weights(name, weights)
        filename = chosen.url.rsplit("/", 1)[-1]
        advice = (f"This machine may have no network. Download {chosen.url} on a machine that has, copy it here and "
                  f"pass its path: --weights /path/to/{filename}")
        cached = Path(torch.hub.get_dir()) / "checkpoints" / filename
        if not cached.is_file() and not url_reachable(chosen.url):
            raise WeightsUnavailableError(f"could not download the {chosen} weights for {name}: "
                                          f"{urlsplit(chosen.url).hostname} could not be reached (no answer within "
                                          f"{HUB_PROBE_SECONDS:g} s). "
                                          f"{advice}")
        try:
            model = torchvision.models.get_model(name, weights=chosen)
        except Exception as error:  # URLError, OSError, SSL errors: no network
            raise WeightsUnavailableError(
                f"could not download the {chosen} weights for {name} ({type(error).__name__}: {error}). {advice}"
            ) from error
    task = ("segmentation" if name in torchvision.models.list_models(module=torchvision.models.segmentation)
            else "detection" if name in torchvision.models.list_models(module=torchvision.models.detection)
            else "classification")
    categories = chosen.meta.get("categories") if chosen is not None else None
    classes = count_segmentation_classes(model) if task == "segmentation" else count_outputs(model)
    names = list(categories) if categories is not None and len(categories) == classes else None
    preprocess: Preprocess
    if chosen is not None:
        preprocess = TransformPreprocess(chosen.transforms())
    elif task == "detection":  # torchvision's detectors take [0, 1] pixels and normalise inside
        preprocess = Normalize((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    else:  # ImageNet's statistics: a guess, as for a bare model (no [0, 1] tensor warning)
        preprocess = Normalize(assumed=True)
    crop = getattr(chosen.transforms(), "crop_size", None) if chosen is not None else None
    size = (3, int(crop[0]), int(crop[0])) if crop else None
    return LoadedModel(model, preprocess, names, name, input_size=size, task=task, random_weights=weights is None)


def _load_timm(name: str, weights: Optional[str], num_classes: Optional[int],
               allow_pickle: bool = False) -> LoadedModel:
    try:
        import timm
        import timm.data
    except ImportError:
        raise ValueError("timm models need the timm package: pip install timm") from None
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
        hint = f" Did you mean {', '.join('timm:' + c for c in close)}?" if close else ""
        raise ValueError(f"timm has no model named {name!r}.{hint}")
    head: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    pretrained = weights in PRETRAINED_NAMES
    weights = None if weights == RANDOM_WEIGHTS else weights
    if weights is not None and not pretrained and not _is_weights_file(weights):
        raise ValueError(f"--weights {weights!r} for a timm model: give a state-dict file, or 'pretrained' "
                         "(downloaded by timm from the HuggingFace hub).")
    try:
        with hub_offline_when_unreachable() if pretrained else nullcontext(False) as unreachable:
            model = timm.create_model(name, pretrained=pretrained, **head)
    except (OSError, RuntimeError) as error:
        if not pretrained:
            raise
        cause = ("the HuggingFace hub did not answer within "
                 f"{HUB_PROBE_SECONDS:g} s and the weights are not in its cache" if unreachable else
                 f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        raise WeightsUnavailableError(
            f"could not download timm's pretrained weights for {name} ({cause}). This machine may have no "
            "network. Download the weights "
            f"(model.safetensors of https://huggingface.co/timm/{name}) on a machine that has, copy the file here "
            "and pass its path: --weights /path/to/model.safetensors"
        ) from error
    if weights is not None and not pretrained:
        load_state_dict(model, read_state_dict(Path(weights).expanduser(), allow_pickle), weights, f"timm:{name}")
    config = timm.data.resolve_model_data_config(model)
    preprocess = TransformPreprocess(timm.data.create_transform(**config), config["mean"], config["std"])
    return LoadedModel(model, preprocess, model_class_names(model), f"timm:{name}",
                       input_size=tuple(config["input_size"]), random_weights=weights is None)


def _load_huggingface(identifier: str, weights: Optional[str], output: OutputSelector,
                      allow_pickle: bool = False) -> LoadedModel:
    try:
        import transformers
    except ImportError:
        raise ValueError("HuggingFace models need the transformers package: pip install transformers") from None
    if weights is not None:
        raise ValueError("an hf: model brings its own weights (the directory's or the hub's); --weights is for "
                         "torchvision and timm architectures.")
    local = Path(identifier).expanduser()
    where = str(local) if local.is_dir() else identifier
    spelled_as_path = identifier.startswith(("/", ".", "~")) or "\\" in identifier or identifier.count("/") > 1
    if spelled_as_path and not local.is_dir():
        raise FileNotFoundError(f"no directory at {identifier!r}: an hf: folder is what model.save_pretrained(DIR) "
                                "writes (a hub id is written owner/name).")
    if local.is_dir() and not (local / "config.json").is_file():
        raise WeightsUnavailableError(f"the folder {str(local)!r} has no config.json: it should hold what "
                                      "model.save_pretrained(DIR) writes (config.json and model.safetensors).")
    if local.is_dir() and not allow_pickle:
        _refuse_pickled_weights(local)
    try:
        with nullcontext(False) if local.is_dir() else hub_offline_when_unreachable():  # a hub id: no long retries
            config = transformers.AutoConfig.from_pretrained(where)
            model_class = _huggingface_model_class(transformers, config)
            # pickled weights (pytorch_model.bin) only when trusted; a hub id offering only those then fails
            model = model_class.from_pretrained(where, use_safetensors=None if allow_pickle else True)
    except OSError as error:
        first = _first_line(error)
        if local.is_dir():
            raise WeightsUnavailableError(
                f"could not load the HuggingFace model in {str(local)!r} ({first}). The directory should hold what "
                "model.save_pretrained(DIR) writes (config.json and model.safetensors): save it again."
            ) from error
        raise WeightsUnavailableError(
            f"could not load the HuggingFace model {identifier!r} ({first}). A hub id needs the network: on a "
            "machine that has it, save the model and its processor with model.save_pretrained(DIR) and "
            "processor.save_pretrained(DIR), copy DIR here and pass --model hf:DIR. A model whose hub weights are "
            "only pickled (pytorch_model.bin) is loaded with --allow-pickle (allow_pickle=True) if you trust it."
        ) from error
    except ValueError as error:  # an architecture the Auto classes do not know
        raise ValueError(f"transformers cannot build {identifier!r} with its Auto classes: {error}") from None
    except Exception as error:  # a damaged weights file: safetensors' SafetensorError, a torch.load error
        if type(error).__name__ != "SafetensorError" and not isinstance(error, (pickle.UnpicklingError, EOFError)):
            raise
        raise WeightsUnavailableError(
            f"could not read the weights of the HuggingFace model {identifier!r} ({_first_line(error)}): the file "
            "is damaged or incomplete (an interrupted download or copy?). Save or download the model again."
        ) from error
    architecture = type(model).__name__
    task = next((name for suffix, name in HF_TASK_HEADS.items() if architecture.endswith(suffix)), "other")
    if task == "other" and output is None:
        raise ValueError(
            f"{identifier!r} is a {architecture}, not an image classifier: say which output to explain, "
            "e.g. --output pooler_output (an embedding; --target is then a feature index) or --output "
            "image_embeds; in Python, use explain.EmbeddingSimilarity as the target."
        )
    size = getattr(getattr(model.config, "vision_config", model.config), "image_size", None)
    input_size = (3, size, size) if isinstance(size, int) else None
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(where)
        preprocess: Preprocess = ImageProcessorPreprocess(processor)
    except (OSError, ValueError):  # no preprocessor_config.json: the config's size, ImageNet statistics
        preprocess = Normalize() if size is None else resizing_preprocess(Normalize(), (size, size), None, None)
    return LoadedModel(model, preprocess, model_class_names(model), f"hf:{identifier}", output=output,
                       input_size=input_size, task=task)


def _huggingface_model_class(transformers: Any, config: Any) -> Any:
    """The class that the config's ``architectures`` names, so that the model is the one saved
    (AutoModel would drop a segmenter's decode head, or CLIPVisionModelWithProjection's
    projection); else that task's Auto class for a classifier, segmenter or detector transformers
    does not know; AutoModelForImageClassification when none is named; AutoModel otherwise."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        return transformers.AutoModelForImageClassification
    for architecture in architectures:
        model_class = getattr(transformers, architecture, None)
        if isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel):
            return model_class
    for architecture in architectures:
        for head in HF_TASK_HEADS:
            if architecture.endswith(head):
                return getattr(transformers, f"AutoModel{head}")
    return transformers.AutoModel


def _refuse_pickled_weights(directory: Path) -> None:
    """Refuse an hf: directory whose weights are pickled only (pytorch_model.bin): unpickling can run code."""
    files = [path for path in directory.iterdir() if path.is_file()]
    if any(path.suffix == ".safetensors" for path in files):
        return
    pickled = sorted(path.name for path in files if path.suffix in PICKLED_WEIGHT_SUFFIXES)
    if pickled:
        raise ValueError(
            f"the HuggingFace model in {str(directory)!r} holds its weights as a pickle ({', '.join(pickled)}): "
            "unpickling can run code from the file, so it is loaded only when you trust it: add --allow-pickle "
            "(allow_pickle=True). Or convert it once: model.save_pretrained(DIR) writes model.safetensors."
        )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200]}" if text else type(error).__name__


def _load_whole_model(path: Path, allow_pickle: bool) -> LoadedModel:
    if is_torchscript(path):
        raise TypeError(
            f"{str(path)!r} is a TorchScript archive: forward hooks do not run inside scripted or traced code, so "
            "no layer can be explained. Load the original nn.Module (its class and a state dict) instead."
        )
    if not allow_pickle:
        raise ValueError(
            f"--model {str(path)!r} is a file: a whole pickled model. Unpickling runs code from the file, so it "
            "is loaded only when you say you trust it: add --allow-pickle (allow_pickle=True). For a state dict, "
            "name the architecture instead: --model resnet18 --weights FILE [--num-classes N]."
        )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=False)
    except (AttributeError, ModuleNotFoundError, ImportError) as error:  # the pickled model's class is not here
        raise WeightsUnavailableError(
            f"{str(path)!r} holds a whole model whose class cannot be imported here ({_first_line(error)}): the module "
            "that defines it must be importable (on PYTHONPATH, as when it was saved). Or save a state dict instead "
            "and name the architecture: --model ARCH --weights FILE."
        ) from error
    except Exception as error:  # empty, truncated or not a torch file
        raise WeightsUnavailableError(
            f"could not read a model from {str(path)!r} ({_first_line(error)}): the file is empty, damaged or not "
            "written by torch.save. Save it again."
        ) from error
    if isinstance(loaded, dict):
        loaded = next((value for value in loaded.values() if isinstance(value, nn.Module)), loaded)
    if not isinstance(loaded, nn.Module):
        raise WeightsUnavailableError(
            f"{str(path)!r} holds a {type(loaded).__name__}, not a model; for a state dict (or a training checkpoint) "
            "name the architecture: --model ARCH --weights FILE (with --allow-pickle for a checkpoint that holds "
            "more than tensors)."
        )
    return LoadedModel(loaded, Normalize(assumed=True), None, path.name)


def _load_ultralytics(spec: str, weights: Optional[str], num_classes: Optional[int], allow_pickle: bool
                      ) -> LoadedModel:
    """An Ultralytics YOLOv8 / YOLO11 detector: built from its .yaml with random weights (``num_classes`` classes,
    80 by default), or its network read from a .pt checkpoint (a pickle: with allow_pickle only)."""
    try:
        from ultralytics.nn.tasks import DetectionModel
    except ImportError as error:
        raise ImportError("'yolo:' models need the ultralytics package. It declares the non-headless opencv-python, "
                          "so install it without its dependencies: pip install --no-deps ultralytics && pip install "
                          "pyyaml requests psutil polars ultralytics-thop") from error
    if weights is not None:
        raise ValueError(f"'yolo:{spec}' brings its own weights (a .pt) or none (a .yaml: random weights); leave out "
                         "weights (--weights).")
    random_weights = spec.endswith((".yaml", ".yml"))
    if random_weights:
        model: nn.Module = DetectionModel(spec, nc=num_classes or 80, verbose=False)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no YOLO checkpoint at {spec!r}: give a .pt file, or a model .yaml (e.g. "
                                    "yolo:yolov8n.yaml) for random weights.")
        if not allow_pickle:
            raise ValueError(f"{spec} is a pickled Ultralytics checkpoint: loading it can run code from the file. If "
                             "you trust it, pass allow_pickle=True (--allow-pickle).")
        from ultralytics import YOLO

        checkpoint: Any = YOLO(str(path))
        model = checkpoint.model
        if num_classes is not None:
            raise ValueError("num_classes goes with a .yaml (random weights); a checkpoint has its own classes.")
    names = getattr(model, "names", None)
    class_names = [str(names[index]) for index in sorted(names)] if isinstance(names, dict) else None
    preprocess = resizing_preprocess(Normalize(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)),
                                     (YOLO_INPUT_SIZE, YOLO_INPUT_SIZE), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    return LoadedModel(model.float().eval(), preprocess, class_names, f"yolo:{spec}",
                       input_size=(3, YOLO_INPUT_SIZE, YOLO_INPUT_SIZE), default_layer=None, task="detection",
                       random_weights=random_weights)


def _unknown_source_message(source: str) -> str:
    torchvision_names = torchvision.models.list_models()
    close = difflib.get_close_matches(source, torchvision_names, n=4, cutoff=0.6)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    try:
        import timm

        if source in timm.list_models():
            hint = f" {source!r} is a timm model: --model timm:{source}."
    except ImportError:
        pass
    if "/" in source and not Path(source).exists():
        hint += f" For a HuggingFace model: --model hf:{source}."
    if (Path(source).expanduser() / "config.json").is_file():
        hint += f" {source!r} is a HuggingFace folder: --model hf:{source}."
    return f"unknown model {source!r}: use {SOURCES_TEXT}.{hint}"


# ---------------------------------------------------------------- weights files


def _is_weights_file(weights: str) -> bool:
    """Whether --weights names a file (existing, or spelled like a path: then a missing file is an error)."""
    path = Path(weights).expanduser()
    if path.is_file():
        return True
    if any(separator in weights for separator in ("/", "\\")) or path.suffix in (".pt", ".pth", ".bin", ".tar",
                                                                                 ".safetensors", ".ckpt", ".pkl"):
        raise FileNotFoundError(f"no weights file at {weights!r}.")
    return False


def is_torchscript(path: Path) -> bool:
    """Whether a file is a TorchScript archive (torch.jit.save), whose zip holds compiled code."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.split("/", 1)[-1].startswith(("code/", "constants.pkl")) for name in archive.namelist())


def _is_safetensors(path: Path) -> bool:
    """Whether a file is a safetensors file, whatever its suffix: an 8-byte header length, then a JSON object."""
    try:
        with path.open("rb") as file:
            start = file.read(9)
    except OSError:
        return False
    return len(start) == 9 and start[8:9] == b"{" and 0 < int.from_bytes(start[:8], "little") < path.stat().st_size


def read_state_dict(path: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """A state dict from a file (torch.save or safetensors), unwrapped from {"state_dict": ...} and
    similar, with ``module.`` / ``model.`` / ``_orig_mod.`` prefixes removed. Never unpickles code unless
    ``allow_pickle`` (a training checkpoint that holds numpy values or its options beside the weights)."""
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {str(path)!r}.")
    if is_torchscript(path):
        raise TypeError(f"{str(path)!r} is a TorchScript archive, not a state dict: forward hooks do not run inside "
                        "TorchScript. Save the original model's state dict: torch.save(model.state_dict(), path).")
    if path.suffix == ".safetensors" or _is_safetensors(path):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state: Any = load_file(str(path))
        except (SafetensorError, OSError) as error:
            raise WeightsUnavailableError(
                f"could not read weights from {str(path)!r} ({_first_line(error)}): it is not a complete safetensors "
                "file (an interrupted download or copy?). Download or save it again: "
                "safetensors.torch.save_file(model.state_dict(), path)."
            ) from error
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
        except pickle.UnpicklingError as error:
            raise WeightsUnavailableError(
                f"{str(path)!r} holds pickled Python objects beside tensors (a training checkpoint with numpy values "
                "or its options). If you trust it, add --allow-pickle (allow_pickle=True) to read its weights; a "
                "whole model saved with torch.save(model, path) is given as the model itself, not as weights. Or "
                "save a state dict: torch.save(model.state_dict(), path)."
            ) from error
        except Exception as error:  # zip, format and encoding errors of any kind
            raise WeightsUnavailableError(
                f"could not read weights from {str(path)!r} ({_first_line(error)}): give a state "
                "dict saved with torch.save(model.state_dict(), path)."
            ) from error
    for _ in range(3):  # {"state_dict": {...}}, {"model": {"state_dict": ...}}
        inner = next((state[key] for key in STATE_DICT_WRAPPERS if isinstance(state, dict)
                      and isinstance(state.get(key), dict)), None)
        if inner is None:
            break
        state = inner
    if isinstance(state, nn.Module):
        raise WeightsUnavailableError(
            f"{str(path)!r} holds a whole model ({type(state).__name__}), not a state dict: give it as the model, "
            f"--model {str(path)} --allow-pickle, without --weights; or save its weights, "
            "torch.save(model.state_dict(), path).")
    if not isinstance(state, dict) or not any(isinstance(value, torch.Tensor) for value in state.values()):
        raise WeightsUnavailableError(f"{str(path)!r} does not hold a state dict (got {type(state).__name__}).")
    tensors = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
    stripped = True
    while stripped:  # torch.compile around DDP: "_orig_mod.module.", in either order
        stripped = False
        for prefix in PREFIXES:
            if tensors and all(key.startswith(prefix) for key in tensors):
                tensors = {key.removeprefix(prefix): value for key, value in tensors.items()}
                stripped = True
    return tensors


def _without_prefixes(key: str) -> str:
    stripped = True
    while stripped:
        stripped = False
        for prefix in PREFIXES:
            if key.startswith(prefix):
                key, stripped = key.removeprefix(prefix), True
    return key


def load_state_dict(model: nn.Module, state: dict[str, torch.Tensor], weights: str, name: str) -> None:
    """Load weights into a model, or say in a few lines which keys or shapes do not fit (and the
    number of classes the file's head has, for ``--num-classes``). The whole file is tried, then only the keys that
    carry a wrapper's prefix (an AveragedModel's ``n_averaged`` or a Lightning module's loss buffers sit beside
    ``module.*`` / ``model.*``): the first that fits the model exactly is loaded."""
    prefixed = {_without_prefixes(key): value for key, value in state.items() if _without_prefixes(key) != key}
    candidates = [state, prefixed] if prefixed and len(prefixed) < len(state) else [state]
    errors: list[RuntimeError] = []
    for candidate in candidates:
        try:
            model.load_state_dict(candidate)
            return
        except RuntimeError as error:
            errors.append(error)
    details = [line.strip() for line in str(errors[0]).splitlines() if line.strip()][1:4]
    hint = ""
    head = _head_classes(model, state)
    if head is not None:
        hint = f" The file's classifier has {head} classes: add --num-classes {head} (num_classes={head})."
    raise WeightsUnavailableError(
        f"the weights in {weights!r} do not fit the {name} model (were they saved from another "
        f"architecture, or with another number of classes?): {' '.join(details)[:400]}{hint}"
    ) from errors[0]


def _head_classes(model: nn.Module, state: dict[str, torch.Tensor]) -> Optional[int]:
    """The file's number of classes where the model's last linear layer has another and every other key fits."""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name
    if last is None or f"{last}.weight" not in state:
        return None
    expected = model.state_dict()
    misfits = {key for key in expected if key not in state or state[key].shape != expected[key].shape}
    misfits |= {key for key in state if key not in expected}
    if any(not key.startswith(f"{last}.") for key in misfits):  # another architecture, not only another head
        return None
    rows = int(state[f"{last}.weight"].shape[0])
    return rows if rows != count_outputs(model) else None


def count_outputs(model: nn.Module) -> Optional[int]:
    """The out_features of the model's last linear layer (its number of classes, for a classifier)."""
    last_linear = None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            last_linear = module
    return None if last_linear is None else last_linear.out_features


def count_segmentation_classes(model: nn.Module) -> Optional[int]:
    """The out_channels of the last convolution of a torchvision segmentation model's ``classifier``
    (its number of classes, one score map each)."""
    last_convolution = None
    for module in getattr(model, "classifier", nn.Identity()).modules():
        if isinstance(module, nn.Conv2d):
            last_convolution = module
    return None if last_convolution is None else last_convolution.out_channels


# ---------------------------------------------------------------- class names


def read_class_names(names: Union[str, Path, Sequence[str]]) -> list[str]:
    """Class names from a list, or from a file: a JSON list, or one name per line."""
    if not isinstance(names, (str, Path)):
        listed = [str(name) for name in names]
        if not listed:
            raise ValueError("class_names is empty: give one name per class, in the order of the model's outputs "
                             "(or None for the model's own names).")
        return listed
    path = Path(names).expanduser()
    if path.is_dir():
        raise IsADirectoryError(f"the class-names file {str(path)!r} is a folder: give a text file with one name per "
                                "line, or a JSON list.")
    if not path.is_file():
        raise FileNotFoundError(f"no class-names file at {str(path)!r}.")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (Windows editors) is not part of a name
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise ValueError(f"the class-names file {str(path)!r} is not UTF-8 text ({error.reason} at byte "
                         f"{error.start}, line {line}): save it as UTF-8, one name per line.") from None
    if text.lstrip().startswith("["):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{str(path)!r} looks like JSON but is not: {error}") from None
        if not isinstance(loaded, list):
            raise ValueError(f"{str(path)!r} must hold a JSON list of names, or one name per line.")
        found = [str(name) for name in loaded]
    else:
        found = [line.strip() for line in text.splitlines() if line.strip()]
    if not found:
        raise ValueError(f"the class-names file {str(path)!r} holds no names: write one name per line (or a JSON "
                         "list), in the order of the model's outputs.")
    return found


def check_class_count(names: Sequence[str], model: nn.Module) -> None:
    outputs = count_outputs(model)
    if outputs is not None and len(names) != outputs:
        raise ValueError(f"{len(names)} class names for a model whose last layer has {outputs} outputs; give one "
                         "name per class, in the order of the outputs.")


def _size_pair(size: Sequence[int]) -> tuple[int, int]:
    return (int(size[0]), int(size[0])) if len(size) == 1 else (int(size[0]), int(size[1]))


__all__ = ["LoadedModel", "WeightsUnavailableError", "names_an_architecture", "load_model", "read_class_names",
           "read_state_dict", "weights_choices"]

