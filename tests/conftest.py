"""Test setup: every Triton kernel runs through Triton's CPU interpreter unless a GPU is used.

``TRITON_INTERPRET=1`` must be set before triton is imported, so it is set here, first.
"""

import os

if os.environ.get("TRITON_SCALER_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

BACKENDS = ["reference", "triton"]


def _skip_without_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1; see tests/test_gpu.py")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each test using it runs on the reference path and on the Triton kernels (CPU tensors:
    through the interpreter; skipped in a GPU run, where TRITON_INTERPRET is not set)."""
    if request.param == "triton":
        _skip_without_interpreter()
    return request.param


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.fixture
def triton_device():
    """Where this test run runs the Triton kernels: CPU tensors through the interpreter, or
    the GPU in a GPU run (``TRITON_SCALER_GPU_TESTS=1``, no interpreter); skipped otherwise."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("the Triton backend needs TRITON_INTERPRET=1 on CPU, or a CUDA device")


@pytest.fixture
def interpreter():
    """For a test of the Triton backend on CPU tensors (a CPU device mesh, say): skipped in a
    GPU run, where TRITON_INTERPRET is not set and the Triton backend refuses CPU tensors."""
    _skip_without_interpreter()


def pytest_addoption(parser):
    parser.addoption("--triton-launch", action="store_true",
                     help="every launch through Triton's kernel[grid], none through the "
                          "compiled launchers (triton_scaler.kernels.launcher.DIRECT = False; "
                          "the default is on)")


@pytest.fixture(autouse=True)
def _triton_launch(request):
    """``--triton-launch``: every test with the direct launcher off (kernels/launcher.py)."""
    if not request.config.getoption("--triton-launch"):
        yield
        return
    from triton_scaler.kernels import launcher

    before, launcher.DIRECT = launcher.DIRECT, False
    try:
        yield
    finally:
        launcher.DIRECT = before
        launcher.clear()
