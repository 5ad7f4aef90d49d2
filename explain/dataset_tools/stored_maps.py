"""A dataset run's maps on disk: the maps of several images in one file, each at the method's own
resolution where the maps at the input's resolution are made again from it exactly.

A maps file, OUT/maps/<name>.npz (numpy's uncompressed npz; read with ``allow_pickle=False``), holds
the maps of some images of one input size (a batch's), one after the other:

    ids        (M,) str      the images' ids, in the order of their maps
    targets    (M,) int64    each image's number of maps K (its index rows)
    maps       (R, h, w)     R = the sum of ``targets``: image 0's K maps, then image 1's, ...
    form       () str        "low-res": float32 maps at the method's resolution before upsampling and
                             normalisation (Grad-CAM's at its layer: 7 × 7 for resnet50's layer4 at 224 px),
                             as the method computed them; "input": float16 maps at the input's resolution,
                             normalised, as ``Explanation.maps`` (where they cannot be made from low-res ones:
                             pixel-level methods, token layouts, several layers)
    size       (2,) int64    the input's (H, W)
    normalize  () str        the explainer's normalisation ("max", "minmax", "none"), for "low-res"

A "low-res" map is given back as ``normalize_maps(upsample_maps(map, size), normalize)``: the steps
``Explainer.explain`` takes from the method's maps to ``Explanation.map_grid``, so that on the CPU the maps
read back are those of the Explanation bit for bit, and ``raw=True`` gives ``Explanation.raw_map_grid``'s.
A run stores them so only after checking that these steps give its Explanation's maps exactly, else it
stores the "input" form (see ``stored_form``). On a GPU the run's own upsampling may differ from the CPU's in
the last bits of float32.

An earlier version of explain wrote one file per image, OUT/maps/<id>.npy: its (K, H, W) float16 maps at the
input's resolution, normalised. ``read_map_file`` reads both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from ..io.explanation import Explanation
from ..methods.maps import NORMALIZATIONS, normalize_maps, upsample_maps

LOW_RES = "low-res"
"""The form of maps stored at the method's resolution, before upsampling and normalisation."""
AT_INPUT = "input"
"""The form of maps stored at the input's resolution, normalised, as float16."""
FORMS = (LOW_RES, AT_INPUT)
SUFFIX = ".npz"
MEMBERS = ("ids", "targets", "maps", "form", "size", "normalize")


def normalize_word(normalize: Optional[str]) -> str:
    """An explainer's ``normalize`` as the file records it: "max", "minmax" or "none"."""
    return "none" if normalize is None else normalize


def _normalization(word: str) -> Optional[str]:
    return None if word == "none" else word


@dataclass
class StoredMaps:
    """The maps of some images of one input size, as a maps file holds them (see the module's docstring).
    maps: (R, h, w) float32 ("low-res") or float16 ("input") on the CPU."""

    ids: list[str]
    targets: list[int]
    maps: Tensor
    form: str
    size: tuple[int, int]
    normalize: str = "max"

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}; got {self.form!r}.")
        if len(self.ids) != len(self.targets) or sum(self.targets) != self.maps.shape[0] or self.maps.dim() != 3:
            raise ValueError(f"{len(self.ids)} ids with {sum(self.targets)} maps in all do not fit maps of shape "
                             f"{tuple(self.maps.shape)}: (R, h, w) with R the sum of the images' targets.")
        if self.form == AT_INPUT and tuple(self.maps.shape[-2:]) != tuple(self.size):
            raise ValueError(f"maps at the input's resolution must be {tuple(self.size)}; they are "
                             f"{tuple(self.maps.shape[-2:])}.")
        if _normalization(self.normalize) not in NORMALIZATIONS:
            raise ValueError(f"normalize must be one of max, minmax, none; got {self.normalize!r}.")
        self._where: Optional[dict[str, tuple[int, int]]] = None

    def image(self, image_id: str, raw: bool = False) -> Tensor:
        """The (K, H, W) float32 maps of one image at the input's resolution: normalised as
        ``Explanation.map_grid`` (``raw``: before normalisation, as ``raw_map_grid``; only for
        "low-res" maps: those at the input's resolution are stored normalised). KeyError for an id
        the file does not hold."""
        if self._where is None:
            starts = np.cumsum([0] + self.targets[:-1]).tolist()
            self._where = {item: (start, count) for item, start, count in zip(self.ids, starts, self.targets)}
        start, count = self._where[image_id]
        own = self.maps[start : start + count]
        if self.form == AT_INPUT:
            if raw:
                raise ValueError("these maps are stored at the input's resolution, normalised (float16): their "
                                 "values before normalisation were not kept. Read them with raw=False.")
            return own.float()
        return maps_at_input(own, self.size, self.normalize, raw)


