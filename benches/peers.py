"""The systems the benchmark compares, behind one small interface.

Each system keeps every step it is given under its own directory and can restore any of
them. A save is measured until it is durable (data fsync'ed, directory entry fsync'ed):
that is what a checkpoint is for, and what cnrstore's commit protocol pays for.

- ``torch_save``: torch.save + fsync both ways, a file kept per step and one file replaced
  per step; its put time is the faster of the two (the peer of every put time here).
- ``safetensors``: one safetensors file per step (skipped when not installed).
- ``dcp``: torch.distributed.checkpoint, one process without a process group, a
  FileSystemWriter directory per step (its writer fsyncs the files itself).
- ``cnr_<scheme>[_async|_touched]``: cnrstore, one store for all steps; ``_async`` puts
  with ``blocking=False`` and records the stall (time until put_tables returns) apart from
  the time until the step is durable; ``_touched`` passes the row ids the interval changed
  (``touched=``, what a trainer tracking its embedding lookups knows), so the store hashes
  only those rows instead of fingerprinting whole tables.
"""

from __future__ import annotations

import abc
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benches.measure import fsync_dir, timed

__all__ = ["BASELINES", "SYSTEMS", "System", "available_systems", "make_system"]

BASELINES = ("torch_save", "safetensors", "dcp")
CNR_SCHEMES = ("exact", "int8", "int4")
SYSTEMS = (
    BASELINES
    + tuple(f"cnr_{s}" for s in CNR_SCHEMES)
    + tuple(f"cnr_{s}_async" for s in CNR_SCHEMES)
    + ("cnr_exact_touched", "cnr_int8_touched")
)
Touched = dict[str, np.ndarray]


class System(abc.ABC):
    """A checkpointing system under test, rooted at one directory it owns."""

    name: str

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    @abc.abstractmethod
    def put(
        self, step: int, tables: dict[str, torch.Tensor], *, touched: Touched | None = None
    ) -> dict[str, Any]:
        """Save ``tables`` as ``step`` durably; returns at least put_s and stall_s.

        ``touched``: row ids changed since the previous put, per table (None: unknown);
        systems that cannot use it ignore it."""

    @abc.abstractmethod
    def restore(self, step: int) -> dict[str, torch.Tensor]:
        """Read ``step`` back as a fresh job would (no state kept from the puts)."""

    def close(self) -> None:  # noqa: B027 - most systems hold no handle between calls
        """Release handles so a restore starts cold."""

    def paths(self) -> list[Path]:
        """Every directory the system wrote (removed after a job)."""
        return [self.root]

    def restore_into(self, step: int, out: dict[str, torch.Tensor]) -> None:
        """Read ``step`` into the existing tensors ``out`` (a model's): the peers load
        fresh tensors and copy them over, which is what torch.load users do."""
        for name, t in self.restore(step).items():
            out[name].copy_(t)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TorchSave(System):
    """torch.save + fsync, measured both ways a job uses it, at every step (issue 27):

    - keep: a file per step, every step kept (what the store does; the restores and the
      bytes on disk are this way's);
    - replace: one checkpoint kept: the step's file is written, then the previous one
      removed (a sibling directory, so its bytes are not the keep way's). On these VMs it
      ran up to 2.5x faster than keeping every file.

    ``put_s`` (and ``stall_s``) is the faster of the two at that step: THE peer of every
    put time in benches/. Both are reported (``put_keep_s``, ``put_replace_s``); their order
    alternates by step, so neither always writes into a page cache the other filled.
    """

    name = "torch_save"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.replace_root = self.root.with_name(self.root.name + "-replace")
        shutil.rmtree(self.replace_root, ignore_errors=True)
        self.replace_root.mkdir(parents=True)
        self._previous: Path | None = None

    def _path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}.pt"

    @staticmethod
    def _save(tables, path: Path) -> None:
        with open(path, "wb") as f:
            torch.save(tables, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path.parent)

    def _replace(self, step, tables) -> None:
        path = self.replace_root / f"step_{step:08d}.pt"
        self._save(tables, path)
        if self._previous is not None and self._previous != path:
            self._previous.unlink(missing_ok=True)
        self._previous = path

    def put(self, step, tables, *, touched=None):
        ways = [("keep", lambda: self._save(tables, self._path(step))),
                ("replace", lambda: self._replace(step, tables))]
        took = {}
        for way, fn in (ways if step % 2 == 0 else ways[::-1]):
            took[way], _ = timed(fn)
        peer = min(took.values())
        return {"put_s": peer, "stall_s": peer, "put_keep_s": took["keep"],
                "put_replace_s": took["replace"],
                "peer_way": min(took, key=took.__getitem__)}

    def restore(self, step):
        return torch.load(self._path(step), map_location="cpu", weights_only=True)

    def paths(self) -> list[Path]:
        return [self.root, self.replace_root]


