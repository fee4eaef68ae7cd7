"""What a flavor module declares: one ``FLAVOR`` object whose fields are its capabilities.

The runtime asks a flavor a handful of questions (may null inputs reach the model? may several
threads call the predictor at once? how many rows per replica batch and per model call? what does
it check before Ray starts? does it have an ONNX Runtime backend?). Each answer is a typed field
here, with its default spelled out once, so a misspelt or mistyped capability fails when the
flavor module is imported instead of silently reading as "absent".

This module imports nothing heavy: the registry (``flavors/__init__.py``) imports it in every
driver, and a flavor module imports it before any model library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

Predictor = Callable[[Any, dict[str, Any]], dict[str, Any]]


class Load(Protocol):
    """``load(model_dir, manifest, device, threads, max_rows) -> predictor``: the model's own
    libraries are imported here, never at module import, so asking a flavor its capabilities
    costs no torch. ``max_rows``: the most rows of one model call, as ``flavors.call_rows``
    resolved it for the job."""

    def __call__(
        self, model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None
    ) -> Predictor: ...


class OptimizedLoad(Protocol):
    """``load`` of an ONNX Runtime backend: the flavor's arguments plus the backend, the accuracy
    floor against the flavor's own predictor, and where exports are cached."""

    def __call__(
        self,
        model_dir: Path,
        manifest: dict[str, Any],
        device: str,
        threads: int,
        max_rows: int | None = None,
        *,
        backend: str,
        min_cosine: float = ...,
        cache_root: Path,
    ) -> Predictor: ...


Preflight = Callable[[Path | None, dict[str, Any]], list[str]]


def no_preflight(model_dir: Path | None, manifest: dict[str, Any]) -> list[str]:
    """The check of a flavor that has nothing to check before Ray starts: no log lines."""
    return []


def _rows(owner: str, field: str, value: int | None, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{owner}: {field} must be a non-negative int, got {value!r}")


@dataclass(frozen=True)
class Flavor:
    """One model kind's adapter and what the runtime may assume about it.

    - ``load``: builds the predictor (see ``Load``).
    - ``preflight(model_dir, manifest) -> log lines``: the flavor's own checks in the driver before
      Ray starts (``model_dir`` is None when only the replicas fetch the model), e.g. types a skops
      file holds that nobody trusted.
    - ``allows_missing``: null/NaN inputs reach the model (tree libraries read them as missing
      values) instead of failing the batch first.
    - ``concurrent_calls``: the predictor may be called from several threads at once; the driver
      then loads it with one thread and calls it from as many threads as the job has.
    - ``transfer_rows``: rows per batch Ray hands a replica, preferred (0: exactly the job's rows
      per model call, so a user's own ``predict`` sees no more than asked).
    - ``gpu_transfer_rows``: the same on a GPU, where larger model calls want a larger sort window
      (None: ``transfer_rows``).
    - ``cpu_call_rows``: rows per model call on CPU when the job leaves ``JobSpec.max_batch_rows``
      unset (None: ``Tuning.call_rows``): a small model's call pays a fixed cost that larger calls
      share, and a text encoder has its own default. A job that sets ``max_batch_rows`` gets
      exactly that instead (``flavors.call_rows``).
    - ``call_rows_param``: the model parameter (``InputSpec.params``) that is the model's own rows
      per call (sentence-transformers' ``batch_size``): when the job sets it and leaves
      ``max_batch_rows`` unset, it is the rows per model call, on any device.
    - ``optimized``: the module of the flavor's ONNX Runtime backend (``JobSpec.backend="onnx"``
      or ``"onnx_int8"``), declaring ``BACKEND``; a module path, not the module, so a job that
      never asks for it never imports it. None: the flavor has no such backend.
    """

    name: str
    load: Load
    preflight: Preflight = no_preflight
    allows_missing: bool = False
    concurrent_calls: bool = False
    transfer_rows: int = 0
    gpu_transfer_rows: int | None = None
    cpu_call_rows: int | None = None
    call_rows_param: str | None = None
    optimized: str | None = None

    def __post_init__(self) -> None:
        owner = f"flavor {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise TypeError(f"a flavor needs a name, got {self.name!r}")
        for field in ("load", "preflight"):
            if not callable(getattr(self, field)):
                raise TypeError(f"{owner}: {field} must be callable")
        for field in ("allows_missing", "concurrent_calls"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{owner}: {field} must be a bool, got {getattr(self, field)!r}")
        _rows(owner, "transfer_rows", self.transfer_rows, optional=False)
        _rows(owner, "gpu_transfer_rows", self.gpu_transfer_rows, optional=True)
        _rows(owner, "cpu_call_rows", self.cpu_call_rows, optional=True)
        if self.call_rows_param is not None and not (isinstance(self.call_rows_param, str) and self.call_rows_param):
            raise TypeError(f"{owner}: call_rows_param must name a parameter, got {self.call_rows_param!r}")
        if self.optimized is not None and not (isinstance(self.optimized, str) and self.optimized):
            raise TypeError(f"{owner}: optimized must name a module, got {self.optimized!r}")


@dataclass(frozen=True)
class OptimizedBackend:
    """A flavor's ONNX Runtime backend (``Flavor.optimized`` names its module): ``load`` builds a
    predictor of the flavor's shape, and ``concurrent_calls`` says the same as the flavor's own
    field, for this backend's predictor."""

    flavor: str
    load: OptimizedLoad
    concurrent_calls: bool = False

    def __post_init__(self) -> None:
        if not callable(self.load):
            raise TypeError(f"the optimized backend of {self.flavor!r}: load must be callable")
        if not isinstance(self.concurrent_calls, bool):
            raise TypeError(f"the optimized backend of {self.flavor!r}: concurrent_calls must be a bool")
