"""Which claim protocol a run directory's store speaks: the local one (``fence_local``), S3's
conditional writes (``fence``), or the base that refuses to fence. Sits above both variants so
that neither imports the other."""

from __future__ import annotations

from airflow_provider_batchinfer.store.commit.fence import ClaimStore, S3Claims
from airflow_provider_batchinfer.store.commit.fence_local import LocalClaims
from airflow_provider_batchinfer.store.stage import Stage


def claims_for(run_dir: Stage) -> ClaimStore:
    """The claim protocol for the store ``run_dir`` is on."""
    import pyarrow.fs as pafs

    if isinstance(run_dir.fs, pafs.LocalFileSystem):
        return LocalClaims(run_dir)
    if run_dir.fs.type_name == "s3":
        return S3Claims(run_dir)
    return ClaimStore(run_dir)
