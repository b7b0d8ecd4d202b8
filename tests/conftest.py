import zlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random data per test, reproducible from the test's name when one fails: crc32, not
    # hash(), whose value for a string changes from process to process (PYTHONHASHSEED).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
