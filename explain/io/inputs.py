"""Inputs: a path, PIL image, ndarray or tensor (or a list of them) → a model batch and display images.

Images (paths, PIL, ndarrays) are RGB, turned into float tensors in [0, 1] and
passed through a ``preprocess`` callable (default: ImageNet mean/std
normalisation, size kept); for a model whose first convolution takes 1 channel
(``explain.core.capture.model_input_channels``) grayscale images stay 1-channel instead, and colour
images are refused. Float tensors are taken as already preprocessed model
input; uint8 tensors, channels first ((3, H, W) or (N, 3, H, W), as
``torchvision.io.read_image`` gives), are images of 0-255 pixels like uint8
ndarrays, and go through the preprocess. For every input the toolkit keeps a display image, (H, W, 3) float in
[0, 1] at the batch's resolution, on which heatmaps are drawn.

Arrays are read as RGB: OpenCV's ``cv2.imread`` gives BGR, which no check can tell from RGB; pass
``image[..., ::-1]`` (or ``cv2.cvtColor(image, cv2.COLOR_BGR2RGB)``), or the path itself.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor, nn

from ..core.caller import warn_at_callers_line
from ..core.checks import check

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

ImageInput = Union[str, bytes, "os.PathLike[str]", Image.Image, np.ndarray, Tensor]
"""One input: a path (str, bytes or a path object), a PIL image, an (H, W, 3) ndarray, a (C, H, W) or
(N, C, H, W) float tensor of model input, or a (3, H, W) or (N, 3, H, W) uint8 tensor of pixels."""
Inputs = Union[ImageInput, Sequence[ImageInput]]
"""What ``explain()`` takes: one input or a list of them."""
PreprocessSpec = Optional[Callable[..., Any]]
"""What ``preprocess=`` takes: None (ImageNet mean/std normalisation), a callable RGB PIL image →
(C, H, W) tensor (torchvision's ``weights.transforms()``), or a HuggingFace image processor."""

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
"""The file suffixes read as images in a folder (any case)."""


class Normalize:
    """The default preprocess: RGB image → (3, H, W) float tensor, ``(x - mean) / std``, size kept.

    Accepts a PIL image, an (H, W, 3) ndarray, a (3, H, W) float tensor in [0, 1] or a (3, H, W)
    uint8 tensor (0-255).
    Its ``mean`` and ``std`` are also used to turn model input back into a display image.
    """

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, *,
                 assumed: bool = False):
        self.mean = tuple(float(value) for value in mean)
        self.std = tuple(float(value) for value in std)
        self.assumed = assumed
        """Whether nothing stated this normalisation (``preprocess=None``): the model may take [0, 1] pixels
        (its normalisation inside), so float tensors in [0, 1] are not warned about, and are shown as they are."""

    def __call__(self, image: Union[Image.Image, np.ndarray, Tensor]) -> Tensor:
        if isinstance(image, Tensor) and image.is_floating_point():
            tensor = _checked_unit_tensor(image)
        else:
            tensor = image_to_tensor(image)
        mean = torch.tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return (tensor - mean) / std

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std})"

    def grayscale(self) -> "Normalize":
        """This normalisation for 1-channel images (a 1-channel model's): the mean and std averaged over the
        channels (ImageNet's: 0.449, 0.226)."""
        return Normalize((sum(self.mean) / len(self.mean),), (sum(self.std) / len(self.std),), assumed=self.assumed)


def _conversion_hint(array: np.ndarray) -> str:
    """How to turn an image array of another dtype into uint8 or float [0, 1] values."""
    if array.dtype == np.bool_:
        return "A mask is no image: for black and white, array.astype(np.uint8) * 255."
    if (np.issubdtype(array.dtype, np.integer) and array.dtype != np.uint16 and array.size
            and int(array.min()) >= 0 and int(array.max()) <= 255):
        return "Its values lie in 0-255: array.astype(np.uint8)."
    return "Scale it yourself, e.g. 16-bit images as (array / 65535).astype('float32')."


UNIT_ROUNDING = 1e-3
"""How far outside [0, 1] float image values may stray (rounding of de-normalised model input) before they are
refused as being on another scale (0-255)."""


def outside_unit_range(values: Tensor) -> bool:
    """Whether float image values leave [0, 1] by more than UNIT_ROUNDING (0-255 values, normalised input)."""
    return bool(values.numel()) and (float(values.min()) < -UNIT_ROUNDING or float(values.max()) > 1 + UNIT_ROUNDING)


def _checked_unit_tensor(image: Tensor) -> Tensor:
    """A float (C, H, W) or (N, C, H, W) image tensor for Normalize: 1 or 3 channels first, values in [0, 1]."""
    shape = tuple(image.shape)
    if image.dim() not in (3, 4) or shape[-3] not in (1, 3):
        hint = " It looks channels-last: move the channels first (permute)." if shape[-1:] == (3,) else ""
        raise ValueError(f"Normalize takes a (3, H, W) or (N, 3, H, W) float tensor in [0, 1]; got shape "
                         f"{shape}.{hint}")
    if outside_unit_range(image):
        raise ValueError(f"Normalize takes a float tensor in [0, 1]; this one spans [{float(image.min()):.4g}, "
                         f"{float(image.max()):.4g}]. Divide 0-255 values by 255 (or give a uint8 tensor).")
    return image


