"""Every flavor declares its capabilities as one typed ``Flavor`` object, and the registry finds them
without importing a model library: a job that scores a plain Python model starts without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from airflow_provider_batchinfer.runtime.model import flavors
from airflow_provider_batchinfer.runtime.model.flavors.optimized.optimized_cache import BackendRefusedError
from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor, OptimizedBackend, no_preflight

# the capabilities as the flavor modules declared them before they were one typed object: the
# runtime's behaviour for each flavor stays what it was
EXPECTED = {
    # name: (allows_missing, concurrent_calls, transfer_rows, gpu_transfer_rows, cpu_call_rows, optimized)
    "torchscript": (False, False, 65536, None, 4096, True),
    # cpu_call_rows 32: encode's own default, the CPU call size when JobSpec.max_batch_rows is unset
    "sentence_transformers": (False, False, 4096, 8192, 32, True),
    "python": (False, False, 0, None, None, False),
    "text_generation": (False, False, 0, None, None, False),
    "image_classification": (False, False, 0, None, None, False),
    "sklearn": (True, False, 65536, None, 16384, False),
    "xgboost": (True, True, 65536, None, 16384, False),
    "lightgbm": (True, False, 65536, None, 16384, False),
    "onnx": (False, False, 65536, None, None, False),
    "transformers_pipeline": (False, False, 1024, None, None, False),
    "mlflow_pyfunc": (False, False, 0, None, None, False),
}


@pytest.mark.parametrize("name", flavors.names())
def test_every_registered_flavor_declares_a_valid_flavor_object(name: str) -> None:
    declared = flavors.flavor(name)
    assert isinstance(declared, Flavor) and declared.name == name
    assert callable(declared.load) and callable(declared.preflight)
    allows_missing, concurrent, transfer, gpu_transfer, cpu_call, optimized = EXPECTED[name]
    assert declared.allows_missing is allows_missing
    assert declared.concurrent_calls is concurrent
    assert declared.transfer_rows == transfer
    assert declared.gpu_transfer_rows == gpu_transfer
    assert declared.cpu_call_rows == cpu_call
    backend = flavors.optimized_backend(name)
    assert (backend is not None) is optimized
    if backend is not None:
        assert isinstance(backend, OptimizedBackend) and backend.flavor == name and callable(backend.load)


def test_the_registry_holds_exactly_the_expected_flavors_and_only_sklearn_checks_before_ray() -> None:
    assert set(flavors.names()) == set(EXPECTED)
    checking = {name for name in flavors.names() if flavors.flavor(name).preflight is not no_preflight}
    assert checking == {"sklearn", "python"}  # python: names an import from installed packages
    assert flavors.optimized_flavors() == ("sentence_transformers", "torchscript")
    # the text encoder's ONNX Runtime session takes concurrent calls; the torchscript export's does not
    concurrent = {name: flavors.optimized_backend(name).concurrent_calls for name in flavors.optimized_flavors()}  # type: ignore[union-attr]
    assert concurrent == {"sentence_transformers": True, "torchscript": False}


def test_a_flavor_with_a_mistyped_capability_is_refused_when_declared() -> None:
    def load(*args: object, **kwargs: object) -> None:
        return None

    with pytest.raises(TypeError, match="transfer_rows must be a non-negative int"):
        Flavor(name="bad", load=load, transfer_rows=-1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="allows_missing must be a bool"):
        Flavor(name="bad", load=load, allows_missing="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cpu_call_rows must be a non-negative int"):
        Flavor(name="bad", load=load, cpu_call_rows=4096.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="load must be callable"):
        Flavor(name="bad", load=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a name"):
        Flavor(name="", load=load)  # type: ignore[arg-type]


def test_a_registered_module_without_a_flavor_object_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # tabular_inputs is a real module of the package that declares no FLAVOR
    monkeypatch.setitem(
        flavors._MODULES, "headless", "airflow_provider_batchinfer.runtime.model.flavors.tabular.tabular_inputs"
    )
    with pytest.raises(TypeError, match=r"tabular_inputs must declare FLAVOR = Flavor\(name='headless'"):
        flavors.flavor("headless")
    with pytest.raises(ValueError, match="model flavor 'nope' is not supported by this runtime"):
        flavors.flavor("nope")


def test_an_optimized_backend_is_refused_for_a_flavor_without_one() -> None:
    flavors.refuse_backend("onnx", "torchscript", "mlp/v1")  # it has one: no refusal
    with pytest.raises(
        BackendRefusedError,
        match=r"JobSpec.backend='onnx_int8' applies to sentence_transformers and torchscript models; "
        r"text_length/v1 is 'python'\. Leave JobSpec.backend unset for it",
    ):
        flavors.refuse_backend("onnx_int8", "python", "text_length/v1")


def test_resolving_every_flavor_imports_no_model_library() -> None:
    """A fresh interpreter: the registry, every flavor's capabilities and every optimized backend's
    declaration, and still no torch, transformers or onnxruntime (they load in ``load`` only)."""
    code = textwrap.dedent(
        """
        import sys
        from airflow_provider_batchinfer.runtime.model import flavors
        for name in flavors.names():
            flavors.flavor(name)
            flavors.optimized_backend(name)
        heavy = sorted(m for m in ("torch", "transformers", "sentence_transformers", "onnxruntime") if m in sys.modules)
        print("HEAVY", heavy)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr
