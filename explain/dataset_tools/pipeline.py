"""The stages of a dataset run around explaining (see ``explain.dataset_tools.batch``): a folder's images decoded and
preprocessed in worker processes, a batch ahead, into pinned memory for a GPU; and the results written by
one thread in the background, a bounded number of batches behind, so that the model waits neither for the
decoder nor for the disk.

    files ──workers: load_image, preprocess──▶ LoadedBatch ──explain (main thread)──▶ results
          ──BackgroundWriter: maps file, overlays, index rows (one synced append)──▶ OUT
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import re
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Generic, Iterator, Optional, Sequence, TypeVar, Union

import torch
from torch import Tensor

from ..io.inputs import Preprocess, load_image, prepare_inputs

WRITER_DEPTH = 2
"""How many explained batches may wait for the background writer: more hold more memory, fewer make the
model wait for a slow disk sooner."""


def default_workers() -> int:
    """Worker processes that decode and preprocess a folder's images when ``workers`` is not given:
    min(8, the CPU cores this process may use − 1), so that one core is left to the main process; 0 (in the
    main process) on a single core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(0, min(8, cores - 1))


@dataclass
class LoadFailure:
    """An image that could not be used: ``stage`` "read" (not an image: corrupt, empty, truncated, RGBA, a
    decompression bomb) or "prepare" (the preprocessing raised); ``error`` the exception."""

    position: int
    stage: str
    error: BaseException


@dataclass
class LoadedGroup:
    """Images of one size after preprocessing: positions in the run's list of files, their (B, C, H, W)
    model input, and their (B, H, W, 3) display images in [0, 1] (for overlays; None when not asked for)."""

    positions: list[int]
    inputs: Tensor
    displays: Optional[Tensor] = None


@dataclass
class LoadedBatch:
    """A batch of files, decoded and preprocessed: its images in groups of one size (in the order of
    their first image) and the files that could not be used."""

    groups: list[LoadedGroup] = field(default_factory=list)
    failures: list[LoadFailure] = field(default_factory=list)

    def pin_memory(self) -> "LoadedBatch":
        """The batch with its model input in pinned memory (the DataLoader calls this for a GPU run)."""
        return LoadedBatch([LoadedGroup(group.positions, group.inputs.pin_memory(), group.displays)
                            for group in self.groups], self.failures)


class FileImages(torch.utils.data.Dataset):
    """A run's image files by position: each read (``load_image``) and prepared with the explainer's
    preprocess, as ``explain`` prepares an image; a file that fails gives a LoadFailure instead."""

    def __init__(self, files: Sequence[Path], preprocess: Preprocess, displays: bool, channels: Optional[int] = None):
        self.files, self.preprocess, self.displays, self.channels = list(files), preprocess, displays, channels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, position: int) -> tuple[int, Optional[Tensor], Optional[Tensor], Optional[LoadFailure]]:
        try:
            image = load_image(self.files[position])
        except Exception as error:  # corrupt, empty, truncated, not an image, RGBA, decompression bomb ...
            return position, None, None, LoadFailure(position, "read", _sendable(error))
        try:
            prepared = prepare_inputs(image, self.preprocess, torch.device("cpu"), channels=self.channels)
        except Exception as error:
            return position, None, None, LoadFailure(position, "prepare", _sendable(error))
        display = prepared.images[0] if self.displays else None
        return position, prepared.batch[0], display, None


def _sendable(error: BaseException) -> BaseException:
    """The error itself where it survives being sent from a worker process (pickled), else a RuntimeError
    with its type and message."""
    if torch.utils.data.get_worker_info() is None:
        return error  # in the main process: nothing is sent
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        text = str(error).strip().splitlines()
        return RuntimeError(f"{type(error).__name__}: {text[0]}" if text else type(error).__name__)


