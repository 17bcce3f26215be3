import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=400,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "dev",
    max_examples=2000,
    stateful_step_count=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(autouse=True)
def _vllm_log_lines_reach_caplog(request: pytest.FixtureRequest) -> Iterator[None]:
    """The connector logs under ``vllm.lazy_offload``; once vLLM has configured its
    logging (any test that imported it), the ``vllm`` logger stops propagating and
    pytest's ``caplog`` (a handler on the root logger) would see none of those lines.
    A test that asks for ``caplog`` gets them propagated for its duration."""
    if "caplog" not in request.fixturenames:
        yield
        return
    tree = logging.getLogger("vllm")
    propagate = tree.propagate
    tree.propagate = True
    try:
        yield
    finally:
        tree.propagate = propagate
