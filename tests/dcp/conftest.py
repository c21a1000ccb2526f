"""Every DCP test starts and ends with no store kept open by cnrstore.dcp (a process-wide
cache of opened stores, keyed by path): a test sees only the stores it opens."""

import pytest

from cnrstore.dcp import close_stores


@pytest.fixture(autouse=True)
def _no_kept_stores():
    close_stores()
    yield
    close_stores()
