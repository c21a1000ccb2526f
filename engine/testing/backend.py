"""The contract every storage backend keeps (engine/storage/base.py: keys and bytes), as a
test class a backend runs on itself: subclass it in a test module (a name starting with
``Test``) and give it a ``backend`` fixture returning a fresh, empty backend::

    import pytest
    from engine.testing import BackendContract

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend(self, tmp_path):
            made = MyBackend(...)
            yield made
            made.close()

tests/engine/test_backends.py runs it over a directory, a shared directory, S3 (moto) and
memory. A backend that keeps it holds a store: engine/packs/storage.py builds packs on
exactly these operations. Needs pytest and hypothesis (the test extra).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..errors import FormatError
from ..storage.base import ObjectBackend

KEYS = st.sampled_from(["a/x", "a/y", "a/b/z", "ab/x", "b/x", "commits/00000000000000000001",
                        "packs/01/00000300.pack"])
OPS = st.lists(st.tuples(st.sampled_from(["put", "put_if_absent", "delete"]), KEYS,
                         st.binary(max_size=40)), max_size=25)


class BackendContract:
    """Get, ranged get, head, put, put-if-absent, list by prefix, delete and a streamed
    write, with the refusals the packs above rely on."""

    def test_put_get_head_round_trip(self, backend: ObjectBackend) -> None:
        backend.put("d/one", b"hello world")
        assert backend.get("d/one") == b"hello world"
        assert backend.head("d/one").size == 11
        assert backend.head("d/one").key == "d/one"
        backend.put("d/one", b"new")  # a put replaces
        assert backend.get("d/one") == b"new"
        backend.put("d/empty", b"")
        assert backend.get("d/empty") == b""

    def test_a_missing_key_is_file_not_found(self, backend: ObjectBackend) -> None:
        for call in (lambda: backend.get("no/such"), lambda: backend.head("no/such"),
                     lambda: backend.get_range("no/such", 0, 4)):
            with pytest.raises(FileNotFoundError):
                call()
        assert backend.list("no/") == []

    def test_ranged_get_is_short_only_at_the_end(self, backend: ObjectBackend) -> None:
        data = bytes(range(256)) * 40
        backend.put("r/blob", data)
        assert backend.get_range("r/blob", 0, 10) == data[:10]
        assert backend.get_range("r/blob", 5000, 300) == data[5000:5300]
        assert backend.get_range("r/blob", len(data) - 3, 10) == data[-3:]
        assert backend.get_range("r/blob", 7, 0) == b""

    def test_get_with_a_limit_reads_at_most_one_byte_more(self, backend: ObjectBackend
                                                          ) -> None:
        backend.put("l/big", b"x" * 1000)
        got = backend.get("l/big", limit=10)
        assert got == b"x" * len(got) and len(got) >= 11  # the caller sees it is too long
        assert backend.get("l/big", limit=5000) == b"x" * 1000

    def test_put_if_absent_refuses_a_taken_key_and_keeps_its_bytes(
            self, backend: ObjectBackend) -> None:
        backend.put_if_absent("c/1", b"first")
        with pytest.raises(FileExistsError):
            backend.put_if_absent("c/1", b"second")
        assert backend.get("c/1") == b"first"
        assert [o.key for o in backend.list("c/")] == ["c/1"]  # no temp object shows

    def test_list_by_prefix_in_key_order_with_sizes(self, backend: ObjectBackend) -> None:
        for key, n in [("p/b", 2), ("p/a", 1), ("p/sub/c", 3), ("q/a", 4), ("pp", 5)]:
            backend.put(key, b"z" * n)
        assert [(o.key, o.size) for o in backend.list("p/")] == [
            ("p/a", 1), ("p/b", 2), ("p/sub/c", 3)]
        assert [o.key for o in backend.list("p/", after="p/a")] == ["p/b", "p/sub/c"]
        assert all(o.stored >= 0 and o.modified > 0 for o in backend.list("p/"))

    def test_delete_then_the_key_is_gone(self, backend: ObjectBackend) -> None:
        backend.put("x/1", b"1")
        assert backend.delete("x/1") is True
        with pytest.raises(FileNotFoundError):
            backend.get("x/1")
        backend.delete("x/1")  # again: nothing to do, no error
        backend.put_if_absent("x/1", b"again")  # a deleted key may be created anew
        assert backend.get("x/1") == b"again"

    def test_a_streamed_write_holds_its_bytes_once_settled(self, backend: ObjectBackend
                                                           ) -> None:
        w = backend.open_writer("packs/00/00000001.pack")
        w.write(b"head")
        assert w.writev([b"one", memoryview(b"two"), b""]) == 6
        w.write(bytearray(b"tail"))
        w.finish()
        w.settle()
        w.close()
        assert w.closed
        assert backend.get("packs/00/00000001.pack") == b"headonetwotail"
        assert backend.get_range("packs/00/00000001.pack", 4, 6) == b"onetwo"
        backend.sync(["packs/00/00000001.pack"])
        assert [o.key for o in backend.list("packs/")] == ["packs/00/00000001.pack"]

    def test_a_discarded_write_leaves_nothing(self, backend: ObjectBackend) -> None:
        for finish in (False, True):
            key = f"packs/00/0000000{int(finish) + 2}.pack"
            w = backend.open_writer(key)
            w.write(b"partial")
            if finish:
                w.finish()
            w.discard()
            with pytest.raises(FileNotFoundError):
                backend.get(key)
        assert backend.list("packs/") == []

    def test_keys_that_leave_the_root_are_refused(self, backend: ObjectBackend) -> None:
        for key in ("/abs", "a/../../b", ".."):
            with pytest.raises(FormatError):
                backend.put(key, b"x")

    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops=OPS)
    def test_behaves_as_a_dict(self, backend: ObjectBackend,
                               ops: list[tuple[str, str, bytes]]) -> None:
        for o in backend.list(""):  # examples share the backend: start empty
            backend.delete(o.key)
        model: dict[str, bytes] = {}
        for op, key, data in ops:
            if op == "put":
                backend.put(key, data)
                model[key] = data
            elif op == "put_if_absent":
                if key in model:
                    with pytest.raises(FileExistsError):
                        backend.put_if_absent(key, data)
                else:
                    backend.put_if_absent(key, data)
                    model[key] = data
            else:
                backend.delete(key)
                model.pop(key, None)
        assert {o.key: o.size for o in backend.list("")} == {
            k: len(v) for k, v in model.items()}
        for prefix in ("a/", "a", "b/", "packs/"):
            assert [o.key for o in backend.list(prefix)] == sorted(
                k for k in model if k.startswith(prefix))
        for key, data in model.items():
            assert backend.get(key) == data