class Preprocess(Protocol):
    """What ``preprocess=`` takes: an RGB PIL image → a (C, H, W) float tensor of model input.

    ``mean`` and ``std`` (per channel, in [0, 1] units), when the object has them, turn model
    input back into display images; torchvision's ``weights.transforms()`` has them.
    """

    def __call__(self, image: Image.Image) -> Tensor: ...


def _normalize_statistics(transform: object) -> tuple[Optional[tuple[float, ...]], Optional[tuple[float, ...]]]:
    """(mean, std) of a transform: its own attributes, or those of a Normalize step inside a Compose."""
    mean, std = getattr(transform, "mean", None), getattr(transform, "std", None)
    if mean is not None and std is not None:
        return tuple(float(v) for v in mean), tuple(float(v) for v in std)
    for step in getattr(transform, "transforms", []):
        mean, std = _normalize_statistics(step)
        if mean is not None:
            return mean, std
    return None, None


class TransformPreprocess:
    """A torchvision-style transform (PIL image → tensor: ``weights.transforms()``, timm's
    ``create_transform``) as a preprocess, with the ``mean``/``std`` it normalises by."""

    def __init__(self, transform: Callable[[Image.Image], Tensor], mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None):
        self.transform = transform
        found_mean, found_std = _normalize_statistics(transform)
        self.mean = tuple(float(v) for v in mean) if mean is not None else found_mean
        self.std = tuple(float(v) for v in std) if std is not None else found_std

    def __call__(self, image: Image.Image) -> Tensor:
        return self.transform(image)

    def __repr__(self) -> str:
        return f"TransformPreprocess({self.transform!r})"


class ImageProcessorPreprocess:
    """A HuggingFace image processor (``AutoImageProcessor``, ``CLIPImageProcessor``, ...) as a
    preprocess: PIL image → its ``pixel_values`` (C, H, W), with the processor's mean and std."""

    def __init__(self, processor: Any):
        self.processor = processor
        normalizes = getattr(processor, "do_normalize", True)
        mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
        if not normalizes:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        self.mean = None if mean is None else tuple(float(v) for v in mean)
        self.std = None if std is None else tuple(float(v) for v in std)

    def __call__(self, image: Image.Image) -> Tensor:
        pixels = self.processor(images=image, return_tensors="pt")["pixel_values"]
        return pixels[0] if pixels.dim() == 4 else pixels

    def __repr__(self) -> str:
        return f"ImageProcessorPreprocess({type(self.processor).__name__})"


def is_image_processor(value: object) -> bool:
    """Whether ``value`` is a HuggingFace image processor (or a processor holding one)."""
    module = type(value).__module__ or ""
    return module.startswith("transformers.") and hasattr(value, "image_mean") or (
        module.startswith("transformers.") and hasattr(getattr(value, "image_processor", None), "image_mean"))


def as_preprocess(value: PreprocessSpec, model: Optional[nn.Module] = None) -> Preprocess:
    """``preprocess=`` as given: None → ``Normalize(assumed=True)`` (ImageNet's statistics), or for a ``model`` that
    takes [0, 1] pixels and normalises them inside (``takes_unit_pixels``: torchvision's detectors, YOLO) the pixels
    as they are, ``Normalize((0, 0, 0), (1, 1, 1))``; a HuggingFace image processor (or a ``CLIPProcessor``, whose
    image processor is used) → ``ImageProcessorPreprocess``; any other callable as it is."""
    if value is None:
        return Normalize((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)) if takes_unit_pixels(model) else Normalize(assumed=True)
    if is_image_processor(value):
        return ImageProcessorPreprocess(getattr(value, "image_processor", None) or value)
    if not callable(value):
        raise TypeError(f"preprocess must be a callable (PIL image → tensor) or a HuggingFace image processor; "
                        f"got {type(value).__name__}.")
    return value


class Renormalized:
    """Another preprocess with its normalisation replaced: ``(base(image) · std₀ + mean₀ − mean) / std``."""

    def __init__(self, base: Preprocess, mean: Sequence[float], std: Sequence[float]):
        self.base = base
        self.base_mean, self.base_std = _normalize_statistics(base)
        if self.base_mean is None or self.base_std is None:
            raise ValueError("--mean/--std without --size need the model's preprocess to state its mean and std; "
                             "give --size too.")
        self.mean, self.std = tuple(float(v) for v in mean), tuple(float(v) for v in std)

    def __call__(self, image: Image.Image) -> Tensor:
        values = self.base(image)
        shape = (-1, 1, 1)
        unit = values * torch.tensor(self.base_std).view(shape) + torch.tensor(self.base_mean).view(shape)
        return (unit - torch.tensor(self.mean).view(shape)) / torch.tensor(self.std).view(shape)


