"""A model for the RESUME identity tests, self-contained: the registry copies this file with the
model and the runtime imports it on its own (no ``tests`` package there)."""

from __future__ import annotations

#: where a job scoring with :class:`OffsetLength` stops itself, when ``BATCHINFER_TEST_PAUSE_AT``
#: names it: before its third model call (the first rows of its second 100-row input file, in
#: calls of 50 rows), so a test can freeze it mid-job and let a newer try act (``fence.pause_for_test``)
PAUSE_POINT = "resume:third-model-call"


class OffsetLength:
    """The length of each text plus the ``offset`` param, so rows scored under other params, or from
    other texts, show in every value. A text ``boom`` fails its batch (an injected bad row)."""

    calls = 0

    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch, offset=0):
        type(self).calls += 1
        if type(self).calls == 3:
            from airflow_provider_batchinfer.store.commit.fence import pause_for_test

            pause_for_test(PAUSE_POINT)
        if (batch["text"] == "boom").any():
            raise ValueError("cannot score text 'boom'")
        return {"length": batch["text"].str.len().to_numpy() + int(offset)}
