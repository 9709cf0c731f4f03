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

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


#: Tests in the slow tier besides those marked ``slow`` where they are defined, by node id prefix, with the reason.
#: Each runs in CI (scripts/test_rest.sh); the quick command leaves them out to finish in minutes on two cores.
SLOW = {
    # a child Python process per case (the command line, the demo and its progress bar, the bench scripts)
    "tests/test_cli.py::": "subprocesses",
    "tests/test_demo.py::": "whole demo runs",
    "tests/test_bench.py::": "benchmark runs",
    "tests/test_bench_histogram.py::": "benchmark runs",
    "tests/test_integrations_mlflow.py::test_the_documented_example_runs": "a child process with MLflow's store",
    # every page's examples run as one script in a child process; README's stay in the quick tier
    "tests/test_doc_examples.py::test_examples_run[docs/": "a child process per page",
    "tests/test_doc_examples.py::test_run_page_catches_failures": "a child process",
    # the CPU kernel's other instruction sets, each in a child process with the variant's environment
    "tests/test_cpu_kernel.py::test_variant_matches_reference": "a child process per variant",
    "tests/test_histogram.py::test_cpu_kernel_variant_exact": "a child process per variant",
    # memory and lifetime under hostile conditions: child processes, finalizers, large views
    "tests/test_fallback.py::test_one_call_raises_peak_rss": "child processes measuring peak RSS",
    "tests/test_fallback.py::test_views_with_repeated_elements_match_the_reference_on_their_materialized_tensor": (
        "large materialized views"
    ),
    "tests/test_fallback.py::test_a_call_from_a_gc_callback": "a child process",
    "tests/test_ops.py::test_fallback_off_the_cpu_takes_the_exact_sync_free_path": "a child process",
    "tests/test_ops.py::test_direct_entry_point_": "finalizer and GIL races, repeated",
    "tests/test_ops.py::test_freed_storage_is_a_clear_error_not_a_crash": "a child process per case",
    "tests/test_hostile_inputs.py::test_freed_and_shrunk_storage_in_a_child_process": "a child process per case",
    "tests/test_hostile_inputs.py::test_freed_storage_of_a_tensor_subclass": "a child process",
    "tests/test_stats.py::test_native_walk_survives_a_finalizer": "finalizer races, repeated",
    "tests/test_reentrancy.py::": "a child process per case",
    # torch.compile of whole steps
    "tests/test_control_flow.py::test_cond_compiled": "torch.compile",
    "tests/test_control_flow.py::test_while_loop_compiled": "torch.compile",
    "tests/test_control_flow.py::test_cond_nested_in_a_while_loop_body_compiled": "torch.compile",
    "tests/test_guard.py::test_observe_and_threshold_compile_in_one_graph": "torch.compile",
    "tests/test_guard.py::test_load_state_dict_keeps_a_compiled_step_valid": "torch.compile",
    "tests/test_guard.py::test_clipping_compiles_in_one_graph_and_matches_eager": "torch.compile",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kernel: the result depends on which kernel computes the op (tests/conftest.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).name in KERNEL_FILES:
            item.add_marker(pytest.mark.kernel)
        if any(item.nodeid.startswith(prefix) for prefix in SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test: small models run fastest so, where several threads would fight each other
    on a busy 2-core machine. Used with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
