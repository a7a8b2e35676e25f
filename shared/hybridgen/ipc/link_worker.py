"""The CPU daemon's side of a request/answer link (ipc/link.py): a thread that waits
for the GPU daemon's shared memory, then answers each request; attn_warm's (warm_link.py)
and Cold-Weights' experts (expert_link.py) are the two."""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

from hybridgen.ipc.link import LinkShm
from hybridgen.ipc.ticket import Ticket

T = TypeVar("T")


class LinkWorker(Generic[T]):
    """Answers the `ask` ring's requests with `_answer`, over a resource that `_open` maps
    (the Warm pool, the expert arena) once the GPU daemon has published it."""

    ask, answer = "", ""
    """The link's ring names (GPU -> CPU, CPU -> GPU)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.ask, daemon=True)
        self.answered = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _open(self) -> T:
        """The resource the answers read; FileNotFoundError or ValueError until published."""
        raise NotImplementedError

    def _close(self, resource: T) -> None:
        """Unmap what `_open` mapped."""

    def _answer(self, shm: LinkShm, resource: T, ticket: Ticket) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        shm: LinkShm | None = None
        resource: T | None = None
        try:
            while not self._stop.is_set() and (shm is None or resource is None):
                try:
                    shm = shm or LinkShm.attach(self.instance, self.ask, self.answer, wait=0.5)
                    resource = resource if resource is not None else self._open()
                except (FileNotFoundError, ValueError):
                    time.sleep(0.2)
            while not self._stop.is_set():
                assert shm is not None and resource is not None
                ticket = shm.ask.get(0.2)
                if ticket is not None:
                    self._answer(shm, resource, ticket)
        finally:
            if resource is not None:
                self._close(resource)
            if shm is not None:
                shm.close()