def maps_at_input(low_res: Tensor, size: Sequence[int], normalize: str, raw: bool = False) -> Tensor:
    """(K, h, w) maps at a method's resolution → (K, H, W) float32 at the input's ``size``, as
    ``Explainer.explain`` makes them: bilinear upsampling (align_corners=False), then the normalisation
    (skipped with ``raw``)."""
    upsampled = upsample_maps(low_res[None].float(), tuple(int(side) for side in size))[0]
    return upsampled if raw else normalize_maps(upsampled, _normalization(normalize))


def stored_form(explanation: Explanation, normalize: Optional[str]) -> tuple[str, Tensor]:
    """How to store an explanation's maps: ("low-res", (N, K, h, w) float32) when its one layer's
    low-resolution maps, upsampled and normalised with ``normalize`` (the explainer's), give its
    ``raw_map_grid`` and ``map_grid`` exactly (checked on the explanation's device) and are smaller; else
    ("input", (N, K, H, W) float16 ``map_grid``). The tensors are on the explanation's device."""
    raw, maps = explanation.raw_map_grid.detach(), explanation.map_grid.detach()
    layers = explanation.low_res_maps
    if layers is not None and len(layers) == 1 and normalize in NORMALIZATIONS:
        low_res = layers[0].detach().float()
        if (low_res.dim() == 4 and low_res.shape[:2] == raw.shape[:2]
                and low_res.shape[-2] * low_res.shape[-1] < raw.shape[-2] * raw.shape[-1]):
            upsampled = upsample_maps(low_res, raw.shape[-2:])
            if torch.equal(upsampled, raw) and torch.equal(normalize_maps(upsampled, normalize), maps):
                return LOW_RES, low_res
    return AT_INPUT, maps.half()


def save_maps(file: BinaryIO, stored: StoredMaps) -> None:
    """Write a maps file (see the module's docstring) to an open binary file."""
    maps = stored.maps.numpy().astype(np.float32 if stored.form == LOW_RES else np.float16, copy=False)
    np.savez(file, ids=np.array(stored.ids, dtype=str), targets=np.array(stored.targets, dtype=np.int64),
             maps=maps, form=np.array(stored.form), size=np.array(stored.size, dtype=np.int64),
             normalize=np.array(stored.normalize))


def load_maps(path: Union[str, Path, BinaryIO]) -> StoredMaps:
    """Read a maps file written by ``save_maps``; ValueError saying what is wrong for a file that is not one."""
    where = path if isinstance(path, (str, Path)) else getattr(path, "name", "the file")
    try:
        with contextlib.ExitStack() as stack:  # opened here: np.load leaves a path's file open when it is not a zip
            file = stack.enter_context(open(path, "rb")) if isinstance(path, (str, Path)) else path
            contents = np.load(file, allow_pickle=False)
            if not hasattr(contents, "files"):
                raise ValueError(f"it holds one array of shape {getattr(contents, 'shape', '?')}, not an npz file")
            stack.callback(contents.close)
            missing = [name for name in MEMBERS if name not in contents.files]
            if missing:
                raise ValueError(f"it lacks {', '.join(missing)}")
            members = {name: contents[name] for name in MEMBERS}
    except FileNotFoundError:
        raise
    except Exception as error:  # truncated, not an npz, damaged: a zip header (BadZipFile, NotImplementedError for
        # a compression method, RuntimeError for an encryption flag), an array's header (SyntaxError, TokenError) ...
        raise ValueError(f"{where} is not a maps file of explain ({type(error).__name__}: {error}).") from error
    form, normalize = str(members["form"]), str(members["normalize"])
    maps = members["maps"]
    expected = np.float32 if form == LOW_RES else np.float16
    if maps.dtype != expected:
        raise ValueError(f"{where} is not a maps file of explain: its {form} maps are {maps.dtype}, not "
                         f"{np.dtype(expected)}.")
    size = members["size"].reshape(-1).tolist()
    if len(size) != 2:
        raise ValueError(f"{where} is not a maps file of explain: its size is {size}, not (H, W).")
    try:
        return StoredMaps([str(item) for item in members["ids"].reshape(-1)],
                          [int(count) for count in members["targets"].reshape(-1)], torch.from_numpy(maps),
                          form, (int(size[0]), int(size[1])), normalize)
    except ValueError as error:
        raise ValueError(f"{where} is not a maps file of explain: {error}") from error
