"""The ready-made pytest test a backend package reuses in one line.

Example (``backends/<name>/tests/test_conformance.py``)::

    from musecore.testing import make_conformance_tests
    from musecore_cuda import CudaBackend

    test_cuda_matches_reference = make_conformance_tests(lambda: CudaBackend("cuda"))

pytest collects the returned function under the name it is bound to (any ``test_*`` name) and
runs it once per case, with the case id as the parameter id (``linear-816b-q_proj-nvfp4``), so
``-k "linear and not 816b"`` selects as usual.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from musecore.testing.cases import conformance_cases
from musecore.testing.check import SKIPPED, check_op


def make_conformance_tests(backend_factory: Callable[[], Any], *, dtype: Optional[torch.dtype] = None,
                           sizes: Optional[Iterable[str]] = None, ops: Optional[Sequence[str]] = None,
                           formats: Optional[Sequence[str]] = None, device_name: str = "") -> Callable[..., None]:
    """A pytest test function parametrised over the conformance cases, run on ``backend_factory()``.

    - ``backend_factory``: called once, on the first case that runs (so collection never touches
      hardware); a backend class works too.
    - ``dtype``: the activation dtype the backend wants (e.g. ``torch.float16`` for the Triton
      interpreter, which has no bf16); default bf16. It is in the ``OpSpec`` its ``supports`` sees.
    - ``sizes``: preset sizes ``tiny``, ``small``, ``816b``; default ``$MUSECORE_CONFORMANCE_SIZES``
      or all. ``ops`` / ``formats`` narrow the cases (see :func:`conformance_cases`).
    - ``device_name``: the catalog device put in ``OpSpec.device`` (e.g. ``"h200"``).

    A case the backend does not support is skipped with its reason; a failure prints the measured
    NMSE against the tolerance.
    """
    import pytest

    cases = conformance_cases(sizes, ops, formats)
    made: list[Any] = []

    def backend() -> Any:
        if not made:
            made.append(backend_factory())
        return made[0]

    @pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in cases])
    def test_op_matches_reference(case: Any) -> None:
        result = check_op(backend(), case, dtype=dtype, device_name=device_name)
        if result.status == SKIPPED:
            pytest.skip(result.message())
        assert result.passed, result.message()

    test_op_matches_reference.cases = cases  # type: ignore[attr-defined]
    return test_op_matches_reference
