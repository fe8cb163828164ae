import sys
from pathlib import Path

import pytest
import torch

# The in-place build (tools/python-check) leaves flare/_C*.so under python/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_close_to_ref(out, ref, lowp, factor=3.0, atol=1e-4, what="out"):
    """FlashAttention's criterion: the error against the fp32 reference is within `factor` times the
    error of the same computation done in the inputs' dtype, plus a small absolute term."""
    err = (out.float() - ref.float()).abs().max().item()
    err_lowp = (lowp.float() - ref.float()).abs().max().item()
    assert err <= factor * err_lowp + atol, f"{what}: max error {err:.3e} vs low-precision reference {err_lowp:.3e}"
