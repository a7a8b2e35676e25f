"""POSIX shared-memory and semaphore helpers shared by Ring and MetaBuffer.

Naming: a segment is ``/hybridgen-<instance>-<name>``; a semaphore that belongs to it is
``/hybridgen-<instance>-<name>.<role>`` (Linux shows it as ``/dev/shm/sem.hybridgen-...``).
`instance` may contain '-' but `name` and `role` may not, so the part after
``hybridgen-<instance>-`` never contains '-'; that is what keeps `unlink_all("a")` from
touching the segments of instance ``a-b``.

Ownership: the creator of a segment (the owner) calls `create_segment`, which first unlinks
any stale segment of the same name left by a crashed run, then creates it exclusively.
Peers only `attach_segment`. Segments are mapped and the file descriptor is closed at
once; the mapping keeps the memory alive until it is closed, even after an unlink.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import posix_ipc

PREFIX = "hybridgen"
SHM_DIR = Path("/dev/shm")
_INSTANCE_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
_NAME_RE = re.compile(r"[A-Za-z0-9_]{1,32}")
_MODE = 0o600


def _check_instance(instance: str) -> None:
    if not isinstance(instance, str) or not _INSTANCE_RE.fullmatch(instance):
        raise ValueError(f"instance must be 1..32 characters from [A-Za-z0-9_-], got {instance!r}")


def _check_name(name: str, what: str = "name") -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{what} must be 1..32 characters from [A-Za-z0-9_], got {name!r}")


def segment_name(instance: str, name: str) -> str:
    """The POSIX name ``/hybridgen-<instance>-<name>`` after validating both parts."""
    _check_instance(instance)
    _check_name(name)
    return f"/{PREFIX}-{instance}-{name}"


def semaphore_name(instance: str, name: str, role: str) -> str:
    """The POSIX name of semaphore `role` (e.g. 'items') of segment `name`."""
    _check_name(role, "role")
    return f"{segment_name(instance, name)}.{role}"


def unlink_segment(posix_name: str) -> bool:
    """Unlink a shared-memory segment; False when it did not exist."""
    try:
        posix_ipc.unlink_shared_memory(posix_name)
    except posix_ipc.ExistentialError:
        return False
    return True


def unlink_semaphore(posix_name: str) -> bool:
    """Unlink a named semaphore; False when it did not exist."""
    try:
        posix_ipc.unlink_semaphore(posix_name)
    except posix_ipc.ExistentialError:
        return False
    return True


def create_segment(posix_name: str, size: int) -> mmap.mmap:
    """Create-or-replace: unlink a stale segment of this name, create a zeroed one, map it."""
    if size <= 0:
        raise ValueError(f"segment size must be > 0 bytes, got {size}")
    unlink_segment(posix_name)
    shm = posix_ipc.SharedMemory(posix_name, posix_ipc.O_CREX, mode=_MODE, size=size)
    try:
        return mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()


def attach_segment(posix_name: str, populate: bool = False) -> mmap.mmap:
    """Map an existing segment at its full size; FileNotFoundError when it does not exist.
    `populate`: map every page now (MAP_POPULATE), so that the first read of each does not
    fault: a reader that streams the whole segment once in a while (the CPU daemon's experts)
    pays its page-table setup at attach, not in a served step."""
    try:
        shm = posix_ipc.SharedMemory(posix_name)
    except posix_ipc.ExistentialError as exc:
        raise FileNotFoundError(
            f"shared-memory segment {posix_name} does not exist (is its owner running?)"
        ) from exc
    try:
        if shm.size <= 0:
            raise ValueError(f"shared-memory segment {posix_name} is empty (owner still creating?)")
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(shm.fd, shm.size, flags=flags)
    finally:
        shm.close_fd()


def create_semaphore(posix_name: str, initial: int) -> posix_ipc.Semaphore:
    """Create-or-replace a counting semaphore with `initial` count."""
    if not 0 <= initial <= posix_ipc.SEMAPHORE_VALUE_MAX:
        raise ValueError(
            f"semaphore initial value must be in [0, {posix_ipc.SEMAPHORE_VALUE_MAX}], "
            f"got {initial}"
        )
    unlink_semaphore(posix_name)
    return posix_ipc.Semaphore(posix_name, posix_ipc.O_CREX, mode=_MODE, initial_value=initial)


def attach_semaphore(posix_name: str) -> posix_ipc.Semaphore:
    """Open an existing semaphore; FileNotFoundError when it does not exist."""
    try:
        return posix_ipc.Semaphore(posix_name)
    except posix_ipc.ExistentialError as exc:
        raise FileNotFoundError(
            f"semaphore {posix_name} does not exist (is its owner running?)"
        ) from exc


def list_instance(instance: str) -> list[tuple[str, str]]:
    """(kind, POSIX name) of every segment ('shm') and semaphore ('sem') of `instance`."""
    _check_instance(instance)
    stem = f"{PREFIX}-{instance}-"
    found: list[tuple[str, str]] = []
    try:
        entries = sorted(p.name for p in SHM_DIR.iterdir())
    except FileNotFoundError:  # not Linux: nothing to enumerate
        return found
    for entry in entries:
        base = entry[4:] if entry.startswith("sem.") else entry
        # The remainder has no '-' for our own names (see module docstring).
        if base.startswith(stem) and "-" not in base[len(stem) :]:
            found.append(("sem" if entry.startswith("sem.") else "shm", "/" + base))
    return found


def unlink_all(instance: str) -> list[str]:
    """Remove every /dev/shm segment and semaphore of `instance`; returns what was removed."""
    removed: list[str] = []
    for kind, posix_name in list_instance(instance):
        unlink = unlink_semaphore if kind == "sem" else unlink_segment
        if unlink(posix_name):
            removed.append(posix_name)
    return removed
