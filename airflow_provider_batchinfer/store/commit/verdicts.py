"""What this process already knows of committed markers: a bounded cache of verdicts.

A sensor's pokes and a triggerer's triggers look at the same ``_SUCCESS`` again and again; once
its files checked out, a later look needs only the marker and one listing (``markers.py`` decides
what is checked; this module only remembers). Nothing here reads storage.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from airflow_provider_batchinfer.store.locations import normalized_location

__all__ = ["PROCESS_VERDICTS", "Verdicts"]


class Verdicts:
    """Markers whose files this process checked and found as committed. A verdict's key is the
    marker's location, the storage's public settings, the sha256 of the marker's bytes and what was
    checked (footers alone, or footers and checksums: a verdict without checksums never stands in
    for one with them); its value is the seal of the listing it was given over (``markers._seal``). Any
    change to the marker is a new key and any change to a listed file a new seal, so a verdict never
    outlives the manifest or the files it was given for. Bounded (the oldest verdicts go first) and
    thread-safe: a triggerer checks from several threads, and the first looks at one marker from
    several of them (triggers deferred together) wait for one check (:meth:`first_look`) instead of
    each reading every part."""

    def __init__(self, limit: int = 1024) -> None:
        self._seen: OrderedDict[str, str] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()
        self._looking: dict[str, tuple[threading.Lock, list[int]]] = {}

    @staticmethod
    def key(
        location: str, marker: bytes, storage_options: Mapping[str, Any] | None, *, verify_checksums: bool = True
    ) -> str:
        from airflow_provider_batchinfer.store.s3 import PUBLIC_KEYS

        options = storage_options or {}
        public = {k: options[k] for k in PUBLIC_KEYS if k in options}  # never a credential
        checked = "sha256" if verify_checksums else "footers"
        where = json.dumps([normalized_location(location), public, checked], sort_keys=True, default=str).encode()
        return hashlib.sha256(where + b"\0" + hashlib.sha256(marker).digest()).hexdigest()

    def holds(self, key: str, seal: str = "") -> bool:
        with self._lock:
            if key in self._seen and self._seen[key] == seal:
                self._seen.move_to_end(key)
                return True
            return False

    def add(self, key: str, seal: str = "") -> None:
        with self._lock:
            self._seen[key] = seal
            self._seen.move_to_end(key)
            while len(self._seen) > self._limit:
                self._seen.popitem(last=False)

    @contextmanager
    def first_look(self, key: str) -> Iterator[None]:
        """One thread at a time looks at ``key``: while one checks the files, the others wait and
        then find its verdict (or check again, when it found a problem)."""
        with self._lock:
            lock, waiting = self._looking.setdefault(key, (threading.Lock(), [0]))
            waiting[0] += 1
        try:
            with lock:
                yield
        finally:
            with self._lock:
                waiting[0] -= 1
                if not waiting[0]:
                    del self._looking[key]


#: the process's verdicts: what the sensor and the trigger share
PROCESS_VERDICTS = Verdicts()
