"""The test tiers (README, docs/install.md).

- ``scripts/test.sh``, the quick command: every test but those marked ``slow`` or ``distributed``, with the compiled
  extension; then, on the pure-PyTorch fallback (``TORCH_GRADSTATS_FORCE_FALLBACK=1``), the quick tests marked
  ``kernel``.
- ``scripts/test_rest.sh``, the rest of the matrix (CI runs both): the ``slow`` and ``distributed`` tests with the
  extension, and every test not run on the fallback above, on the fallback.

``kernel`` marks the tests whose result depends on which kernel computes the op: the op itself, its views, errors,
histogram and fallback, and the statistics straight above it. Layers above (policies, monitors, the Trainer, the
integrations) call the op through the same contract whichever kernel serves it, so their quick run takes the
compiled one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

KERNEL_FILES = {
    "test_accuracy_script.py",
    "test_control_flow.py",
    "test_cpu_kernel.py",
    "test_errors.py",
    "test_exponent_report.py",
    "test_fallback.py",
    "test_histogram.py",
    "test_histogram_hostile.py",
    "test_hostile_inputs.py",
    "test_ops.py",
    "test_reentrancy.py",
    "test_stats.py",
    "test_transfer.py",
    "test_views.py",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kernel: the result depends on which kernel computes the op (tests/conftest.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).name in KERNEL_FILES:
            item.add_marker(pytest.mark.kernel)
