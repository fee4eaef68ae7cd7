"""The OpenLineage methods of :class:`BatchInferenceOperator`, which
apache-airflow-providers-openlineage calls when it is installed. ``lineage.py`` builds the facets
from the operator's rendered fields and, after a commit, from its ``_SUCCESS`` manifest."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from airflow_provider_batchinfer.operators.batch_inference import BatchInferenceOperator


class OpenLineageMethods:
    """Mixed into the operator: each method hands the operator itself to ``lineage.operator_lineage``."""

    def _operator(self) -> BatchInferenceOperator:
        return cast("BatchInferenceOperator", self)

    def get_openlineage_facets_on_start(self) -> Any:
        """Inputs, the model and (with a fixed ``stage_location``) the output, before the job runs."""
        from airflow_provider_batchinfer.operators.lineage import operator_lineage

        return operator_lineage(self._operator())

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Inputs, the model and the run directory, with schemas and statistics from ``_SUCCESS``."""
        from airflow_provider_batchinfer.operators.lineage import operator_lineage

        return operator_lineage(self._operator(), task_instance)

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        """What the task meant to read and write; nothing from a manifest (none of this try's)."""
        from airflow_provider_batchinfer.operators.lineage import operator_lineage

        return operator_lineage(self._operator(), task_instance, committed=False)