def resizing_preprocess(base: Preprocess, size: Optional[Sequence[int]], mean: Optional[Sequence[float]],
                        std: Optional[Sequence[float]]) -> Preprocess:
    """The command line's --size / --mean / --std applied to a model's preprocess.

    size: (S,) shorter side resized to S then centre-cropped to S × S; (H, W) resized to exactly
    H × W; None keeps the base's geometry. mean, std: per-channel statistics in [0, 1] units;
    None keeps the base's (ImageNet's when it states none).
    """
    for name, values in (("mean", mean), ("std", std)):
        if values is not None and len(values) not in (1, 3):
            raise ValueError(f"--{name} takes 1 or 3 values; got {len(values)}.")
        if name == "std" and values is not None and min(values) <= 0:
            raise ValueError(f"--std values must be positive; got {list(values)}.")
    base_mean, base_std = _normalize_statistics(base)
    mean = tuple(mean) * (3 // len(mean)) if mean is not None else (base_mean or IMAGENET_MEAN)
    std = tuple(std) * (3 // len(std)) if std is not None else (base_std or IMAGENET_STD)
    if size is None:
        return Renormalized(base, mean, std)
    if len(size) not in (1, 2) or min(size) < 1:
        raise ValueError(f"--size takes S (shorter side, centre crop S × S) or H W, each at least 1; got {list(size)}.")
    from torchvision import transforms

    steps: list[Callable[..., Any]] = (
        [transforms.Resize(int(size[0])), transforms.CenterCrop(int(size[0]))] if len(size) == 1
        else [transforms.Resize((int(size[0]), int(size[1])))])
    steps += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    return TransformPreprocess(transforms.Compose(steps), mean, std)


def list_image_files(folder: Union[str, "os.PathLike[str]"], exclude: Optional[Union[str, "os.PathLike[str]"]] = None
                     ) -> tuple[list[Path], list[Path]]:
    """The image files under ``folder``, and the symbolic links with an image file's name that lead to no file (their
    target missing, or a loop of links), which are left out, each list sorted: the one listing of a folder's images
    (``explain batch``, the concept atlas, TCAV's and CRAFT's image sets). An image file is a file whose name ends in
    one of ``IMAGE_SUFFIXES`` (any case), or a link to one; sub-folders are listed too, recursively and into linked
    folders (as torchvision's ``ImageFolder`` goes: a class folder may be a symbolic link; each folder once, so that
    a link to a folder above cannot loop); hidden files and files in hidden folders (a name starting with ".":
    ``.ipynb_checkpoints/``, ``.git/``, macOS' ``._photo.jpg``), and files under ``exclude`` (an output folder inside
    the input folder), are left out. FileNotFoundError where ``folder`` is no folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no folder at {os.fsdecode(folder)!r}.")
    excluded = Path(exclude).resolve() if exclude is not None else None
    files: list[Path] = []
    broken: list[Path] = []
    visited: set[Path] = set()
    for root, folders, names in os.walk(folder, followlinks=True):
        real = Path(root).resolve()
        if real in visited or (excluded is not None and real.is_relative_to(excluded)):
            folders.clear()
            continue
        visited.add(real)
        folders[:] = [name for name in folders if not name.startswith(".")]
        for name in names:
            path = Path(root) / name
            if name.startswith(".") or path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            if path.is_file():
                if excluded is None or not path.resolve().is_relative_to(excluded):
                    files.append(path)
            elif path.is_symlink() and not path.exists():  # its target missing, or a loop of links
                broken.append(path)
    return sorted(files), sorted(broken)


def folder_images(folder: Union[str, "os.PathLike[str]"]) -> list[Path]:
    """The image files of ``folder``, as ``explain batch`` lists a folder (``list_image_files``:
    by suffix in any case, sub-folders included, hidden files and folders left out, sorted); its symbolic links with
    an image's name that lead to no file are left out with a warning; refused where it holds no image file: the
    listing of TCAV's, CRAFT's and concept references' image folders."""
    files, broken = list_image_files(folder)
    links = "; ".join(f"{os.fsdecode(path)!r} → {os.fsdecode(os.readlink(path))!r}" for path in broken[:3])
    links += f"; and {len(broken) - 3} more" if len(broken) > 3 else ""
    if not files:
        raise ValueError(f"{os.fsdecode(folder)} holds no image files ({', '.join(sorted(IMAGE_SUFFIXES))}, in it or "
                         "its sub-folders; hidden ones, whose name starts with '.', are left out)"
                         + (f"; {len(broken)} broken symbolic link(s) with such a name: {links}" if broken else "")
                         + ".")
    if broken:
        warn_at_callers_line(f"{os.fsdecode(folder)}: {len(broken)} broken symbolic link(s) with an image's name lead "
                             f"to no file and are left out of its images: {links}.")
    return files


def open_image(path: Union[str, "os.PathLike[str]"]) -> Image.Image:
    """``PIL.Image.open``, as Pillow defines it. Importing Ultralytics replaces ``PIL.Image.open`` in the whole
    process with a function that, on a file Pillow cannot identify, installs and imports the pi-heif package instead
    of raising ``PIL.UnidentifiedImageError`` (a ModuleNotFoundError offline, a pip install online): a broken file is
    then not reported as one. This calls Pillow's own function, which Ultralytics keeps as ``_image_open``."""
    opener = Image.open
    module = sys.modules.get(getattr(opener, "__module__", "") or "")
    if module is not None and module.__name__.startswith("ultralytics"):
        opener = getattr(module, "_image_open", opener)
    return opener(path)


def load_image(path: Union[str, bytes, "os.PathLike[str]"]) -> Image.Image:
    """Open an image file as an RGB PIL image, turned as viewers show it (its EXIF orientation applied: a phone
    photo stored sideways is explained upright); palette, grayscale and CMYK files are converted. The file is
    closed before this returns (the first frame of an animation is kept)."""
    return _checked_rgb(_read_image(path), source=os.fsdecode(path))


def _read_image(path: Union[str, bytes, "os.PathLike[str]"]) -> Image.Image:
    """An image file as a PIL image in its own mode, upright (see ``load_image``); a path as str, bytes (as ``open``
    takes it) or a path object."""
    text = os.fsdecode(path)
    if "://" in text:
        raise ValueError(f"{text!r} is a URL; explain reads local files only and downloads nothing. Download it "
                         "first (e.g. urllib.request.urlretrieve(url, 'image.jpg')) and pass the file, or pass the "
                         "image opened as a PIL image.")
    path = Path(text)
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a folder, not an image file. Pass the image files (e.g. "
                                "sorted(Path(folder).glob('*.jpg'))), or run `explain batch FOLDER --model MODEL "
                                "--out OUT` for a whole folder.")
    if not path.is_file():
        raise FileNotFoundError(f"no image file at {str(path)!r}.")
    try:
        with open_image(path) as opened:
            opened.load()
            image = upright(opened)
    except Image.DecompressionBombError as error:
        raise ValueError(f"{str(path)!r} was not read: {error} If you trust the file, raise PIL's limit first, "
                         "e.g. PIL.Image.MAX_IMAGE_PIXELS = None.") from error
    except (OSError, SyntaxError) as error:  # PIL raises SyntaxError for some malformed headers
        raise ValueError(f"{str(path)!r} could not be read as an image: {error}") from error
    return image


def upright(image: Image.Image) -> Image.Image:
    """A copy of ``image`` turned and mirrored as its EXIF orientation tag says (as viewers show it)."""
    turned = ImageOps.exif_transpose(image)
    return turned if turned is not None else image.copy()


def _checked_rgb(image: Image.Image, source: str = "the image") -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        raise ValueError(
            f"{source} has an alpha channel (mode {image.mode}); the model needs RGB. Composite it on "
            "a background first, e.g. image.convert('RGB') (drops transparency) or "
            "Image.alpha_composite(white_background, image).convert('RGB')."
        )
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        raise ValueError(
            f"{source} has {image.mode} pixels (16/32-bit), which cannot be mapped to RGB without "
            "choosing a range. Scale it yourself, e.g. to a float ndarray in [0, 1] with 3 channels."
        )
    return image.convert("RGB")  # grayscale, palette, CMYK, YCbCr: unambiguous conversions


def _colour_for_grayscale_model(source: str) -> ValueError:
    return ValueError(
        f"{source} is a colour (RGB) image, and the model takes 1-channel (grayscale) images (its first convolution "
        "has in_channels=1). Convert it to grayscale first, e.g. image.convert('L') for a PIL image, or "
        "np.asarray(Image.fromarray(array).convert('L')) for a uint8 array; or pass model input as a float "
        "(1, H, W) tensor.")


def _checked_gray(image: Image.Image, source: str = "the image") -> Image.Image:
    """A PIL image as mode "L", for a 1-channel model: grayscale images as they are, RGB images whose three channels
    are equal taken as the gray image they hold; colour images refused (a ValueError saying how to convert)."""
    if image.mode in ("L", "1"):
        return image.convert("L")
    rgb = np.asarray(_checked_rgb(image, source))  # alpha and 16-bit images refused as for RGB models
    if not (rgb == rgb[..., :1]).all():
        raise _colour_for_grayscale_model(source)
    return Image.fromarray(np.ascontiguousarray(rgb[..., 0]), mode="L")


def _pixel_tensor_as_array(pixels: Tensor) -> np.ndarray:
    """A uint8 tensor of pixels, channels first ((3, H, W), (1, H, W)) or (H, W), → an (H, W, C) or (H, W) ndarray."""
    if pixels.dim() == 3 and pixels.shape[0] in (1, 3):
        return pixels.detach().permute(1, 2, 0).cpu().numpy()
    if pixels.dim() == 3 and pixels.shape[0] == 4:
        raise ValueError("a uint8 tensor of 4 channels (RGBA); the model needs RGB: drop or composite the alpha "
                         "channel first, e.g. pixels[:3].")
    if pixels.dim() == 2:
        return pixels.detach().cpu().numpy()
    shape = tuple(pixels.shape)
    hint = (" It looks channels-last: make it channels first (x.permute(2, 0, 1) for an image, x.permute(0, 3, 1, 2) "
            "for a batch), or pass it as an ndarray."
            if pixels.dim() == 3 and pixels.shape[-1] in (1, 3, 4) else "")
    raise ValueError(f"a uint8 tensor is taken as an image's 0-255 pixels, channels first: (3, H, W) or (N, 3, H, W) "
                     f"as torchvision.io.read_image gives, or (H, W) grayscale; got shape {shape}.{hint}")


def image_to_tensor(image: Union[Image.Image, np.ndarray, Tensor], channels: int = 3) -> Tensor:
    """A PIL image, an (H, W), (H, W, 1) or (H, W, 3) ndarray, or a channels-first (3, H, W) uint8
    tensor → (3, H, W) float32 tensor in [0, 1], or (1, H, W) with ``channels=1`` (a 1-channel model's).

    uint8 arrays and tensors are divided by 255; float arrays must already lie in [0, 1]. Arrays are RGB: one from
    OpenCV (BGR) is passed as ``image[..., ::-1]``.
    Grayscale arrays are repeated to three channels (kept on one with ``channels=1``, where colour
    images are refused); other channel counts, 16-bit arrays and out-of-range floats are refused with an error.
    """
    if isinstance(image, Image.Image):
        checked = _checked_gray if channels == 1 else _checked_rgb
        array = np.asarray(checked(image, source="the PIL image"))
    elif isinstance(image, Tensor):
        array = _pixel_tensor_as_array(image)
    else:
        array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3):
        counted = f" with {array.shape[2]} channels" if array.ndim == 3 else ""
        hint = " (RGBA: drop or composite the alpha channel)" if array.ndim == 3 and array.shape[2] == 4 else ""
        layout = ("It looks channels-first: pass array.transpose(1, 2, 0) (a float tensor would be taken as "
                  "model input, not normalised)." if array.ndim == 3 and array.shape[0] in (1, 3)
                  else "")
        raise ValueError(
            f"an image array must be (H, W, 3) RGB, or (H, W) grayscale; got shape {array.shape}{counted}{hint}. "
            + layout
        )
    if array.dtype == np.uint8:
        tensor = torch.from_numpy(array.astype(np.float32)) / 255.0
    elif np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all():
            raise ValueError("the image array contains NaN or inf values.")
        low, high = float(array.min()), float(array.max())
        if low < 0.0 or high > 1.0:
            raise ValueError(
                f"a float image array must lie in [0, 1]; this one spans [{low:.3g}, {high:.3g}]. "
                "Divide by 255 (for 0-255 values) or pass model-ready data as a tensor."
            )
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))
    else:
        raise ValueError(
            f"image arrays must be uint8 (0-255) or float in [0, 1]; got dtype {array.dtype}. "
            + _conversion_hint(array)
        )
    tensor = tensor.permute(2, 0, 1)
    if channels == 1 and tensor.shape[0] == 3:
        if not bool((tensor == tensor[:1]).all()):
            raise _colour_for_grayscale_model("the image array")
        tensor = tensor[:1]
    elif channels != 1 and tensor.shape[0] == 1:
        tensor = tensor.expand(3, -1, -1)
    return tensor.contiguous()


