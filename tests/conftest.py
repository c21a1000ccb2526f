"""What the running session collected, for tests/test_collection.py.

A plain ``pytest`` (no paths given: pytest takes ``testpaths``) collects exactly what CI's
run collects, so the collection check can compare the files on disk with this session's
own collection instead of collecting the whole suite again in a subprocess (36 s on two
cores, the suite's slowest check)."""

from __future__ import annotations

import pytest

COLLECTED = pytest.StashKey[set]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[COLLECTED] = set()


def pytest_itemcollected(item: pytest.Item) -> None:
    # Before -m/-k deselect: the record is what was collected, not what runs.
    item.config.stash[COLLECTED].add(item.nodeid.split("::", 1)[0])


@pytest.fixture
def session_collected(request: pytest.FixtureRequest) -> set[str] | None:
    """The test files this session collected, where it was a plain run over testpaths;
    None where it was given paths (it saw part of the suite, or a folder a plain run
    skips)."""
    config = request.config
    if config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return None
    return set(config.stash[COLLECTED])
