"""A versioned, immutable model registry on a stage.

Layout: ``<registry>/<name>/<version>/MODEL.json`` (the manifest, written last) beside the files it
hashes (``artifact/...`` and, for the Python flavor, ``code/...``). A version is immutable: logging
it again is refused unless the content is identical (``if_exists="reuse"``), and loading it
re-hashes every file and recomputes the digest, which covers ``MODEL.json``'s behavioural fields too
(``digest.py``), so a model that changed after it was logged is never used. Both sides use
this module (the operator resolves versions, every Ray worker verifies before loading), so it
imports neither Airflow nor Ray.
"""

from airflow_provider_batchinfer.registry.artifacts import normalize_signature
from airflow_provider_batchinfer.registry.fetch import (
    MODEL_CACHE_ENV,
    fetch_version,
    model_cache_dir,
    verify_local_copy,
)
from airflow_provider_batchinfer.registry.store import ModelRegistry
from airflow_provider_batchinfer.registry.versions import (
    FLAVORS,
    MODEL_MANIFEST,
    PRETRAINED_FLAVORS,
    REGISTRY_FORMAT,
    ModelNotFoundError,
    ModelVersion,
    ModelVersionExistsError,
    RegistryError,
    TamperedModelError,
    check_name,
    hash_tree,
    sha256_file,
    tree_digest,
)

__all__ = [
    "FLAVORS",
    "MODEL_CACHE_ENV",
    "MODEL_MANIFEST",
    "PRETRAINED_FLAVORS",
    "REGISTRY_FORMAT",
    "ModelNotFoundError",
    "ModelRegistry",
    "ModelVersion",
    "ModelVersionExistsError",
    "RegistryError",
    "TamperedModelError",
    "check_name",
    "fetch_version",
    "hash_tree",
    "model_cache_dir",
    "normalize_signature",
    "sha256_file",
    "tree_digest",
    "verify_local_copy",
]
