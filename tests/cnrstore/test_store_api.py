"""CheckpointStore and DistributedStore satisfy one store API (cnrstore/core/api.py,
issue 24): every method of the protocol exists on both with the same parameters (names,
kinds, defaults), and each class's public names beyond it are the ones listed here, so
a method added to one handle or changed in one is caught."""

from __future__ import annotations

import inspect

import pytest

from cnrstore.core.api import StoreAPI
from cnrstore.core.store import CheckpointStore
from cnrstore.distributed.store import DistributedStore

# Keyword-only parameters one handle has beyond the protocol's, per method.
EXTRA_PARAMS = {
    CheckpointStore: {},
    DistributedStore: {},
}
# Public names one handle has beyond the protocol's.
EXTRA_NAMES = {
    CheckpointStore: {"objects"},
    DistributedStore: {"rank", "world_size", "is_coordinator", "check_open",
                       "from_coordinator", "coordinated", "coordinator_store", "drain",
                       "structure", "load_agreed",  # the TorchRec load's one round
                       "take_first"},  # what the open's round carried (a DCP path load)
}


def protocol_members() -> list[str]:
    return sorted(n for n in vars(StoreAPI) if not n.startswith("_"))


def drift(cls: type, extra_params: dict[str, set[str]], extra_names: set[str]) -> list[str]:
    """What of ``cls`` differs from the protocol, one line each (empty: none)."""
    out = []
    members = protocol_members()
    public = {n for n in dir(cls) if not n.startswith("_")}
    for name in sorted(public - set(members) - extra_names):
        out.append(f"{cls.__name__}.{name} is public but not in StoreAPI")
    for name in members:
        want = getattr(StoreAPI, name)
        have = getattr(cls, name, None)
        if have is None:
            out.append(f"{cls.__name__} lacks {name}")
            continue
        if isinstance(want, property) or isinstance(have, property):
            if not (isinstance(want, property) and isinstance(have, property)):
                out.append(f"{cls.__name__}.{name}: a property in one, not the other")
            continue
        extra = extra_params.get(name, set())
        got = [p for p in inspect.signature(have).parameters.values() if p.name not in extra]
        for p in inspect.signature(have).parameters.values():
            if p.name in extra and (p.kind is not p.KEYWORD_ONLY or p.default is p.empty):
                out.append(f"{cls.__name__}.{name}({p.name}): an extra must be an optional "
                           "keyword")
        exp = list(inspect.signature(want).parameters.values())
        shape = [(p.name, p.kind, p.default) for p in got]
        expected = [(p.name, p.kind, p.default) for p in exp]
        if shape != expected:
            out.append(f"{cls.__name__}.{name}{inspect.signature(have)} is not "
                       f"StoreAPI.{name}{inspect.signature(want)}")
    return out


@pytest.mark.parametrize("cls", [CheckpointStore, DistributedStore], ids=lambda c: c.__name__)
def test_the_handle_has_the_store_api(cls):
    assert drift(cls, EXTRA_PARAMS[cls], EXTRA_NAMES[cls]) == []


def test_the_check_sees_a_drifted_signature_on_a_probe():
    class Drifted(CheckpointStore):
        def steps(self, newest_first: bool = False) -> list[int]:  # a parameter added
            return []

        def gc(self, keep_last=None, keep=(), *, threshold=0.5, progress=None):  # a default
            return None

        def compact(self) -> None:  # a method the other handle lacks
            pass

    found = drift(Drifted, EXTRA_PARAMS[CheckpointStore], EXTRA_NAMES[CheckpointStore])
    assert len(found) == 3, found
    assert any("compact" in f for f in found)
    assert any(".steps(" in f for f in found) and any(".gc(" in f for f in found)


def test_both_are_checked_by_mypy_against_the_protocol():
    import cnrstore.core.store as single
    import cnrstore.distributed.store as dist

    for module in (single, dist):
        assert "def _is_store_api(" in inspect.getsource(module), module.__name__