def collate(items: Sequence[tuple[int, Optional[Tensor], Optional[Tensor], Optional[LoadFailure]]]) -> LoadedBatch:
    """FileImages' items as a LoadedBatch: the images grouped by their model input's shape (a batch needs
    one size), each group stacked, in the order of its first image."""
    batch = LoadedBatch()
    groups: dict[tuple[int, ...], list[tuple[int, Tensor, Optional[Tensor]]]] = {}
    for position, inputs, display, failure in items:
        if failure is not None:
            batch.failures.append(failure)
            continue
        assert inputs is not None, "an item is an image or a failure"
        groups.setdefault(tuple(inputs.shape), []).append((position, inputs, display))
    for members in groups.values():
        displays = [display for _, _, display in members]
        batch.groups.append(LoadedGroup([position for position, _, _ in members],
                                        torch.stack([inputs for _, inputs, _ in members]),
                                        None if displays[0] is None else torch.stack(displays)))  # type: ignore
    return batch


def _sends_by_fork() -> bool:
    """Whether worker processes start by fork (Linux before Python 3.14): then nothing needs pickling."""
    return multiprocessing.get_start_method(allow_none=False) == "fork"


def usable_workers(workers: int, preprocess: Preprocess) -> tuple[int, Optional[str]]:
    """``workers``, or 0 with the reason where worker processes cannot take the preprocess (a lambda or a
    local function, where processes start by spawn or forkserver: it cannot be pickled)."""
    if workers == 0 or _sends_by_fork():
        return workers, None
    try:
        pickle.dumps(preprocess)
    except Exception as error:
        return 0, (f"the preprocess cannot be sent to worker processes ({type(error).__name__}: {error}), so the "
                   "images are decoded in this process (slower on a GPU). Give a preprocess that can be pickled "
                   "(a module-level function or a torchvision transform, not a lambda), or workers=0 to silence "
                   "this.")
    return workers, None


Item = TypeVar("Item")


def load_batches(files: Sequence[Path], batches: Sequence[Sequence[int]], preprocess: Preprocess, workers: int,
                 pin_memory: bool, displays: bool, channels: Optional[int] = None
                 ) -> Generator[LoadedBatch, None, None]:
    """Each batch of positions (in ``files``) decoded and preprocessed, in order: by ``workers`` worker
    processes, started now (before the caller starts threads of its own), the next batches loaded while
    this one is used; 0: in this process, when asked for. The model input is in pinned memory with
    ``pin_memory``, the display images made with ``displays``, images 1-channel where ``channels`` (the model's) is 1.
    The workers end when the iteration ends or
    the iterator is closed."""
    if not batches:
        return _batches_of(iter(()))
    loader = torch.utils.data.DataLoader(
        FileImages(files, preprocess, displays, channels), batch_sampler=[list(batch) for batch in batches],
        num_workers=workers, collate_fn=collate, pin_memory=pin_memory,
        prefetch_factor=2 if workers > 0 else None)
    return _batches_of(iter(loader))


def _batches_of(iterator: Iterator[Item]) -> Generator[Item, None, None]:
    """The batches of a DataLoader's iterator, as a generator that shuts its workers down when closed."""
    try:
        yield from iterator
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()  # now, not when the iterator is collected (a traceback may keep it alive)


class PreprocessedImages(torch.utils.data.Dataset):
    """Files by position, each read and preprocessed as ``preprocess(load_image(path))``; a file that fails
    gives its exception instead (raised by ``preprocessed_images`` in the main process)."""

    def __init__(self, files: Sequence[Path], preprocess: Callable[[Any], Tensor]):
        self.files, self.preprocess = list(files), preprocess

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, position: int) -> Union[Tensor, BaseException]:
        try:
            return self.preprocess(load_image(self.files[position]))
        except Exception as error:
            return _sendable(error)


def preprocessed_images(files: Sequence[Path], preprocess: Callable[[Any], Tensor], workers: int) -> Iterator[Tensor]:
    """Each file read and preprocessed, in order: by ``workers`` worker processes, a few images ahead (0: in
    this process, when asked for); the error of a file that fails is raised when its turn comes."""
    if workers == 0:
        for path in files:
            yield preprocess(load_image(path))
        return
    loader = torch.utils.data.DataLoader(PreprocessedImages(files, preprocess), batch_size=None, num_workers=workers,
                                         prefetch_factor=4)
    for item in _batches_of(iter(loader)):
        if isinstance(item, BaseException):
            raise item
        yield item