def display_from_model_input(batch: Tensor, preprocess: object = None) -> Tensor:
    """Model input (N, C, H, W) → display images (N, H, W, 3) float in [0, 1] on the CPU.

    Undoes the preprocess's ``mean``/``std`` when it has them and the channel
    count matches; otherwise rescales each image to [0, 1] by its min and max. With the assumed default
    (``Normalize(assumed=True)``, no preprocess given), an image whose values lie in [0, 1] is shown as it is: [0, 1]
    pixels of a model that normalises inside.
    """
    batch = batch.detach().to("cpu", torch.float32)
    channels = batch.shape[1]
    if isinstance(preprocess, Normalize) and channels == 1:  # how it normalises a 1-channel model's images
        preprocess = preprocess.grayscale()
    mean, std = getattr(preprocess, "mean", None), getattr(preprocess, "std", None)
    if mean is not None and std is not None and len(mean) == channels == len(std):
        images = batch * torch.tensor(std).view(1, -1, 1, 1) + torch.tensor(mean).view(1, -1, 1, 1)
        if getattr(preprocess, "assumed", False):
            pixels = (batch.amin(dim=(1, 2, 3)) >= -UNIT_ROUNDING) & (batch.amax(dim=(1, 2, 3)) <= 1 + UNIT_ROUNDING)
            images = torch.where(pixels.view(-1, 1, 1, 1), batch, images)
    else:
        low = batch.amin(dim=(1, 2, 3), keepdim=True)
        high = batch.amax(dim=(1, 2, 3), keepdim=True)
        images = (batch - low) / (high - low).clamp_min(1e-12)
    if channels != 3:
        images = images.mean(dim=1, keepdim=True).expand(-1, 3, -1, -1)
    return images.clamp(0.0, 1.0).permute(0, 2, 3, 1).contiguous()


