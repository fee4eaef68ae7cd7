"""The claim and the conditional commit: the marker is written only while the claim names the
writing attempt, decided in the same atomic step as the write.

Reading ``_job.json`` and then writing ``_SUCCESS`` is not enough: an attempt that pauses between
the two (a GC pause, a stopped VM, SIGSTOP) and resumes after a newer try claimed the directory, or
even committed it, would write its marker over the newer one. Each store therefore gets a protocol
in which the write itself fails once the claim moved, and in which nobody ever waits for anybody
(a stopped process keeps its ``flock``; a lock would let a stopped zombie block every retry):

Local and POSIX filesystems (``fence_local.LocalClaims``): a claim grants its attempt a *token*,
the empty directory ``_claims/<attempt>/``; claiming (and clearing for OVERWRITE) revokes every
other token first, by removing its files and then the directory. The commit writes the marker *into its token*
(``_claims/<attempt>/_SUCCESS``, created without creating parents) and then renames it to
``_SUCCESS``. Both steps fail with ENOENT once the token is revoked: creating a file in a removed
directory is refused, and a rename and an unlink of the same name are serialized by the kernel, so
the rename either happens before the revoke (the attempt still held the claim: a valid commit,
which the newer attempt's clean-up removes next) or not at all. No lock, so a zombie stopped
anywhere blocks nothing. An empty directory is not a file: ``list_files`` never shows a token;
a committed attempt removes its token (and ``_claims/`` when empty).

S3 (:class:`S3Claims`): the token is the ETag of ``_job.json`` as read by the commit (a newer claim
writes different bytes, so a different ETag). The marker is written with ``If-None-Match: *``, so
a marker that is there already, a newer attempt's committed one included, is never overwritten;
then the claim's ETag is read again. Unchanged before and after the write means the claim was this
attempt's when the write happened (a valid commit). Changed means it may not have been: the
attempt deletes its own marker with ``If-Match: <its ETag>`` (never anybody else's) and fails. A
marker found at the key is replaced (``If-Match`` on its ETag) only by the attempt that holds the
claim, after checking that it still does: it can only be a zombie's. S3 writes are per key, so
there is a window no conditional write can close: between a zombie's write and its own re-check,
its marker is visible beside the newer attempt's claim, or beside no claim at all (a newer
attempt's revoke deletes ``_job.json``). The marker therefore records the claim it was committed
under (the claim's ETag, as the object's ``x-amz-meta-batchinfer-claim``), and readers check that
this very claim is still there (``markers.check_claim``).

All of this holds only on a store that honours the conditions: before its first claim and its
first marker a process asks the store (``s3_objects.ignored_conditions``, once per endpoint and
bucket) and refuses to claim or commit on one that ignores or rejects any of them
(:class:`ConditionalWritesUnsupported`), so no job runs in full only to be refused at its commit. A withdrawal that
fails is never swallowed (:class:`WithdrawalFailed`): the only refusal that counts as withdrawn is
the store saying the marker at the key is no longer this attempt's version (the claim's holder
replaced it, or a newer claim or clean-up removed it), checked by reading the key's ETag again.

Any other filesystem (:class:`ClaimStore` itself): check, then write, with no atomicity; see
``docs/commit-protocol.md``.

Storage layer: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from airflow_provider_batchinfer.contract import JOB_SPEC_FILE, SUCCESS_MARKER, JobFile
from airflow_provider_batchinfer.store.locations import StageError
from airflow_provider_batchinfer.store.s3 import S3StageError
from airflow_provider_batchinfer.store.stage import Stage

__all__ = [
    "CLAIMS_DIR",
    "CLAIM_METADATA",
    "PAUSE_ENV",
    "PROBE_DIR",
    "ClaimLost",
    "ClaimStore",
    "ConditionalWritesUnsupported",
    "Hold",
    "WithdrawalFailed",
    "pause_for_test",
]

#: the directory of commit tokens inside a local run directory: ``_claims/<attempt>/``
CLAIMS_DIR = "_claims"
#: test-only: the name of a point at which the process stops itself (SIGSTOP); see pause_for_test
PAUSE_ENV = "BATCHINFER_TEST_PAUSE_AT"
_MARKER_ROUNDS = 5
#: where in a run directory the conditional-write probe puts (and removes) its objects
PROBE_DIR = "_probe"
#: the S3 marker's user metadata naming the ETag of the claim it was committed under
CLAIM_METADATA = "batchinfer-claim"


class ClaimLost(StageError):
    """The conditional step found that the claim no longer names this attempt; nothing of it is
    committed."""


class ConditionalWritesUnsupported(S3StageError):
    """The store ignores or rejects a conditional request the commit relies on, so it cannot keep a
    zombie's marker from replacing a newer attempt's: nothing is claimed or committed there, and no
    retry changes that (an S3StageError, so the operator fails the task without retries)."""

    permanent = True


class WithdrawalFailed(StageError):
    """An attempt whose claim moved while it wrote its marker could not delete that marker: it
    stays visible until the claim's holder commits (and replaces it) or a retry's claim removes it.
    Readers refuse it meanwhile (its claim is not there, or names another attempt)."""


@dataclass(frozen=True)
class Hold:
    """An attempt's hold on a claim: the job file as read and the token the commit is conditioned
    on (local: the attempt, whose token directory must still exist; S3: the claim's ETag)."""

    job: JobFile
    token: str

    @property
    def attempt(self) -> str:
        return self.job.attempt


def pause_for_test(point: str) -> None:
    """Test-only: stop this process (SIGSTOP) when ``BATCHINFER_TEST_PAUSE_AT`` names ``point``, so
    a test can let another attempt act and then continue it (SIGCONT). Never set in production."""
    if os.environ.get(PAUSE_ENV) == point:
        os.kill(os.getpid(), signal.SIGSTOP)


class ClaimStore:
    """The claim protocol of one run directory's store (see the module docstring)."""

    def __init__(self, run_dir: Stage) -> None:
        self.run_dir = run_dir
        self.job_file = run_dir.child(JOB_SPEC_FILE)
        self.marker = run_dir.child(SUCCESS_MARKER)

    def read(self) -> tuple[bytes, str] | None:
        """The claim's bytes and its version (the token's ingredient); None when there is none."""
        if not self.job_file.exists():
            return None
        return self.job_file.read_bytes(), ""

    def token(self, attempt: str, version: str) -> str:
        return attempt

    def granted(self, attempt: str) -> bool:
        """Whether the token a claim grants ``attempt`` is there (always, where the token is the
        claim's version itself)."""
        return True

    def held(self, hold: Hold) -> bool:
        """Whether the claim is still ``hold``'s, now."""
        read = self.read()
        return read is not None and JobFile.from_json(read[0], self.job_file.location).attempt == hold.attempt

    def revoke(self) -> None:
        """From here on, no attempt holding the claim so far can commit."""

    def grant(self, attempt: str) -> None:
        """Give ``attempt`` (whose claim was just written) the right to commit."""

    def require_conditional_writes(self, attempt: str, refusing: str) -> None:
        """ConditionalWritesUnsupported (its message starting with ``refusing``: what is not done)
        unless the store supports what this protocol relies on; nothing to ask here."""

    def write_marker(self, hold: Hold, data: bytes) -> None:
        """Write ``data`` as ``_SUCCESS`` only while ``hold`` still holds the claim; ClaimLost else."""
        pause_for_test("marker:checked")
        if not self.held(hold):
            raise ClaimLost("the claim moved before the marker was written")
        self.marker.write_bytes(data)


class S3Claims(ClaimStore):
    """The claim's ETag and conditional writes: see the module docstring."""

    def read(self) -> tuple[bytes, str] | None:
        from airflow_provider_batchinfer.store import s3_objects

        found = s3_objects.get(self.job_file)
        return None if found is None else (found.body, found.etag)

    def token(self, attempt: str, version: str) -> str:
        return version

    def held(self, hold: Hold) -> bool:
        from airflow_provider_batchinfer.store import s3_objects

        return s3_objects.head_etag(self.job_file) == hold.token

    def revoke(self) -> None:
        from airflow_provider_batchinfer.store import s3_objects

        s3_objects.delete(self.job_file)

    def write_marker(self, hold: Hold, data: bytes) -> None:
        self.require_conditional_writes(hold.attempt, f"not committing {self.marker.location}")
        pause_for_test("marker:checked")
        etag = self._put(hold, data)
        pause_for_test("marker:written")
        try:
            if self.held(hold):
                return
        except Exception:
            self._withdraw(etag)  # unknown whether the claim held: a failed commit leaves no marker
            raise
        self._withdraw(etag)
        raise ClaimLost("the claim moved while the marker was written; this attempt's marker was withdrawn")

    def require_conditional_writes(self, attempt: str, refusing: str) -> None:
        """ConditionalWritesUnsupported unless the store honours the conditions the commit relies on
        (asked once per process and bucket, with a probe object under ``_probe/`` in this run
        directory: the one prefix the attempt is sure to be allowed to write, removed again). The
        claim asks too, so a job on such a store is refused before it starts; its commit then
        finds the answer kept."""
        from airflow_provider_batchinfer.store import s3_objects

        ignored = s3_objects.ignored_conditions(self.run_dir.child(PROBE_DIR), attempt)
        if ignored:
            raise ConditionalWritesUnsupported(
                f"{refusing}: {s3_objects.store_name(self.run_dir)} does not honour the conditional requests the "
                f"commit relies on ({'; '.join(ignored)}), so a stopped attempt that goes on later could replace or "
                "delete a newer attempt's committed marker. Write the output to a store that honours S3 conditional "
                "writes (AWS S3 general purpose buckets, MinIO), or to local/POSIX storage"
            )

    def _withdraw(self, etag: str) -> None:
        """Delete this attempt's own marker, and only that version of it. A refusal counts as
        withdrawn only when the key no longer holds that version (the claim's holder replaced it,
        or a newer claim or clean-up removed it); anything else fails loudly (WithdrawalFailed)."""
        from airflow_provider_batchinfer.store import s3_objects

        try:
            for _ in range(_MARKER_ROUNDS):
                try:
                    s3_objects.delete(self.marker, if_match=etag)
                    return
                except s3_objects.PreconditionFailed:
                    if s3_objects.head_etag(self.marker) != etag:
                        return  # not ours any more: the owner's, or gone
                    # still ours: a concurrent request on the key won (409); ask again
            raise StageError(f"{self.marker.location} kept being changed by concurrent requests")
        except StageError as exc:
            raise WithdrawalFailed(
                f"the claim on {self.run_dir.location} moved while this attempt wrote {self.marker.location}, "
                f"and its marker (ETag {etag}) could not be withdrawn: {exc}. Until a newer attempt commits or a "
                "retry of the task claims the directory, the marker stays, and readers refuse it (its claim is "
                "gone or names another attempt). Check that the task's credentials may delete objects there"
            ) from exc

    def _put(self, hold: Hold, data: bytes) -> str:
        """Create the marker; a marker already there is replaced only by the claim's holder."""
        from airflow_provider_batchinfer.store import s3_objects

        claim = {CLAIM_METADATA: hold.token}  # what readers check the marker's claim against
        for _ in range(_MARKER_ROUNDS):
            try:
                return s3_objects.put(self.marker, data, if_none_match=True, metadata=claim)
            except s3_objects.PreconditionFailed:
                pass
            found = s3_objects.get(self.marker)
            if found is None:
                continue  # removed meanwhile: create it again
            if found.body == data:
                return found.etag  # this very write, answered late and retried by the client
            if not self.held(hold):  # never replace a marker without the claim: it may be the owner's
                raise ClaimLost("a marker is there already and the claim moved")
            try:
                return s3_objects.put(self.marker, data, if_match=found.etag, metadata=claim)
            except s3_objects.PreconditionFailed:
                continue
        raise StageError(f"{self.marker.location} kept changing while it was written; not committed")