IMAGE_POSITION = re.compile(r"\bimage (\d+)\b")
"""How a method's warning names an image of its batch: "image 2, target 0"."""
PAIR_LIST = re.compile(r"\(image, target\)\s*((?:\(\d+, \d+\)(?:,\s*)?)+)")
"""... or a list of (image, target) pairs: "(image, target) (0, 0), (2, 1)"."""
NAMES_SHOWN = 3
"""The files of a batch a warning that names no image of it lists (then "and N more")."""


def named_positions(message: str) -> list[int]:
    """The images of its batch that a warning's message names ("image 2", "(image, target) (2, 0), (3, 1)"), in
    order, each once."""
    positions = [int(found) for found in IMAGE_POSITION.findall(message)]
    for pairs in PAIR_LIST.findall(message):
        positions += [int(found) for found in re.findall(r"\((\d+), \d+\)", pairs)]
    return list(dict.fromkeys(positions))


class FileWarnings:
    """Warnings raised while a batch of files is explained, shown naming the files: a method numbers the images of
    the batch it is given ("image 2, target 0"), which tells a user who explains a folder nothing. Each warning
    raised inside ``naming(names)`` by the thread that entered it is shown when the block ends, attributed to the
    line the method attributed it to, with the files it concerns: those it names by position, else the batch's (the
    first ``NAMES_SHOWN``). A warning that names no image is shown once a run (its first batch named), as one about
    the run (the model, the method's settings) would repeat for every batch; one that names images once for each text
    and files named.

    Until Python 3.14, ``warnings.catch_warnings`` holds back the warnings of every thread, also the background
    writer's (drawing an overlay, the caller's ``on_batch``), which concern another batch than the one explained:
    those are shown when the block ends naming no file (once a run for each text), also where the batch is dropped
    (``keep_on_error=False``)."""

    def __init__(self) -> None:
        self.shown: set[tuple[type[Warning], str]] = set()

    @contextlib.contextmanager
    def naming(self, names: Sequence[str], *, keep_on_error: bool = True) -> Iterator[None]:
        """Hold back the warnings raised inside, then show them naming ``names`` (the batch's files, in its order);
        when the block raises, only with ``keep_on_error`` (False: the batch is explained again in parts, which
        warn again). The warnings of other threads meanwhile are shown naming no file."""
        own: list[warnings.WarningMessage] = []
        others: list[warnings.WarningMessage] = []  # of other threads: their files are not known here
        this_thread = threading.get_ident()
        holding = threading.Event()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                shown_before = warnings.showwarning

                def hold(message: Union[Warning, str], category: type[Warning], filename: str, lineno: int,
                         file: Any = None, line: Optional[str] = None) -> None:
                    if not holding.is_set():  # put back after the block by another thread's catch_warnings
                        shown_before(message, category, filename, lineno, file, line)
                        return
                    caught = warnings.WarningMessage(message, category, filename, lineno, file, line)
                    (own if threading.get_ident() == this_thread else others).append(caught)

                warnings.showwarning = hold  # not catch_warnings(record=True): its recorder tells no thread apart
                holding.set()
                try:
                    yield
                finally:
                    holding.clear()
        except BaseException:
            self._show_all(own if keep_on_error else [], names, others)
            raise
        self._show_all(own, names, others)

    def _show_all(self, own: Sequence[warnings.WarningMessage], names: Sequence[str],
                  others: Sequence[warnings.WarningMessage]) -> None:
        """Show the block's own warnings naming ``names``, then those of other threads naming no file."""
        for warning in own:
            self._show(warning, names)
        for warning in others:
            self._show(warning, ())

    def _show(self, warning: warnings.WarningMessage, names: Sequence[str]) -> None:
        text = str(warning.message)
        positions = [position for position in named_positions(text) if position < len(names)]
        if positions:  # about these files (the same position in another batch is another file): once for each
            text += " (" + "; ".join(f"image {position}: {names[position]!r}" for position in positions) + ")"
        key = (warning.category, text)
        if not positions and names:  # about the run: once, its first batch named
            listed = ", ".join(repr(name) for name in names[:NAMES_SHOWN])
            more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
            text += f" (first while explaining {listed}{more})"
        if key in self.shown:
            return
        self.shown.add(key)
        warnings.warn_explicit(text, warning.category, warning.filename, warning.lineno, source=warning.source)