@dataclass(frozen=True)
class DisplayStatistics:
    """What ``display_from_model_input`` reads of a preprocess (its ``mean`` and ``std``), kept instead of the
    preprocess itself: a user's preprocess may hold the model (a closure, a bound method), which an Explanation
    would then keep alive."""

    mean: Optional[tuple[float, ...]]
    std: Optional[tuple[float, ...]]


def _display_statistics(preprocess: object) -> Union[Normalize, DisplayStatistics, None]:
    """``preprocess`` as display images need it: the default ``Normalize`` (which holds only its statistics, and
    tells 1-channel input apart) as it is; any other as its ``mean`` and ``std`` alone."""
    if preprocess is None or isinstance(preprocess, (Normalize, DisplayStatistics)):
        return preprocess
    mean: Any = getattr(preprocess, "mean", None)
    std: Any = getattr(preprocess, "std", None)
    try:
        return DisplayStatistics(tuple(float(value) for value in mean), tuple(float(value) for value in std))
    except TypeError:  # no per-channel statistics (None, a number): each image rescaled by its min and max
        return DisplayStatistics(None, None)


class DisplayImages:
    """(N, H, W, 3) float RGB display images in [0, 1] on the CPU, given, or made from model input on first
    use: for a model-ready batch on a GPU, the copy to the CPU and the conversion cost more than
    Grad-CAM itself, and a call whose maps are never drawn needs no images."""

    def __init__(self, images: Optional[Tensor] = None, *, model_input: Optional[Tensor] = None,
                 preprocess: object = None):
        if (images is None) == (model_input is None):
            raise ValueError("give the display images or the model input to make them from, not both.")
        self._images = images
        self._model_input = None if model_input is None else (  # a copy: safe from the caller's later edits
            model_input.detach() if model_input.requires_grad else model_input).clone()
        self._preprocess = _display_statistics(preprocess)

    def get(self) -> Tensor:
        if self._images is None:
            assert self._model_input is not None, "made from model input when not given"
            self._images = display_from_model_input(self._model_input, self._preprocess)
            self._model_input = self._preprocess = None
        return self._images

    def select(self, rows: Tensor) -> "DisplayImages":
        """The display images of some of the images: ``rows`` (R,) long indices; still made on first use."""
        if self._images is not None:
            return DisplayImages(self._images[rows.cpu()])
        assert self._model_input is not None, "made from model input when not given"
        return DisplayImages(model_input=self._model_input[rows.to(self._model_input.device)],
                             preprocess=self._preprocess)


