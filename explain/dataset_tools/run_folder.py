"""The output folder of a run: one run (or shard) at a time holds its lock, and files appear whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import (
    Callable,
    Iterator,
    Optional,
    Union,
)

import torch

try:
    import fcntl
except ImportError:  # Windows: no flock, so runs into one folder are not locked there
    fcntl = None  # type: ignore[assignment]

import re

from ..core.caller import warn_at_callers_line
from ..io.page_text import writable

LOCK_FILE = ".explain.lock"
"""The file of an output folder that a run holds locked while it writes there (see ``folder_lock``)."""


@dataclass
class Shard:
    """This process's part of the data set: items ``rank``, ``rank + world_size``, …"""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environment(cls) -> "Shard":
        """torch.distributed's rank and world size when initialised, else torchrun's RANK and
        WORLD_SIZE variables, else a single shard."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return cls(torch.distributed.get_rank(), torch.distributed.get_world_size())
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temporary)`` then rename into place: a kill leaves the old file or the new one, a
    failed write (a full disk) the old one and no temporary file."""
    temporary = path.with_name(f".{path.name}.part")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


class FolderInUseError(OSError):
    """Another run is writing to the output folder: a process holds its lock (see ``folder_lock``)."""


LOCKS_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)
"""flock's errors on a file system that does not lock files (some network and FUSE file systems)."""


@contextlib.contextmanager
def folder_lock(out: Union[str, Path], shard: Optional[Shard] = None) -> Iterator[None]:
    """Hold the output folder ``out`` (which must exist) for a run: an exclusive ``fcntl.flock`` on
    OUT/.explain.lock (``LOCK_FILE``), whose text names this process; under torchrun (a ``shard`` of
    several processes) a shared lock on it, which the ranks of one run hold together, and an
    exclusive one on OUT/.explain.rank<R>.lock. Raises FolderInUseError, naming the process that
    holds it, when another run holds the folder. The kernel releases a lock when its process ends,
    also by ``kill -9``, so a killed run never blocks the next one; the last process to hold a lock
    file removes it. Without ``fcntl`` (Windows), or on a file system that cannot lock files (a
    warning says so), nothing is locked."""
    out = Path(out)
    shard = shard or Shard()
    sharded = shard.world_size > 1
    held: list[tuple[int, Path, bool]] = []
    try:
        if fcntl is not None:
            holder = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            locks = [(out / LOCK_FILE, not sharded, holder)]
            if sharded:
                locks.append((out / f".explain.rank{shard.rank}.lock", True,
                              f"{holder}, rank {shard.rank} of {shard.world_size}"))
            for path, exclusive, text in locks:
                descriptor = _lock(path, exclusive, text, out)
                if descriptor is None:
                    break
                held.append((descriptor, path, exclusive))
                _HELD_LOCKS.add(descriptor)
        yield
    finally:
        for descriptor, path, exclusive in reversed(held):
            _unlock(descriptor, path, exclusive)


def _lock(path: Path, exclusive: bool, holder: str, out: Path) -> Optional[int]:
    """Lock ``path`` (created if missing) without waiting and return its descriptor; an exclusive
    holder writes ``holder`` in it. None where the file system cannot lock (after a warning)."""
    assert fcntl is not None
    for _ in range(100):  # a lock file removed by a run that just ended is created again: lock the new one
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _lock_holders(descriptor, out)
            os.close(descriptor)
            raise FolderInUseError(
                f"{display_name(out)} is in use by another run of explain ({who}): two runs writing into one folder "
                "would both explain every image and write each image's rows twice. Wait until that run ends (a run "
                "started after it goes on where it stopped), or give another output folder.") from None
        except OSError as error:
            os.close(descriptor)
            if error.errno not in LOCKS_UNSUPPORTED:
                raise
            warn_at_callers_line(
                f"the file system of {display_name(out)} cannot lock files ({error_line(error)}), so this run does "
                "not hold the folder: start no other run into it until this one ends (two at once would explain "
                "every image twice), or write to a folder on a local disk.")
            return None
        try:
            same = os.path.samestat(os.stat(path), os.fstat(descriptor))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(descriptor, 0)  # a shared holder leaves it empty: no one process holds the folder
            if exclusive:
                os.pwrite(descriptor, holder.encode("utf-8", "backslashreplace"), 0)
            return descriptor
        os.close(descriptor)
    raise FolderInUseError(f"{display_name(path)} keeps being removed and made again: another program is using it; "
                           "give another output folder.")


def _lock_holders(descriptor: int, out: Path) -> str:
    """Who holds a folder's lock, as its lock files say: "pid 123 on host, since ...", one per
    process of a torchrun run, or "a process that did not say which" (a lock being taken)."""
    texts = [os.pread(descriptor, 1000, 0).decode("utf-8", "replace").strip()]
    if not texts[0]:  # held shared: by the ranks of a torchrun run, each named in its own lock file
        texts = []
        for path in sorted(out.glob(".explain.rank*.lock")):
            with contextlib.suppress(OSError):
                texts.append(path.read_text(encoding="utf-8", errors="replace").strip())
    texts = [one_line(text) for text in texts if text]
    return "; ".join(texts) if texts else "a process that did not say which"


def _unlock(descriptor: int, path: Path, exclusive: bool) -> None:
    """Release a lock taken by ``_lock``; the last holder (the only one for an exclusive lock)
    removes the lock file while it still holds it, so that no run locks a file that is gone."""
    assert fcntl is not None
    try:
        if not exclusive:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while another rank holds it
        if os.path.samestat(os.stat(path), os.fstat(descriptor)):
            path.unlink()
    except OSError:
        pass  # another rank still holds it, or the file is gone: it stays, or was removed, unlocked
    finally:
        _HELD_LOCKS.discard(descriptor)
        os.close(descriptor)


def _close_inherited_locks() -> None:
    """In a process forked while this one holds a folder's lock (a DataLoader's worker): close its copies
    of the lock's descriptors, without unlocking (that would unlock the parent's). A flock belongs to every
    process that has the descriptor, so a worker that outlives its run by ``kill -9`` would otherwise keep
    the folder locked against the next run."""
    for descriptor in list(_HELD_LOCKS):
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


def display_name(path: Union[str, Path]) -> str:
    """A path as one line of text that can always be written: bytes that are not UTF-8, and
    control characters (a newline in a file name), appear as \\x escapes."""
    return one_line(os.fsencode(path).decode("utf-8", "backslashreplace"))


def one_line(text: str) -> str:
    """Text with its control characters (a newline, a tab) as \\x escapes, and what UTF-8 cannot
    write (a lone surrogate: a byte that is not UTF-8, a JSON file's "\\udce9") as ``writable``
    escapes it: one line of an index row, a run record or a caption."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda match: f"\\x{ord(match.group()):02x}", writable(text))


_HELD_LOCKS: set[int] = set()
"""The descriptors of the folder locks this process holds (``folder_lock``)."""


def error_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
