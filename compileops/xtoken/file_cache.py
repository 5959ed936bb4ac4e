"""A process-local cache of values built from projection files, keyed by the file itself.

A path alone is not a key: a file rewritten on disk would keep being served from the cache.
The key here is the file's identity, ``(abspath, st_dev, st_ino, st_size, st_mtime_ns,
st_ctime_ns)``, plus the caller's parameters (device, sizes, ...). Rewriting a file in place
changes its ctime (and usually mtime and size); replacing it changes its inode; ``cp -p`` or
``os.utime`` may restore the mtime but not the ctime.

Timestamps have a granularity (the kernel's coarse clock, a few milliseconds; 1 to 2 s on
some filesystems), so a file rewritten within the same tick can keep its identity. As git
does for its index ("racy" entries), a value is therefore stored only when the file's last
change is older than :data:`RACY_WINDOW_NS` at the time the read started: any later write
then gets a later timestamp. A value read from a file changed more recently is returned but
not stored, so the next call reads the file again.

The cache never hands out what it stores: callers pass a ``copy`` function, and every call,
hit or miss, returns a copy (see :meth:`FileCache.get`).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Dict, NamedTuple, TypeVar, Union

import torch

Value = TypeVar("Value")
PathLike = Union[str, os.PathLike]

#: A value read from a file whose ctime or mtime is less than this old (when the read
#: started) is not stored: more than the coarsest common timestamp granularity (FAT's 2 s).
RACY_WINDOW_NS = 3_000_000_000


class FileIdentity(NamedTuple):
    """What identifies one version of a file on disk."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


def file_identity(path: PathLike) -> FileIdentity:
    """The identity of ``path`` now; ``FileNotFoundError`` naming it if it does not exist."""
    abspath = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(abspath)
    except FileNotFoundError:
        raise FileNotFoundError(f"projection file not found: {os.fspath(path)}") from None
    return FileIdentity(abspath, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                        st.st_ctime_ns)


def resolve_device(device) -> torch.device:
    """``device`` for a cache key: ``"cuda"`` means the current CUDA device, so it is
    resolved to ``cuda:<index>`` (two spellings of one device share one entry)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class FileCache:
    """``(file identity, params) -> value``, thread-safe.

    ``entries`` is the dict that holds the values (pass one to keep it under a public name);
    at most one version of each ``(path, params)`` is kept: storing a newer version drops the
    older one.
    """

    def __init__(self, entries: Dict | None = None):
        self.entries: Dict = {} if entries is None else entries
        self._lock = threading.RLock()

    def get(self, path: PathLike, params: tuple, build: Callable[[], Value],
            copy: Callable[[Value], Value]) -> Value:
        """``copy`` of the value for the current version of ``path`` and ``params``; on a
        miss ``build()`` makes it (reading the file). The stored value itself never leaves
        the cache, so no caller can change what another caller gets."""
        with self._lock:
            before = file_identity(path)
            key = (before, params)
            hit = self.entries.get(key)
            if hit is not None:
                return copy(hit)
            read_started_ns = time.time_ns()
            value = build()
            try:
                after = file_identity(path)
            except FileNotFoundError:
                return value  # removed while read: nothing to key it by
            changed_ns = max(before.mtime_ns, before.ctime_ns)
            if after == before and read_started_ns - changed_ns > RACY_WINDOW_NS:
                for old in [k for k in self.entries
                            if k[0].path == before.path and k[1] == params]:
                    del self.entries[old]
                self.entries[key] = value
                return copy(value)
            return value  # not stored: this caller's own

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
