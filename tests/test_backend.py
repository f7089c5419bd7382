import os
import subprocess
import sys

import pytest

from infra_lab import backend


@pytest.fixture(autouse=True)
def fresh_backend(monkeypatch):
    monkeypatch.delenv("INFRA_LAB_BACKEND", raising=False)
    monkeypatch.delenv("INFRA_LAB_DEVICE", raising=False)
    monkeypatch.setattr(backend, "_current", None)


def test_default_is_numba_on_a_cpu_only_machine(monkeypatch):
    monkeypatch.setattr(backend, "_torch_has_cuda", lambda: False)
    assert backend.current() == backend.Backend("numba", "cpu")


def test_default_is_torch_on_cuda_when_a_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(backend, "_torch_has_cuda", lambda: True)
    assert backend.current() == backend.Backend("torch", "cuda")


@pytest.mark.parametrize("name", ["numba", "torch", "numpy"])
def test_environment_forces_a_backend(monkeypatch, name):
    monkeypatch.setattr(backend, "_torch_has_cuda", lambda: False)
    monkeypatch.setenv("INFRA_LAB_BACKEND", name)
    assert backend.current() == backend.Backend(name, "cpu")


def test_environment_forces_torch_onto_the_cpu_beside_a_gpu(monkeypatch):
    monkeypatch.setattr(backend, "_torch_has_cuda", lambda: True)
    monkeypatch.setenv("INFRA_LAB_BACKEND", "torch")
    assert backend.current() == backend.Backend("torch", "cuda")
    monkeypatch.setattr(backend, "_current", None)
    monkeypatch.setenv("INFRA_LAB_DEVICE", "cpu")
    assert backend.current() == backend.Backend("torch", "cpu")


def test_environment_with_a_bad_name_names_the_choices(monkeypatch):
    monkeypatch.setenv("INFRA_LAB_BACKEND", "jax")
    with pytest.raises(ValueError, match=r"INFRA_LAB_BACKEND='jax'.*numba, torch, numpy"):
        backend.current()


def test_torch_missing_names_what_is_available(monkeypatch):
    real = backend._installed
    monkeypatch.setattr(backend, "_installed", lambda module: module != "torch" and real(module))
    with pytest.raises(backend.BackendUnavailable, match=r"'torch' is not installed.*numba \(cpu\), numpy \(cpu\)"):
        backend.use("torch")


def test_cuda_without_a_gpu_names_what_is_available(monkeypatch):
    monkeypatch.setattr(backend, "_torch_has_cuda", lambda: False)
    with pytest.raises(backend.BackendUnavailable, match=r"cannot use device 'cuda'.*available: numba \(cpu\), torch \(cpu\)"):
        backend.use("torch", "cuda")
    with pytest.raises(backend.BackendUnavailable):
        backend.use(device="cuda")


def test_numba_cannot_run_on_cuda(monkeypatch):
    monkeypatch.setattr(backend, "_torch_has_cuda", lambda: True)
    with pytest.raises(backend.BackendUnavailable, match="'numba' cannot use device 'cuda'"):
        backend.use("numba", "cuda")


def test_a_failed_use_keeps_the_current_backend():
    backend.use("numpy")
    with pytest.raises(ValueError, match="unknown backend 'cupy'"):
        backend.use("cupy")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        backend.use("torch", "tpu")
    assert backend.current().name == "numpy"


def test_using_restores_the_backend_after_the_block():
    backend.use("numba")
    with backend.using("numpy") as inside:
        assert inside.name == backend.current().name == "numpy"
    assert backend.current().name == "numba"


def test_pick_chooses_the_face_and_reports_a_missing_one():
    faces = {"numpy": "np-face", "numba": "nb-face"}
    assert backend.pick(faces, backend.Backend("numba", "cpu")) == "nb-face"
    with pytest.raises(backend.BackendUnavailable, match="no 'torch' face; it has numpy, numba"):
        backend.pick(faces, backend.Backend("torch", "cpu"))


def test_describe_says_backend_device_threads_and_versions(monkeypatch):
    monkeypatch.setattr(backend, "_torch_has_cuda", lambda: False)
    text = backend.describe()
    assert text.startswith(f"infra_lab backend: numba on cpu ({backend.cpu_model()}, ")
    for piece in ("threads", "python", "numpy", "numba", "torch"):
        assert piece in text
    assert "\n" not in text


def test_numba_may_use_512_bit_vectors_where_the_cpu_has_them():

    code = ("import numba, os\nimport infra_lab\nimport llvmlite.binding as llvm\n"
            "wide = bool(llvm.get_host_cpu_features().get('avx512f'))\n"
            "lifted = (numba.config.CPU_FEATURES or '').endswith('-prefer-256-bit')\n"
            "assert lifted == wide, (wide, numba.config.CPU_FEATURES)\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # numba imported first still takes the setting
    mine = subprocess.run([sys.executable, "-c", "import os, infra_lab; print(os.environ['NUMBA_CPU_FEATURES'])"],
                          env=env | {"NUMBA_CPU_FEATURES": "+sse2"}, capture_output=True, text=True, timeout=120)
    assert mine.stdout.strip() == "+sse2"  # a value the user set wins


def test_the_machine_names_the_cpu_model_and_threads(monkeypatch):
    monkeypatch.setattr(backend, "cpu_model", lambda: "AMD EPYC 7B13")
    monkeypatch.setattr(backend, "threads", lambda: 2)
    assert backend.machine() == "AMD EPYC 7B13, 2 threads"


def test_a_backend_passed_to_a_kernel_holds_for_that_call_only_and_in_that_thread_only():
    """Two engines in one process on two devices: a torch face picked for a passed backend moves
    numpy inputs to that backend's device, whatever the current backend is, and only in the
    thread and for the call that passed it (the device itself need not exist to be routed to)."""
    import threading

    faces = {"torch": lambda: backend.torch_device(), "numpy": lambda: "numpy face"}
    with backend.using("numpy"):
        assert backend.pick(faces, backend.Backend("torch", "cuda"))() == "cuda"
        assert backend.torch_device() == "cpu" and backend.pick(faces)() == "numpy face"
        seen = []
        gate = threading.Event()

        def slow_face():
            gate.wait(5)
            return backend.torch_device()

        other = threading.Thread(target=lambda: seen.append(backend.torch_device()))
        runner = threading.Thread(target=lambda: seen.append(backend.pick({"torch": slow_face},
                                                                        backend.Backend("torch", "cuda"))()))
        runner.start()
        other.start(), other.join(5)
        gate.set(), runner.join(5)
        assert seen == ["cpu", "cuda"]