@dataclass
class PreparedInputs:
    """batch: (N, C, H, W) model input on the model's device; display: its display images."""

    batch: Tensor
    display: DisplayImages

    @property
    def images(self) -> Tensor:
        """(N, H, W, 3) float display images in [0, 1], on the CPU."""
        return self.display.get()


def _flatten(inputs: Inputs) -> list[ImageInput]:
    if isinstance(inputs, (str, bytes, os.PathLike, Image.Image)):
        return [inputs]
    if isinstance(inputs, Tensor):
        if inputs.dim() == 4:
            return list(inputs.unbind(0))
        if inputs.dim() in (2, 3):
            return [inputs]
        extra = (" To explain several images, stack them into one batch dimension, e.g. x.flatten(0, 1) for "
                 "(B, T, C, H, W); a list of tensors works too." if inputs.dim() > 4 else "")
        raise ValueError(f"a tensor input must be (C, H, W) or (N, C, H, W); got shape {tuple(inputs.shape)}.{extra}")
    if isinstance(inputs, np.ndarray):
        return list(inputs) if inputs.ndim == 4 else [inputs]
    if isinstance(inputs, (list, tuple)):
        items: list[ImageInput] = []
        for item in inputs:
            if isinstance(item, (list, tuple)):
                raise TypeError("inputs may be a list of images, not a list of lists.")
            items.extend(_flatten(item))
        return items
    raise TypeError(
        f"cannot explain a {type(inputs).__name__}: give a path, a PIL image, an (H, W, 3) ndarray, "
        "a (C, H, W) or (N, C, H, W) tensor, or a list of these."
    )


