"""Fixtures of the multi-process tests: a pool of 4 gloo ranks per test module (see `process_pool`).

Module scope, not session scope: the idle workers hold a few hundred MB each, which the rest of the suite (vLLM
engines) should get back.
"""

import pytest
from process_pool import ProcessGroupPool


POOL_WORLD_SIZE = 4


@pytest.fixture(scope="module")
def cp_pool():
    pool = ProcessGroupPool(POOL_WORLD_SIZE)
    yield pool
    pool.close()
