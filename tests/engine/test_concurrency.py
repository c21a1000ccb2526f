"""Several processes on one store: readers during writes and gc get right data or wait,
never wrong data and never a crash; the index map grows past a tiny initial size while a
reader has it open; a second writer is refused or waits; a handle used across fork()
refuses with a clear error.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from _helpers import (
    check_dag,
    dag,
    make_payload,
    open_store,
    put_dag,
    spawn,
)

from engine.errors import StoreClosed, StoreLocked


def _finish(proc, timeout: float = 60) -> tuple[list[str], str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}): {out[-2000:]} {err[-3000:]}"
    return out.splitlines(), err


def _reads(lines: list[str]) -> tuple[int, int]:
    [last] = [ln for ln in lines if ln.startswith("reads ")]
    _, reads, _, vanished = last.split()
    return int(reads), int(vanished)


def test_reader_during_writes_and_gc(tmp_path):
    path = tmp_path / "store"
    with open_store(path) as store:
        # r0 shares its packs with a dropped DAG, so the first gc moves r0's objects to a
        # new pack and deletes the old one while the reader is reading them.
        with store.writer() as w:
            put_dag(w, 0, size=16 * 1024)
            put_dag(w, 500, size=16 * 1024)
        with store.writer() as w:
            w.delete_root("r500")
    reader = spawn("read", path, 4, 0)
    writer = spawn("churn", path, 1, 16 * 1024, 4)
    wlines, _ = _finish(writer)
    rlines, _ = _finish(reader)
    reads, _ = _reads(rlines)
    gcs = [ln for ln in wlines if ln.startswith("gc ")]
    assert reads > 50 and len(gcs) >= 2, (reads, wlines[-3:])
    print(f"reader: {reads} objects read during {len(gcs)} gcs")
    assert int(gcs[0].split()[3]) > 0, "the first gc rewrote no pack: r0's objects never moved"
    with open_store(path) as store:
        check_dag(store, 0, size=16 * 1024)
        assert store.verify(deep=True).ok


def test_reader_threads_during_writes_and_gc_in_one_process(tmp_path):
    """Reads are thread-safe on one handle: threads read while another thread commits,
    drops roots and runs gc that moves the objects they read."""
    path = tmp_path / "store"
    errors: list[BaseException] = []
    reads = [0]
    stop = threading.Event()
    with open_store(path) as store:
        with store.writer() as w:
            put_dag(w, 0, size=8 * 1024)
            put_dag(w, 500, size=8 * 1024)  # shares r0's packs: gc will move r0
        with store.writer() as w:
            w.delete_root("r500")
        _, want = dag(0, size=8 * 1024)

        def read_loop() -> None:
            try:
                while not stop.is_set():
                    for oid, obj in want.items():
                        assert store.get(oid) == obj
                        reads[0] += 1
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=read_loop) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(1, 13):
                with store.writer() as w:
                    put_dag(w, i, size=8 * 1024)
                    if i >= 3:
                        w.delete_root(f"r{i - 2}")
                if i % 3 == 0:
                    store.gc(threshold=0.0)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert not errors, errors[0]
        assert reads[0] > 0
        check_dag(store, 0, size=8 * 1024)
        assert store.verify(deep=True).ok


def test_verify_during_writes_and_gc_reports_no_false_damage(tmp_path):
    path = tmp_path / "store"
    with open_store(path) as store:
        with store.writer() as w:
            put_dag(w, 0, size=8 * 1024)
    checker = spawn("verify_loop", path, 4)
    writer = spawn("churn", path, 1, 8 * 1024, 4)
    _finish(writer)
    lines, _ = _finish(checker)
    assert lines[-1].startswith("verified ") and int(lines[-1].split()[1]) > 3, lines


def test_index_grows_past_tiny_map_with_reader_open(tmp_path):
    path = tmp_path / "store"
    tiny = {"map_size": 1 << 16}
    with open_store(path, **tiny) as store:
        with store.writer() as w:
            put_dag(w, 0)
        reader = spawn("read", path, 3, 0, env={"CNR_OPEN_KW": json.dumps(tiny)})
        # Grow only once the reader has the environment open at its tiny size.
        assert reader.stdout.readline().strip() == "open"
        grown = []
        for c in range(8):
            with store.writer() as w:
                leaves = [w.put(1, make_payload(10_000 * (c + 1) + k, 16)) for k in range(250)]
                top = w.put(2, make_payload(77 + c, 32), leaves, meta=True)
                w.set_root(f"many{c}", top)
            grown.append(top)
        rlines, _ = _finish(reader)
        reads, _ = _reads(rlines)
        assert reads > 0
        for c, top in enumerate(grown):
            assert store.root(f"many{c}") == top
            node = store.get(top)
            assert [store.get(ref).payload for ref in node.refs] == [
                make_payload(10_000 * (c + 1) + k, 16) for k in range(250)
            ]
    # 2000 index entries cannot fit 64 KiB: the map did grow, and a tiny reopen adopts it.
    assert (path / "index" / "data.mdb").stat().st_size > 1 << 16
    with open_store(path, **tiny) as store:
        assert len(store.roots()) == 9
        assert store.verify(deep=True).ok


@pytest.mark.parametrize("maintenance", ["gc", "repair"])
def test_open_reader_sees_commits_after_maintenance(tmp_path, maintenance):
    """A reader process opened before another process's gc or repair keeps seeing new
    commits and reading right data afterwards (no stale view of a replaced index: an
    earlier repair swapped in a new index directory that such readers never saw)."""
    path = tmp_path / "store"
    with open_store(path) as store:
        with store.writer() as w:
            put_dag(w, 0)
            put_dag(w, 1)
        watcher = spawn("watch", path, 5)
        assert watcher.stdout.readline().strip() == "open"
        with store.writer() as w:
            w.delete_root("r1")
        getattr(store, maintenance)()
        with store.writer() as w:
            put_dag(w, 5)
        store.gc(threshold=0.0)  # drops packs a stale index would still point into
        watcher.stdin.write("go\n")
        watcher.stdin.flush()
        lines, _ = _finish(watcher)
        assert lines[-1] == "saw 5"


def test_second_writer_is_refused_or_waits(tmp_path):
    path = tmp_path / "store"
    with open_store(path) as store:
        w = store.writer()
        try:
            lines, _ = _finish(spawn("try_writer", path, 0))
            assert lines[1].startswith("locked ")
            lines, _ = _finish(spawn("try_writer", path, 0.5))
            assert lines[1].startswith("locked ")
            assert 0.45 <= float(lines[1].split()[1]) < 5
            waiter = spawn("try_writer", path, 20)
            assert waiter.stdout.readline().strip() == "trying"
            time.sleep(0.6)
            put_dag(w, 1)
            w.commit()
        except BaseException:
            w.abort()
            raise
        lines, _ = _finish(waiter)
        assert lines[0].startswith("acquired ")
        assert float(lines[0].split()[1]) >= 0.5  # it really waited for the commit
        check_dag(store, 1)
        check_dag(store, 900)  # what the waiter then committed


def test_writer_in_another_process_blocks_writer_and_gc_here(tmp_path):
    path = tmp_path / "store"
    with open_store(path) as store:
        holder = spawn("hold_writer", path, 2.5)
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(StoreLocked):
            store.writer(timeout=0)
        with pytest.raises(StoreLocked):
            store.gc(timeout=0.2)
        t0 = time.monotonic()
        with store.writer(timeout=30) as w:  # waits for the holder to commit
            assert time.monotonic() - t0 > 0.3
            put_dag(w, 2)
        _finish(holder)
        check_dag(store, 901)
        check_dag(store, 2)


def test_killed_writer_releases_the_lock(tmp_path):
    path = tmp_path / "store"
    holder = spawn("hold_writer", path, 60)
    assert holder.stdout.readline().strip() == "holding"
    holder.kill()
    holder.wait(timeout=30)
    with open_store(path) as store:
        with store.writer(timeout=5) as w:
            put_dag(w, 3)
        check_dag(store, 3)
        assert store.verify(deep=True).ok


def _in_forked_child(body) -> int:
    """Run ``body()`` in a forked child; return its exit code (0: body returned)."""
    pid = os.fork()
    if pid == 0:  # never return into pytest from here
        code = 0
        try:
            code = body() or 0
        except BaseException:
            code = 99
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_store_used_across_fork_is_a_clear_error(tmp_path):
    path = tmp_path / "store"
    with open_store(path) as store:
        with store.writer() as w:
            top = put_dag(w, 0)

        def child() -> int:
            code = 0
            for call in (lambda: store.get(top), store.roots, store.writer, store.stats):
                try:
                    call()
                    code |= 1
                except StoreClosed as exc:
                    if "fork" not in str(exc):
                        code |= 2
            store.close()  # must leave the parent's LMDB handle alone
            return code

        assert _in_forked_child(child) == 0
        # The parent's handle still works after the child closed its copy.
        check_dag(store, 0)
        with store.writer() as w:
            put_dag(w, 1)
        check_dag(store, 1)


def test_store_opened_after_fork_works(tmp_path):
    path = tmp_path / "store"
    with open_store(path) as store:
        with store.writer() as w:
            put_dag(w, 0)

    def child() -> int:
        with open_store(path) as fresh:
            check_dag(fresh, 0)
            with fresh.writer() as w:
                put_dag(w, 1)
        return 0

    assert _in_forked_child(child) == 0
    with open_store(path) as store:
        check_dag(store, 1)


def test_forked_child_can_reopen_a_store_the_parent_holds(tmp_path):
    # py-lmdb's "already open in this process" guard is inherited across fork(); the
    # StoreClosed message tells the child to engine.open() again, so that must work.
    path = tmp_path / "store"
    with open_store(path) as store:
        with store.writer() as w:
            put_dag(w, 0)

        def child() -> int:
            with open_store(path) as fresh:
                check_dag(fresh, 0)
                with fresh.writer() as w:
                    put_dag(w, 1)
            return 0

        assert _in_forked_child(child) == 0
        # The child's open, write and close left the parent's handle working.
        check_dag(store, 0)
        check_dag(store, 1)
        with store.writer() as w:
            put_dag(w, 2)
        assert store.verify(deep=True).ok