def _prepare_one(item: ImageInput, preprocess: Preprocess, channels: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """One input → (model input (C, H, W), display image (H, W, 3)); images 1-channel where ``channels`` is 1."""
    if isinstance(item, Tensor) and item.dtype != torch.uint8:
        model_input = item.unsqueeze(0) if item.dim() == 2 else item
        return model_input, display_from_model_input(model_input.unsqueeze(0), preprocess)[0]
    gray = channels == 1
    checked = _checked_gray if gray else _checked_rgb
    pil_image: Optional[Image.Image]
    if isinstance(item, (str, bytes, os.PathLike)):
        pil_image = checked(_read_image(item), source=os.fsdecode(item))
        image = image_to_tensor(pil_image, 1 if gray else 3)
    elif isinstance(item, Image.Image):
        pil_image = checked(item, source="the PIL image")
        image = image_to_tensor(pil_image, 1 if gray else 3)
    else:  # an ndarray, or a uint8 tensor of pixels
        image = image_to_tensor(item, 1 if gray else 3)
        pil_image = None
    if isinstance(preprocess, Normalize):
        model_input = (preprocess.grayscale() if gray else preprocess)(image)
    else:  # user pipelines (torchvision transforms) expect PIL images (mode "L" for a 1-channel model)
        if pil_image is None:
            pixels = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            pil_image = Image.fromarray(pixels[..., 0] if gray else pixels)
        model_input = preprocess(pil_image)
        if not isinstance(model_input, Tensor):
            raise TypeError(f"preprocess must return a tensor; it returned a {type(model_input).__name__}.")
    if model_input.dim() == 4 and model_input.shape[0] == 1:
        model_input = model_input[0]
    if tuple(model_input.shape[-2:]) == tuple(image.shape[-2:]):
        display = image.expand(3, -1, -1).permute(1, 2, 0)  # a 1-channel image shown gray
    else:  # the preprocess resized or cropped: show what the model saw
        display = display_from_model_input(model_input.unsqueeze(0), preprocess)[0]
    return model_input, display


def prepare_inputs(
    inputs: Inputs, preprocess: Preprocess, device: torch.device, dtype: torch.dtype = torch.float32,
    channels: Optional[int] = None,
) -> PreparedInputs:
    """Turn any supported input into a (N, C, H, W) batch on ``device`` and (N, H, W, 3) display images.

    channels: the channels of the model's images (``explain.core.capture.model_input_channels``). 1: images
    (paths, PIL images, arrays, uint8 tensors) are made 1-channel grayscale, and colour images are refused; None or
    another count: RGB.
    Float tensors are model input as they are."""
    if isinstance(inputs, Tensor) and inputs.dim() == 4 and inputs.shape[0] > 0 and inputs.dtype != torch.uint8:
        # a model-ready batch: no split into images and re-stacking; display images when first drawn
        _warn_if_channels_last(inputs, channels)
        ready = _checked(inputs.to(device), dtype, DisplayImages(model_input=inputs, preprocess=preprocess))
        _check_unit_pixels(ready.batch, list(range(len(ready.batch))), preprocess)
        return ready
    items = _flatten(inputs)
    for item in items:
        if isinstance(item, Tensor) and item.is_floating_point():
            _warn_if_channels_last(item, channels)
    if not items:
        raise ValueError("there is nothing to explain: the input batch is empty.")
    prepared = [_prepare_one(item, preprocess, channels) for item in items]
    shapes = {tuple(model_input.shape) for model_input, _ in prepared}
    if len(shapes) > 1:
        raise ValueError(
            f"the inputs have different sizes after preprocessing ({sorted(shapes)}); a batch needs one "
            "size. Pass a preprocess that resizes (e.g. torchvision weights.transforms()) or explain "
            "the images one at a time."
        )
    batch = torch.stack([model_input for model_input, _ in prepared]).to(device)
    checked = _checked(batch, dtype, DisplayImages(torch.stack([display for _, display in prepared]).float()))
    model_ready = [index for index, item in enumerate(items) if isinstance(item, Tensor) and item.is_floating_point()]
    if model_ready:
        _check_unit_pixels(checked.batch[model_ready], model_ready, preprocess)
    return checked


def _checked(batch: Tensor, dtype: torch.dtype, display: DisplayImages) -> PreparedInputs:
    """Cast a floating batch to the model's dtype; refuse other dtypes, and NaN or inf."""
    if not batch.is_floating_point():
        raise TypeError(
            f"a tensor input is taken as model input and must be floating point; this one is {batch.dtype}. "
            "Convert it, e.g. x.float() / 255 for 0-255 pixels, normalised as the model expects "
            "(explain.Normalize() for ImageNet statistics); or pass the image as a uint8 tensor, a PIL image or an "
            "ndarray, which the explainer's preprocess turns into model input."
        )
    if batch.is_inference():  # made inside the caller's torch.inference_mode(): autograd cannot use it
        batch = batch.clone()
    batch = batch.to(dtype)
    _check_values(batch)  # decided at the end of an explainer call (explain.core.checks)
    return PreparedInputs(batch=batch, display=display)


def _non_finite_input(batch: Tensor) -> None:
    raise ValueError("the input contains NaN or inf values; a map of such an input would be meaningless.")


PIXEL_RANGE_THRESHOLD = 10.0
"""Model input whose values are all ≥ 0 and reach above this looks like 0-255 pixels: normalised images (any
mean/std in use: ImageNet's, CLIP's, 0.5/0.5, MNIST's) stay within about [-3, 3], and have values < 0."""


def _check_values(batch: Tensor) -> None:
    """Refuse NaN and inf in the model input, and warn where it holds 0-255 pixel values (the model would be
    explained on an image far outside what it was trained on); both decided from its extremes (two reductions in one
    operation, NaN and inf carried through), at the end of the explainer's call (``explain.core.checks``)."""
    if batch.numel() == 0:
        return
    with torch.no_grad():
        extremes = torch.stack(torch.aminmax(batch))

    def decide(values: list[float]) -> None:
        low, high = values
        if not (math.isfinite(low) and math.isfinite(high)):
            _non_finite_input(batch)
        if low >= 0.0 and high > PIXEL_RANGE_THRESHOLD:
            warn_at_callers_line(
                f"the model input spans [{low:.4g}, {high:.4g}]: it looks like 0-255 pixels, which the model was not "
                "trained on (its maps would explain another input). A float tensor is taken as model input as it "
                "is: pass the pixels as a uint8 tensor (x.round().to(torch.uint8)) or an ndarray, which the "
                "explainer's preprocess normalises; or divide by 255 and normalise as the model expects "
                "(explain.Normalize() for ImageNet statistics). If the model itself takes 0-255 values, ignore "
                "this warning.")

    check(extremes, decide)


def _normalising_statistics(preprocess: object) -> Optional[tuple[tuple[float, ...], tuple[float, ...]]]:
    """The (mean, std) a preprocess normalises by, when it states them and they change values (not mean 0, std 1);
    None for the assumed default (no preprocess given: the model may normalise inside)."""
    mean, std = _normalize_statistics(preprocess)
    if (getattr(preprocess, "assumed", False) or mean is None or std is None
            or (all(value == 0 for value in mean) and all(value == 1 for value in std))):
        return None
    return mean, std


UNIT_PIXEL_DETECTORS = ("torchvision.models.detection", "ultralytics")
"""The modules of models that take [0, 1] pixels and normalise them inside (torchvision's detectors, YOLO)."""


def takes_unit_pixels(model: object) -> bool:
    """Whether ``model`` takes [0, 1] pixels and normalises them inside (its module is one of
    ``UNIT_PIXEL_DETECTORS``): an image given to it is not normalised again."""
    return model is not None and type(model).__module__.startswith(UNIT_PIXEL_DETECTORS)


def _model_normalises_inside() -> bool:
    """Whether the model of the call in progress (``explain.core.scope.current_scope``) takes [0, 1] pixels."""
    from ..core.scope import current_scope

    return takes_unit_pixels(getattr(current_scope(), "model", None))


PIXEL_LEVEL_TOLERANCE = 0.1
"""How far (in 0-255 levels) normalised model input read back as pixels may stray from whole levels and still be taken
for a normalised 8-bit image: float32 and float16 rounding stay well below it; [0, 1] pixels read back through
ImageNet's statistics land anywhere between levels, through mean = std = 0.5 halfway between them for even levels."""


def off_pixel_levels(model_inputs: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Per image of ``model_inputs`` (K, C, H, W): the largest distance, in 0-255 levels, of its values read back as
    pixels, ``(x * std + mean) * 255``, from whole levels; near 0 for a normalised 8-bit image (the output of an image
    processor or a transform on a PIL image). Statistics that are not one per channel are averaged (a 1-channel
    model's, as ``Normalize.grayscale``)."""
    channels = model_inputs.shape[1] if model_inputs.dim() > 1 else 1
    mean_t, std_t = (torch.tensor(values, dtype=torch.float32, device=model_inputs.device) for values in (mean, std))
    if mean_t.numel() != channels:
        mean_t, std_t = mean_t.mean().reshape(1), std_t.mean().reshape(1)
    shape = (1, -1) + (1,) * max(model_inputs.dim() - 2, 0)
    levels = (model_inputs.float() * std_t.view(shape) + mean_t.view(shape)) * 255
    return (levels - levels.round()).abs().flatten(1).amax(dim=1)


def _check_unit_pixels(model_inputs: Tensor, positions: list[int], preprocess: object) -> None:
    """Warn where float tensors taken as model input (``model_inputs`` (K, C, H, W), the images at ``positions``)
    hold [0, 1] pixels (``ToTensor()``'s output, ``torch.rand``) while the preprocess normalises (a stated mean/std
    other than 0/1): the model would be explained on an image it was not trained on, and the display shows it washed
    out. Each image's values all in [0, 1], not all equal, and not all 0-255 pixel levels put through the stated
    normalisation: a normalised photo is below 0 wherever a pixel is darker than the mean, and one that is not (a
    bright image under mean = std = 0.5, as ViT's and SigLIP's processors and timm's ViTs state) is told apart by its
    values, each (k / 255 - mean) / std for an integer k (``off_pixel_levels``), which [0, 1] pixels, k / 255, are
    not. Decided at the end of the explainer's call, with its other checks (``explain.core.checks``)."""
    statistics = _normalising_statistics(preprocess)
    if statistics is None or not len(model_inputs) or _model_normalises_inside():
        return
    mean, std = statistics
    with torch.no_grad():
        flat = model_inputs.detach().flatten(1)
        low, high = torch.aminmax(flat, dim=1)
        extremes = torch.stack([low, high, off_pixel_levels(model_inputs.detach(), mean, std)], dim=1).flatten()

    def decide(values: list[float]) -> None:
        triples = zip(values[0::3], values[1::3], values[2::3])
        found = [position for position, (low, high, off) in zip(positions, triples)
                 if 0.0 <= low < high <= 1.0 + UNIT_ROUNDING and off > PIXEL_LEVEL_TOLERANCE]
        if not found:
            return
        named = ", ".join(str(position) for position in found[:5]) + (", ..." if len(found) > 5 else "")
        warn_at_callers_line(
            f"the float tensor input of image(s) {named} lies in [0, 1]: it looks like un-normalised pixels "
            f"(ToTensor()'s output), and a float tensor is taken as model input as it is, while the preprocess "
            f"normalises by mean={mean}, std={std}: the model would be explained on an image it was not trained on, "
            "and the display shows it washed out. Pass the image un-normalised as a uint8 tensor "
            "((x * 255).round().to(torch.uint8)), a PIL image or an ndarray, which the preprocess normalises; or "
            "normalise the tensor yourself (explain.Normalize(mean, std)(x) with the statistics above). If the "
            "model takes [0, 1] values, state it: preprocess=explain.Normalize(mean=(0, 0, 0), std=(1, 1, 1)).")

    check(extremes, decide)


def _warn_if_channels_last(model_input: Tensor, channels: Optional[int]) -> None:
    """Warn when a float tensor of model input looks channels-last, (H, W, C) or (N, H, W, C): its last dimension
    is the model's channel count (its first convolution's ``in_channels``) and its channel dimension is not. Only a
    warning: a model may permute its input itself."""
    if channels is None or model_input.dim() not in (3, 4):
        return
    if model_input.shape[-3] != channels and model_input.shape[-1] == channels:
        layout = "(H, W, C)" if model_input.dim() == 3 else "(N, H, W, C)"
        permute = "x.permute(2, 0, 1)" if model_input.dim() == 3 else "x.permute(0, 3, 1, 2)"
        warn_at_callers_line(
            f"the float tensor of shape {tuple(model_input.shape)} looks channels-last, {layout}: the model's first "
            f"convolution takes {channels} channels, and a tensor input is taken as channels first, (C, H, W) or "
            f"(N, C, H, W). Pass {permute}, or the image as an (H, W, 3) ndarray.")