class BackgroundWriter(Generic[Item]):
    """Runs ``write(item)`` for each item put, in the order put, in one thread, with at most ``depth``
    items waiting (``put`` waits for room). An error raised by ``write`` stops the writer: nothing after
    that item is written, and ``put`` or ``finish`` raises it in the caller's thread.

    As a context manager, leaving waits until every item put is written (``finish``), also when it is
    left by an exception (Ctrl-C, an error while explaining): what was explained before is kept, as
    when the results were written in the caller's thread. A second Ctrl-C (the block left by one, or two
    while it waits) sets ``stopping``: the items still waiting are dropped, and the item being written
    ends at its next step that checks ``stopping`` (``write`` should, between its steps, leaving the files
    as a ``kill -9`` there would); the wait goes on until the thread has ended, and the KeyboardInterrupt
    is raised then. So nothing is written once the block is left: its files may be closed and the output
    folder unlocked. A ``kill -9`` may still cut a write short anywhere: each write must leave the files
    consistent then."""

    def __init__(self, write: Callable[[Item], None], depth: int = WRITER_DEPTH, name: str = "explain-writer",
                 stopping: Optional[threading.Event] = None):
        self._write = write
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._error: Optional[BaseException] = None
        self._failed = threading.Event()
        self._closed = threading.Event()  # no more items come
        self._ended = threading.Event()  # the thread has ended: nothing more is written
        self.stopping = stopping if stopping is not None else threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._closed.is_set() and self._queue.empty():  # nothing is put once closed
                        return
                    continue
                if self._failed.is_set() or self.stopping.is_set():
                    continue  # an earlier item failed, or a second Ctrl-C: the items after it are dropped
                try:
                    self._write(item)
                except BaseException as error:  # a full disk, or on_batch raising: stop and report it
                    self._error = error
                    self._failed.set()
        finally:
            self._ended.set()

    def put(self, item: Item) -> None:
        """Queue an item (waiting while ``depth`` items wait); raises the writer's error, if it failed."""
        while True:
            self._raise_error()
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def finish(self) -> None:
        """Wait until every item put is written; raise the writer's error, if it failed. A Ctrl-C meanwhile
        is raised once they are written; a second one stops the writer early (see the class)."""
        if self._wait_for_the_thread(interrupted_before=False):
            raise KeyboardInterrupt
        self._raise_error()

    def _wait_for_the_thread(self, interrupted_before: bool) -> bool:
        """Close the writer and wait until its thread has ended; whether a Ctrl-C came meanwhile. The second
        Ctrl-C (counting one that came before, ``interrupted_before``) sets ``stopping``, so that the thread
        ends soon; the wait goes on until it has."""
        interrupts = int(interrupted_before)
        while True:
            try:
                try:
                    self._closed.set()
                    while not self._ended.wait(0.1):
                        pass
                    return interrupts > int(interrupted_before)
                except KeyboardInterrupt:
                    interrupts += 1
                    if interrupts >= 2:
                        self.stopping.set()
            except KeyboardInterrupt:  # another Ctrl-C, landing in the handler above
                interrupts += 1
                self.stopping.set()

    def __enter__(self) -> "BackgroundWriter[Item]":
        return self

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], traceback: Any) -> None:
        if kind is None:
            self.finish()
            return
        # the exception that left the block is raised, not the writer's error; a Ctrl-C meanwhile is not lost
        interrupted_before = issubclass(kind, KeyboardInterrupt)
        if self._wait_for_the_thread(interrupted_before) and not interrupted_before:
            raise KeyboardInterrupt from error