class SafeTensors(System):
    name = "safetensors"

    def _path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}.safetensors"

    def put(self, step, tables, *, touched=None):
        from safetensors.torch import save_file

        def save():
            save_file(tables, str(self._path(step)))
            _fsync_path(self._path(step))
            fsync_dir(self.root)

        seconds, _ = timed(save)
        return {"put_s": seconds, "stall_s": seconds}

    def restore(self, step):
        from safetensors.torch import load_file

        # load_file maps the file lazily: pages would be read at first use, after the timer
        # stops. Copy into process memory so a restore means what it means for the others.
        return {k: v.clone() for k, v in load_file(str(self._path(step)), device="cpu").items()}


class DistributedCheckpoint(System):
    name = "dcp"

    def _path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def put(self, step, tables, *, touched=None):
        import torch.distributed.checkpoint as dcp

        def save():
            writer = dcp.FileSystemWriter(str(self._path(step)), sync_files=True)
            dcp.save(dict(tables), storage_writer=writer, no_dist=True)
            fsync_dir(self.root)

        seconds, _ = timed(save)
        return {"put_s": seconds, "stall_s": seconds}

    def restore(self, step):
        import torch.distributed.checkpoint as dcp

        # A restarted job knows names and shapes only from the checkpoint's own metadata.
        reader = dcp.FileSystemReader(str(self._path(step)))
        meta = reader.read_metadata().state_dict_metadata
        state = {
            name: torch.empty(tuple(m.size), dtype=m.properties.dtype) for name, m in meta.items()
        }
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(self._path(step))), no_dist=True)
        return state


class CnrStore(System):
    """cnrstore through its public API only (docs/GUIDE.md, "The API contract")."""

    def __init__(self, root: Path, *, scheme: str, blocking: bool, use_touched: bool) -> None:
        super().__init__(root)
        self.scheme = scheme
        self.blocking = blocking
        self.use_touched = use_touched
        suffix = "_touched" if use_touched else ("" if blocking else "_async")
        self.name = f"cnr_{scheme}{suffix}"
        self._store = None

    def _open(self):
        import cnrstore

        if self._store is None:
            self._store = cnrstore.open(str(self.root / "store"))
        return self._store

    def put(self, step, tables, *, touched=None):
        store = self._open()

        extra = {}
        if self.use_touched and touched is not None:
            extra["touched"] = {k: torch.from_numpy(v) for k, v in touched.items()}

        def submit():
            return store.put_tables(
                step, tables, quant=self.scheme, blocking=self.blocking, **extra
            )

        stall, out = timed(submit)
        if self.blocking:
            info, put_s = out, stall
        else:
            wait_s, info = timed(out.result)
            put_s = stall + wait_s
        return {
            "put_s": put_s,
            "stall_s": stall,
            "claimed_bytes_written": int(info.bytes_written),
            "logical_bytes": int(info.logical_bytes),
            "rows_changed": int(sum(dict(info.rows_changed).values()))
            if isinstance(info.rows_changed, dict)
            else int(info.rows_changed),
            "objects_new": int(info.objects_new),
            "objects_reused": int(info.objects_reused),
        }

    def restore(self, step):
        # Open, read, close: the cost a restarted job pays (index open included).
        import cnrstore

        self.close()
        with cnrstore.open(str(self.root / "store")) as store:
            return store.get_tables(step)

    def restore_into(self, step, out):
        import cnrstore

        self.close()
        with cnrstore.open(str(self.root / "store")) as store:
            store.get_tables(step, out=out)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def available_systems() -> tuple[str, ...]:
    """SYSTEMS minus those whose optional dependency is missing here."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return tuple(s for s in SYSTEMS if s != "safetensors")
    return SYSTEMS


def make_system(name: str, root: Path) -> System:
    if name == "torch_save":
        return TorchSave(root)
    if name == "safetensors":
        return SafeTensors(root)
    if name == "dcp":
        return DistributedCheckpoint(root)
    if name in SYSTEMS and name.startswith("cnr_"):
        scheme = name[len("cnr_") :].removesuffix("_async").removesuffix("_touched")
        return CnrStore(root, scheme=scheme, blocking=not name.endswith("_async"),
                        use_touched=name.endswith("_touched"))
    raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")
