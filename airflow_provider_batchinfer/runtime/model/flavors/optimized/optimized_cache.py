"""What the optimized backends (``JobSpec.backend="onnx" | "onnx_int8"``) share: the per-node cache
of exports, dynamic INT8 quantization, the accuracy guard and its refusal.

Why one place: each backend (``optimized_text.py`` for sentence-transformers, ``optimized_torchscript.py``
for TorchScript models) exports a model once per version and node, and every job decides from the
stored figures whether it may use the export. The cache layout, the lock that makes concurrent
replicas export once, and the rule that refuses a backend below ``JobSpec.backend_min_cosine`` must
not drift apart between them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from airflow_provider_batchinfer.runtime.errors import JobError


class BackendRefusedError(JobError):
    """The optimized backend cannot serve this model (unsupported structure, or its outputs are too
    far from PyTorch's): no retry can change that, so the job fails before scoring anything."""

    permanent = True


def optimized_dir(cache_root: Path, sha256: str, backend: str, export_format: int) -> Path:
    """Where the export of one model version (``sha256``) for ``backend`` lives on this node:
    content-addressed, so versions never collide; ``export_format`` changes when an export made by an
    older release can no longer be read."""
    return cache_root / "optimized" / sha256 / f"{backend}-v{export_format}"


#: beside each export: the sha256 of every file it holds (``info.json`` included), written last
DIGEST_FILE = "export.sha256.json"


def export_digest(directory: Path) -> dict[str, str]:
    """``{file: sha256}`` of every file of an export but the digest itself."""
    import hashlib

    out: dict[str, str] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != DIGEST_FILE):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        out[path.relative_to(directory).as_posix()] = h.hexdigest()
    return out


def export_damage(target: Path) -> str | None:
    """Why the export at ``target`` is not what was exported (a file changed, added or removed since,
    or no digest), or None when every file matches its recorded sha256."""
    try:
        recorded = json.loads((target / DIGEST_FILE).read_text())
    except (OSError, ValueError):
        return f"it has no readable {DIGEST_FILE}"
    actual = export_digest(target)
    for name in sorted(set(recorded) | set(actual)):
        if recorded.get(name) != actual.get(name):
            what = "was added" if name not in recorded else "is missing" if name not in actual else "changed"
            return f"its file {name} {what} after it was exported"
    return None


def prepare(
    target: Path, export: Callable[[Path], dict[str, Any]], complete: Callable[[Path], bool]
) -> tuple[Path, dict[str, Any], bool]:
    """The cached export at ``target``, made now with ``export(work_dir) -> info`` when missing:
    (its directory, its ``info.json``, whether this call exported it). It is built in a temporary
    directory and renamed into place under a file lock, so concurrent replicas on one node export
    once and never read a half-written one. Every file of the export, ``info.json`` (the accuracy
    guard's figures) included, is hashed into :data:`DIGEST_FILE` when it is made and checked on
    every use: an export changed since (a disk fault, a hand edit) is said so and exported again."""
    import fcntl

    if complete(target) and export_damage(target) is None:
        return target, json.loads((target / "info.json").read_text()), False
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete(target):
            damage = export_damage(target)
            if damage is None:
                return target, json.loads((target / "info.json").read_text()), False
            print(f"[batchinfer] cached export at {target} is refused: {damage}; exporting it again", flush=True)
        shutil.rmtree(target, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            info = export(work)
            (work / "info.json").write_text(json.dumps(info))
            (work / DIGEST_FILE).write_text(json.dumps(export_digest(work)))
            os.replace(work, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target, info, True


def has_files(target: Path, *names: str) -> bool:
    """Whether ``target`` holds a finished export: an ``info.json`` with the guard's figures and
    each of ``names``."""
    try:
        info = json.loads((target / "info.json").read_text())
    except (OSError, ValueError):
        return False
    return "cosine_mean" in info and all((target / name).exists() for name in names)


def int8_weights_need_reduced_range(cpuinfo: str | None = None, machine: str | None = None) -> bool:
    """Whether INT8 weights must be quantized to 7 bits (``reduce_range``) on this node.

    ONNX Runtime multiplies u8 activations by s8 weights with ``vpmaddubsw`` on an x86 CPU without
    VNNI, which saturates at 16 bits: with full 8-bit weights a tiny MLP's outputs agreed with
    PyTorch's at a cosine of 0.9894 on an AVX2-only AMD EPYC, 0.9998 with 7-bit ones (MiniLM's least
    cosine 0.9838 vs 0.9871). A CPU with VNNI (or AMX) has no such limit and keeps all 8 bits; an
    x86 whose flags cannot be read is treated as lacking it. Other architectures have no such path.
    """
    import platform

    if (machine or platform.machine()).lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return not {"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags)


def quantize_int8(fp32: Path, out: Path) -> bool:
    """Dynamic INT8 weights, per channel (per-tensor INT8 cost MiniLM ~0.04 of mean cosine, per
    channel ~0.006); activations stay float and are quantized on the fly. ``fp32`` is removed.
    Returns whether the weights were kept to 7 bits (:func:`int8_weights_need_reduced_range`), for
    the export's ``info.json``."""
    from onnx import TensorProto
    from onnxruntime.quantization import QuantType, quantize_dynamic

    reduced = int8_weights_need_reduced_range()
    quantize_dynamic(
        str(fp32),
        str(out),
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=reduced,
        extra_options={"DefaultTensorType": TensorProto.FLOAT},
    )
    fp32.unlink()
    return reduced


def cosines(reference: np.ndarray, mine: np.ndarray) -> np.ndarray:
    """The cosine similarity of each row of ``mine`` to the same row of ``reference`` (two rows
    that are both all zeros agree: 1.0)."""
    dot = np.sum(reference * mine, axis=1)
    norms = np.linalg.norm(reference, axis=1) * np.linalg.norm(mine, axis=1)
    both_zero = (norms < 1e-12) & (np.abs(reference - mine).max(axis=1, initial=0.0) < 1e-6)
    return np.where(both_zero, 1.0, dot / np.maximum(norms, 1e-12))


def check_guard(info: dict[str, Any], min_cosine: float, model: str, compared: str) -> None:
    """Refuse the backend when its outputs are further from PyTorch's than the job allows.
    ``compared`` says what the figure compares, for the message (e.g. "embeddings ... sample texts")."""
    if info["cosine_mean"] < min_cosine:
        other = "; JobSpec(backend='onnx') keeps fp32 weights" if info["backend"] == "onnx_int8" else ""
        raise BackendRefusedError(
            f"backend {info['backend']!r} refused for {model}: its {compared} agree with PyTorch's at a mean cosine "
            f"similarity of {info['cosine_mean']:.4f} (least {info['cosine_min']:.4f}), below "
            f"JobSpec.backend_min_cosine={min_cosine:g}. Nothing was scored. Run it with "
            f"JobSpec(backend=None) (PyTorch){other}, or lower backend_min_cosine if that accuracy is enough"
        )
