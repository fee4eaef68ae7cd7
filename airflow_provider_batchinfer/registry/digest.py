"""What a version's digest covers, and the check that a version is still what was logged.

A version runs as its files *and* its ``MODEL.json`` say: the flavor picks the loader, the options
pick the class, the code directory and the trust flags, the signature picks the columns. So the
digest (format ``batchinfer.digest/2``, named by the manifest's ``digest`` field) is one sha256 over
every file's path and sha256 and over every field of ``MODEL.json`` but two kinds:

* the descriptive fields, :data:`DESCRIPTIVE_FIELDS`, an allow-list: a field added later is covered
  unless it is added here;
* the record itself, :data:`RECORD_FIELDS`: the digest, the per-file hashes (hashed as files) and
  the per-field record, plus the name and version, which are checked against where the manifest
  is stored instead (a content name is derived from the digest, so cannot be inside it).

The ``digest`` field is itself covered, and each format hashes with its own prefix, so a manifest
rewritten into another format never reproduces a digest that was pinned.

``field_digests`` records the sha256 of each covered field (top-level fields, and the entries of a
top-level object one level down: ``options.class``, ``signature.inputs``) so that a mismatch names
what was edited. It only explains a mismatch; the digest alone decides.

Versions logged before this format carry no ``digest`` field: their digest is the files-only
:func:`~airflow_provider_batchinfer.registry.versions.tree_digest`, and their ``MODEL.json`` fields
are not covered (docs/models.md, "What a version's digest covers").
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from airflow_provider_batchinfer.registry.versions import MODEL_MANIFEST, RegistryError, TamperedModelError, tree_digest

DIGEST_KEY = "digest"
DIGEST_FORMAT = "batchinfer.digest/2"
FIELD_DIGESTS = "field_digests"
# edited freely: they describe a version and decide nothing about what runs ("mlflow": where an
# imported model came from, read by people and lineage, never by a loader; the same bytes imported
# through two URIs are one digest)
DESCRIPTIVE_FIELDS = frozenset({"description", "created_at", "mlflow"})
# the record the digest is checked against, and the names checked against the version's location
RECORD_FIELDS = frozenset({"sha256", "files", FIELD_DIGESTS, "name", "version"})
# ``version=None`` names a version after its digest; nobody else may use such a name
CONTENT_NAME = re.compile(r"^sha-([0-9a-f]{12})$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def content_name(digest: str) -> str:
    return f"sha-{digest[:12]}"


def _segment(key: str) -> str:
    """A field path segment, escaped so that ``{"a.b": 1}`` and ``{"a": {"b": 1}}`` differ."""
    return key.replace("\\", "\\\\").replace(".", "\\.")


def _value_digest(value: Any) -> str:
    # key order kept: a signature's column order is its feature order
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def covered_fields(manifest: dict[str, Any]) -> dict[str, str]:
    """``{field path: sha256 of its JSON}`` of every covered field of ``manifest``, sorted."""
    out: dict[str, str] = {}
    for key, value in manifest.items():
        if key in DESCRIPTIVE_FIELDS or key in RECORD_FIELDS:
            continue
        if isinstance(value, dict) and value:
            for sub, inner in value.items():
                out[f"{_segment(key)}.{_segment(str(sub))}"] = _value_digest(inner)
        else:
            out[_segment(key)] = _value_digest(value)
    return dict(sorted(out.items()))


def version_digest(manifest: dict[str, Any], files: dict[str, dict[str, Any]] | None = None) -> str:
    """The digest of a version under its manifest's own format: ``files`` (default: the recorded
    ones) and, from format 2 on, the covered fields of ``manifest``."""
    files = manifest.get("files") if files is None else files
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _HEX64.match(entry["sha256"])
        for entry in files.values()
    ):
        raise TamperedModelError(f"{MODEL_MANIFEST}'s files are not a map of path to sha256; refusing to use it")
    fmt = manifest.get(DIGEST_KEY)
    if fmt is None:  # logged before the fields were covered
        return tree_digest(files)
    if fmt != DIGEST_FORMAT:
        raise RegistryError(
            f"{MODEL_MANIFEST} has an unknown digest format {fmt!r} (this provider knows {DIGEST_FORMAT!r}); "
            "was it logged by a newer version of the provider?"
        )
    h = hashlib.sha256(f"{DIGEST_FORMAT}\n".encode())
    for rel in sorted(files):
        h.update((json.dumps(["file", rel, files[rel]["sha256"]]) + "\n").encode())
    for path, digest in covered_fields(manifest).items():
        h.update((json.dumps(["field", path, digest]) + "\n").encode())
    return h.hexdigest()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` as it is read back from JSON, in the current format: its ``digest`` marker, its
    ``field_digests`` and its ``sha256`` filled in (the name and version are not part of it)."""
    sealed: dict[str, Any] = json.loads(json.dumps({**manifest, DIGEST_KEY: DIGEST_FORMAT}, default=str))
    sealed[FIELD_DIGESTS] = covered_fields(sealed)
    sealed["sha256"] = version_digest(sealed)
    return sealed


def _what_changed(manifest: dict[str, Any]) -> str:
    """Which covered fields differ from the per-field record made when the version was logged."""
    recorded = manifest.get(FIELD_DIGESTS)
    if manifest.get(DIGEST_KEY) is None or not isinstance(recorded, dict):
        return f"its {MODEL_MANIFEST} or its files changed after it was logged"
    actual = covered_fields(manifest)
    changed = []
    for path in sorted(set(recorded) | set(actual)):
        if path not in actual:
            changed.append(f"{MODEL_MANIFEST} field {path} was removed after the model was logged")
        elif path not in recorded:
            changed.append(f"{MODEL_MANIFEST} field {path} was added after the model was logged")
        elif recorded[path] != actual[path]:
            changed.append(f"{MODEL_MANIFEST} field {path} differs from what was logged")
    return "; ".join(changed) or f"its {MODEL_MANIFEST} was edited after the model was logged"


def check_version(
    manifest: dict[str, Any],
    where: str,
    files: dict[str, dict[str, Any]] | None = None,
    *,
    name: str | None = None,
    version: str | None = None,
    expected_sha256: str | None = None,
) -> str:
    """The version's digest, recomputed from ``files`` (default: the recorded hashes) and the
    manifest's fields, once it matches the manifest's own record, the pinned ``expected_sha256``
    and, for a content-named ``version``, the name. ``name``/``version``: where it is stored; the
    manifest must name the same. Raises TamperedModelError naming what differs."""
    if (name is not None and manifest.get("name") != name) or (
        version is not None and manifest.get("version") != version
    ):
        raise TamperedModelError(
            f"{where}/{MODEL_MANIFEST} names model {manifest.get('name')!r} version {manifest.get('version')!r} "
            f"but is stored as {name}/{version}; refusing to use it"
        )
    digest = version_digest(manifest, files)
    if digest != manifest.get("sha256"):
        raise TamperedModelError(f"model at {where}: {_what_changed(manifest)}; refusing to use it")
    if expected_sha256 and digest != expected_sha256:
        raise TamperedModelError(
            f"model at {where} has sha256 {digest[:12]}… but {expected_sha256} was pinned; refusing to use it"
        )
    named = CONTENT_NAME.match(version or "")
    if named and named.group(1) != digest[:12]:
        raise TamperedModelError(
            f"model at {where}: its version name {version} is not the digest of its content "
            f"(sha256 {digest[:12]}…): a content-named version was rewritten; refusing to use it"
        )
    return digest
