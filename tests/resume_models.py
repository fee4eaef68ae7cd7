"""A model for the RESUME identity tests, self-contained: the registry copies this file with the
model and the runtime imports it on its own (no ``tests`` package there)."""

from __future__ import annotations


class OffsetLength:
    """The length of each text plus the ``offset`` param, so rows scored under other params, or from
    other texts, show in every value. A text ``boom`` fails its batch (an injected bad row)."""

    @classmethod
    def load(cls, path):
        return cls()

    def predict(self, batch, offset=0):
        if (batch["text"] == "boom").any():
            raise ValueError("cannot score text 'boom'")
        return {"length": batch["text"].str.len().to_numpy() + int(offset)}
