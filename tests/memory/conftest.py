import pytest


@pytest.fixture(autouse=True)
def _memory_tests_use_fp32_gemms(fp32_gemms):
    """Every memory test computes bf16 matrix products in fp32 (``tests/fp32_gemms.py``: the same bytes
    counted, a fraction of the time on CPUs without native bf16)."""
