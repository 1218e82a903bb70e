"""The lab's kernel tests: Triton's interpreter without a GPU (``tests/test_persistent_probe.py``), tests marked
``gpu`` skipped with a reason there. Not in the CI's test paths: ``pytest backends/cuda/lab/tests``."""

from __future__ import annotations

from musecore_triton.testing import skip_gpu_tests, use_interpreter_without_gpu

use_interpreter_without_gpu(__file__)


def pytest_collection_modifyitems(config, items):
    skip_gpu_tests(items)
