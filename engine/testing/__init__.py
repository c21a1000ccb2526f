"""Test suites a store or a storage backend runs on itself (as ``zarr.testing``): the
storage-backend contract on keys and bytes (backend.py), the ``ObjectStore`` contract
(contract.py) and the state machine against a plain model (machine.py). They import
pytest and hypothesis, so nothing else in the engine imports this package."""

from .backend import BackendContract
from .contract import ObjectStoreContract
from .machine import StoreMachine, make_payload, payload_ok

__all__ = ["BackendContract", "ObjectStoreContract", "StoreMachine", "make_payload", "payload_ok"]
