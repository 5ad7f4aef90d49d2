"""A model's other inputs (besides the explained batch), as a method passes them to every forward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import (
    Any,
    Collection,
    Optional,
    Union,
)

from torch import Tensor

from ..core.capture import (
    ForwardArguments,
    map_tensors,
)

PerImage = Collection[Union[int, str]]
"""Which of a model's other arguments hold one row per image: positions in ``forward_args`` (int)
and names in ``forward_kwargs`` (str)."""


def tensor_shapes(value: object) -> list[tuple[int, ...]]:
    """The shapes of the tensors a (nested tuple / list / dict) argument holds."""
    shapes: list[tuple[int, ...]] = []
    map_tensors(value, lambda tensor: shapes.append(tuple(tensor.shape)))
    return shapes


@dataclass
class ForwardCall:
    """The other arguments of a model's forward, for models with several inputs.

    args / kwargs: passed through; position: where the explained batch goes, an index into the
    positional arguments or a keyword name; batch_size: N. per_image: (positions, keyword names)
    of the tensors that hold one row per image and follow the rows when a method runs copies of
    the images (path points, noisy copies); the others are shared by every copy. None: not stated
    by the caller, which is only accepted where it cannot be misread: no tensor argument has N rows.
    """

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    position: int | str = 0
    batch_size: int = 0
    per_image: Optional[tuple[frozenset[int], frozenset[str]]] = None

    @classmethod
    def stated(cls, args: object, kwargs: object, position: object, batch_size: int,
               per_image: Optional[PerImage]) -> Optional["ForwardCall"]:
        """The call as ``explain`` receives it, each part checked: ``args`` a tuple or list, ``kwargs`` a
        dict, ``position`` where the batch goes among the positional arguments (0 … len(args); −1 is the
        last place) or a keyword that ``kwargs`` does not hold, ``per_image`` naming arguments given.
        None for a model called with the batch alone."""
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"forward_args must be a tuple or list of the model's other positional inputs (e.g. "
                            f"forward_args=(text,)); got {type(args).__name__}.")
        if not isinstance(kwargs, dict):
            raise TypeError(f"forward_kwargs must be a dict of the model's other keyword inputs; got "
                            f"{type(kwargs).__name__}.")
        if isinstance(position, str):
            if position in kwargs:
                raise ValueError(f"input_position={position!r} names the keyword where the images go, and "
                                 f"forward_kwargs holds {position!r} too: leave it out of forward_kwargs.")
        elif isinstance(position, int) and not isinstance(position, bool) and -len(args) - 1 <= position <= len(args):
            position = position if position >= 0 else position + len(args) + 1
        else:
            raise ValueError(f"input_position must be a keyword name or the images' place among the model's "
                             f"{len(args) + 1} positional inputs, 0 to {len(args)} (or −1 for the last); got "
                             f"{position!r}.")
        if not args and not kwargs and position == 0 and not per_image:
            return None
        call = cls(tuple(args), dict(kwargs), position, batch_size)
        if per_image is None:
            return call
        if isinstance(per_image, (str, int)):
            raise TypeError(f"per_image must be a collection of forward_args positions and forward_kwargs names "
                            f"(e.g. per_image=[{per_image!r}]); got {per_image!r}.")
        names = [item for item in per_image if isinstance(item, str)]
        positions = [item for item in per_image if isinstance(item, int) and not isinstance(item, bool)]
        unknown = [item for item in per_image if item not in names and item not in positions]
        unknown += [name for name in names if name not in kwargs]
        unknown += [index for index in positions if not -len(args) <= index < len(args)]
        if unknown:
            raise ValueError(f"per_image names {unknown!r}, which are not among the model's other inputs "
                             f"(forward_args positions {list(range(len(args)))}, forward_kwargs names "
                             f"{sorted(kwargs)}).")
        positions = [index % len(args) for index in positions]
        for where, value in [*((f"forward_args[{i}]", args[i]) for i in positions),
                             *((f"forward_kwargs[{n!r}]", kwargs[n]) for n in names)]:
            shapes = tensor_shapes(value)
            if not shapes or any(not shape or shape[0] != batch_size for shape in shapes):
                shown = shapes[0] if isinstance(value, Tensor) else f"{type(value).__name__} of tensors {shapes}"
                raise ValueError(f"per_image says {where} holds one row per image, but it is {shown} for "
                                 f"{batch_size} image{'s' if batch_size != 1 else ''}: a per-image tensor's first "
                                 "dimension (of every tensor, in a list or dict) is the number of images. Leave it "
                                 "out of per_image if every image shares it.")
        call.per_image = frozenset(positions), frozenset(names)
        return call

    def arguments(self, inputs: Tensor) -> ForwardArguments:
        """(args, kwargs) of one forward, with copies of the other tensors (the model may edit them in place)."""
        copy = map_tensors(self.args, Tensor.clone), map_tensors(self.kwargs, Tensor.clone)
        if isinstance(self.position, str):
            return copy[0], {**copy[1], self.position: inputs}
        args = list(copy[0])
        args.insert(self.position, inputs)
        return tuple(args), copy[1]

    def per_image_arguments(self) -> tuple[frozenset[int], frozenset[str]]:
        """(positions, keyword names) of the arguments that hold one row per image: as stated by the
        caller, else none, after checking that no tensor argument could be per-image (N rows)."""
        if self.per_image is not None:
            return self.per_image
        ambiguous: list[tuple[str, int | str]] = [(f"forward_args[{index}]", index)
                                                  for index, value in enumerate(self.args)
                                                  if self._has_image_rows(value)]
        ambiguous += [(f"forward_kwargs[{name!r}]", name) for name, value in self.kwargs.items()
                      if self._has_image_rows(value)]
        if ambiguous:
            wheres = " and ".join(where for where, _ in ambiguous)
            example = ", ".join(repr(key) for _, key in ambiguous)
            count = f"{self.batch_size} image{'s' if self.batch_size != 1 else ''}"
            raise ValueError(
                f"{wheres} {'has' if len(ambiguous) == 1 else 'have'} {self.batch_size} "
                f"row{'s' if self.batch_size != 1 else ''}, as many as the {count} explained, and this method runs "
                "copies of the images (path points, noisy copies), so it must know whether each copy takes its "
                f"image's row or the whole tensor. Say which: per_image=[{example}] (one row per image, e.g. "
                "a mask or a condition per image) or per_image=[] (shared by every image, e.g. CLIP's prompts)."
            )
        return frozenset(), frozenset()

    def _has_image_rows(self, value: object) -> bool:
        """Whether the argument is, or holds, a tensor of N rows (which could be one row per image)."""
        return any(shape and shape[0] == self.batch_size for shape in tensor_shapes(value))

    def for_rows(self, rows: Tensor) -> "ForwardCall":
        """The same call for a batch whose row r is a copy of image ``rows[r]``."""
        positions, names = self.per_image_arguments()

        def select(value: Any) -> Any:
            return map_tensors(value, lambda tensor: tensor[rows.to(tensor.device)])

        args = tuple(select(value) if index in positions else value for index, value in enumerate(self.args))
        kwargs = {name: select(value) if name in names else value for name, value in self.kwargs.items()}
        return ForwardCall(args, kwargs, self.position, len(rows), (positions, names))
