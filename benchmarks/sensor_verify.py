"""What the sensor's default content check costs: one full read and sha256 of a committed output.

Writes ``--parts`` Parquet parts of random float64 (incompressible, so bytes on disk equal bytes
hashed) totalling about ``--gib`` GiB under ``--dir``, with a valid ``_SUCCESS``, then times
``read_valid_manifest`` as the sensor calls it:

- ``cold``: each part's pages dropped from the page cache first (``posix_fadvise(DONTNEED)`` on the
  part's own file, nothing else on the machine is touched), so the bytes come from the disk;
- ``warm``: the same again with the parts in the page cache (the sensor right after the commit);
- ``cached``: a second look at the same marker through the process's verdicts (names and sizes only);
- ``no checksums``: ``verify_checksums=False`` (names, sizes, footers), for reference;
- ``sha256 in memory``: hashlib over 256 MiB already in memory, the CPU's bound at that moment.

``python -m benchmarks.sensor_verify --dir /tmp/sensor-bench`` prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path


def write_output(run_dir: Path, gib: float, parts: int) -> int:
    """A committed run directory of ``parts`` parts, ``gib`` GiB in all; returns the bytes written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_provider_batchinfer.contract import Counts, FileEntry, JobRecord, Manifest, ModelRef, part_name

    run_dir.mkdir(parents=True, exist_ok=True)
    rows = int(gib * 2**30 / parts / 8 / 2)  # two float64 columns
    rng = np.random.default_rng(0)
    entries = []
    for n in range(parts):
        name = part_name(n, "bench")
        table = pa.table({"id": np.arange(n * rows, (n + 1) * rows, dtype=np.int64), "score": rng.random(rows)})
        pq.write_table(table, run_dir / name, compression="none", row_group_size=1 << 20)
        data_path = run_dir / name
        digest = hashlib.sha256(data_path.read_bytes()).hexdigest()
        entries.append(FileEntry(name=name, size=data_path.stat().st_size, rows=rows, sha256=digest))
    total = sum(e.size for e in entries)
    manifest = Manifest(
        run_dir=str(run_dir),
        files=tuple(entries),
        counts=Counts(input_rows=rows * parts, output_rows=rows * parts, error_rows=0),
        model=ModelRef(name="m", version="v1", flavor="python_class", sha256="0" * 64, uri="/registry/m/v1"),
        job=JobRecord(id="bench", attempt="bench"),
        input_locations=("/data/in",),
        input_files=("/data/in/a.parquet",),
    )
    (run_dir / "_SUCCESS").write_text(manifest.to_json())
    return total


def drop_from_page_cache(run_dir: Path) -> None:
    for path in run_dir.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/sensor-bench")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="leave the output in --dir")
    args = parser.parse_args()

    from airflow_provider_batchinfer.store.commit.verdicts import Verdicts
    from airflow_provider_batchinfer.store.committed import read_valid_manifest

    run_dir = Path(args.dir) / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    total = write_output(run_dir, args.gib, args.parts)
    verdicts = Verdicts()
    location = str(run_dir)
    drop_from_page_cache(run_dir)
    cold = timed(lambda: read_valid_manifest(location, verify_checksums=True, verdicts=verdicts))
    warm = timed(lambda: read_valid_manifest(location, verify_checksums=True))
    cached = timed(lambda: read_valid_manifest(location, verify_checksums=True, verdicts=verdicts))
    plain = timed(lambda: read_valid_manifest(location, verify_checksums=False))
    buffer = os.urandom(256 << 20)
    in_memory = timed(lambda: hashlib.sha256(buffer).digest())  # the CPU's bound on hashing, same moment
    mb = total / 1e6
    print(
        json.dumps(
            {
                "bytes": total,
                "parts": args.parts,
                "cold_s": round(cold, 3),
                "cold_MB_per_s": round(mb / cold, 1),
                "warm_s": round(warm, 3),
                "warm_MB_per_s": round(mb / warm, 1),
                "cached_s": round(cached, 4),
                "no_checksums_s": round(plain, 4),
                "sha256_in_memory_MB_per_s": round(len(buffer) / 1e6 / in_memory, 1),
                "load_avg": os.getloadavg(),
                "cpus": os.cpu_count(),
            }
        )
    )
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
