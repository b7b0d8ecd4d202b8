import zlib

import compile_runs
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # the kernel builds of the selected compile tests start now, beside the other tests (not
    # where nothing runs: --collect-only, --fixtures, --fixtures-per-test, --setup-plan)
    option = session.config.option
    if not (option.collectonly or getattr(option, "showfixtures", False)
            or getattr(option, "show_fixtures_per_test", False)
            or getattr(option, "setupplan", False)):
        compile_runs.start(session.items)


def pytest_sessionfinish(session):
    compile_runs.stop()


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random data per test, reproducible from the test's name when one fails: crc32, not
    # hash(), whose value for a string changes from process to process (PYTHONHASHSEED).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=["sm90", "sm80"])
def dense_backend(request, monkeypatch):
    """The dense decode kernel under test: the SM90 kernels as the dispatch picks them (on an
    SM90 GPU: keys-on-M where s_q * h_q <= 32, heads-on-M elsewhere), then the portable
    SM80-class kernel (TORCH_MLA_PORTABLE=1, compute capability 8.0 or newer); a test using it
    runs once per kernel this GPU has."""
    monkeypatch.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("TORCH_MLA_KEYSM", raising=False)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    if request.param == "sm90":
        if capability != (9, 0):
            pytest.skip("needs an SM90 GPU")
        monkeypatch.delenv("TORCH_MLA_PORTABLE", raising=False)
    else:
        if capability < (8, 0):
            pytest.skip("needs a GPU of compute capability 8.0 or newer")
        monkeypatch.setenv("TORCH_MLA_PORTABLE", "1")
    return request.param
