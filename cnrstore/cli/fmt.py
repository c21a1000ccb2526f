"""Output of the ``cnrstore`` command: human sizes, aligned tables, JSON. The progress bar
is cnrstore.tools.progress.Progress (re-exported here).

Kept apart from app.py so the argument layer stays thin and these helpers can be tested
without a subprocess. Nothing here touches a store.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
from collections.abc import Iterable, Sequence

from cnrstore.tools.progress import Progress as Progress  # the CLI's bars

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
STATE_SHOWN = 12  # Python values of a put_state step shown by `show` (all with --json)


def size(n: int | float | None) -> str:
    """Bytes in binary units with three significant digits: 1536 -> '1.50 KiB'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def plural(n: int, word: str) -> str:
    """'1 object', '2 objects': every count the CLI prints goes through here."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def duration(seconds: float) -> str:
    """A grace period as people say it: '6 h', '90 min', '30 s'."""
    for unit, span in (("h", 3600), ("min", 60)):
        if seconds >= span and seconds % span == 0:
            return f"{int(seconds // span)} {unit}"
    return f"{seconds:g} s"


def ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x"


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], *,
          right: Sequence[int] = ()) -> str:
    """Columns aligned by width; the columns whose index is in ``right`` align right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def jsonable(value):
    """Dataclasses, tuples, bytes and enums as plain JSON values (bytes as hex)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [jsonable(v) for v in items]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and value != value:
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


# -- one renderer per command: each takes the object --json would print ------------------

def steps_text(steps) -> str:
    if not steps:
        return "no steps"
    rows: list[tuple[object, ...]] = [
        (s.step, when(s.time), "-" if s.tables is None else s.tables,
         size(s.logical_bytes), size(s.stored_bytes), size(s.new_bytes),
         "" if s.problem is None else f"DAMAGED: {s.problem}") for s in steps]
    headers: tuple[str, ...] = ("STEP", "TIME (UTC)", "TABLES", "LOGICAL", "STORED", "NEW")
    if any(s.problem for s in steps):
        headers += ("PROBLEM",)
    else:
        rows = [r[:-1] for r in rows]
    return table(headers, rows, right=(0, 2, 3, 4, 5))


def step_text(d) -> str:
    head = [f"step {d.step}  {when(d.time)} UTC  root {d.root}"]
    if d.metadata:
        head.append("metadata: " + ", ".join(f"{k}={v!r}" for k, v in d.metadata.items()))
    values = getattr(d, "state", None)
    if values:  # a put_state step: its Python values (the first few; --json has them all)
        shown = [f"{k}={v!r}" for k, v in list(values.items())[:STATE_SHOWN]]
        more = len(values) - STATE_SHOWN
        head.append("state: " + ", ".join(shown) + (f", ... (+{more})" if more > 0 else ""))
    rows = [(t.name, "x".join(map(str, t.shape)), t.dtype, t.scheme, t.blocks,
             f"{t.full_blocks}/{t.patched_blocks}", f"{t.max_depth}/{t.mean_depth:.1f}",
             "-" if t.rows_changed is None else t.rows_changed, size(t.logical_bytes),
             size(t.stored_bytes)) for t in d.tables]
    body = table(("TABLE", "SHAPE", "DTYPE", "SCHEME", "BLOCKS", "FULL/PATCHED",
                  "DEPTH MAX/MEAN", "ROWS WRITTEN", "LOGICAL", "STORED"), rows,
                 right=(4, 5, 6, 7, 8, 9))
    return "\n".join(head) + "\n" + body


def diff_text(d, *, max_rows: int) -> str:
    if d.identical:
        return f"steps {d.a} and {d.b} are identical (same root)"
    lines = [f"diff {d.a} -> {d.b}" + ("  (metadata changed)" if d.metadata_changed else "")]
    for t in d.tables:
        if t.status == "unchanged":
            extra = (f" (same rows; {plural(t.blocks_examined, 'block')} stored under other "
                     f"ids)" if t.blocks_examined else "")
            lines.append(f"  = {t.name}: unchanged{extra}")
            continue
        if t.status in ("added", "removed"):
            shape = t.shape_b if t.status == "added" else t.shape_a
            lines.append(f"  {'+' if t.status == 'added' else '-'} {t.name}: {t.status} "
                         f"({'x'.join(map(str, shape))})")
            continue
        what = [plural(len(t.blocks_changed), "block")]
        if t.encoding_changed:
            what.append(f"re-encoded ({t.scheme_a} {'x'.join(map(str, t.shape_a))} -> "
                        f"{t.scheme_b} {'x'.join(map(str, t.shape_b))})")
        if t.rows_changed is not None:
            what.append(plural(t.rows_changed, "row"))
        if t.rows_added:
            what.append(f"+{plural(t.rows_added, 'row')} added")
        if t.rows_removed:
            what.append(f"-{plural(t.rows_removed, 'row')} removed")
        lines.append(f"  ~ {t.name}: " + ", ".join(what))
        if t.row_ranges:
            lines.append(f"      rows: {ranges_text(t.row_ranges, limit=max_rows)}")
    return "\n".join(lines)


def ranges_text(ranges: Sequence[Sequence[int]], *, limit: int) -> str:
    """Half-open row ranges as '0-2, 7': at most ``limit`` rows spelled out."""
    parts, shown = [], 0
    total = sum(b - a for a, b in ranges)
    for a, b in ranges:
        if shown >= limit:
            parts.append(f"... ({plural(total, 'row')} in all)")
            break
        parts.append(str(a) if b == a + 1 else f"{a}-{b - 1}")
        shown += b - a
    return ", ".join(parts) if parts else "-"


def usage_text(u) -> str:
    lines = [
        f"{plural(u.steps, 'step')}, {plural(u.objects, 'object')}, "
        f"{u.garbage_objects} unreachable (gc reclaims them)",
        f"logical    {size(u.logical_bytes):>11}   tables as dense tensors, all kept steps",
        f"referenced {size(u.referenced_bytes):>11}   encoded bytes each step reaches "
        f"(encoding {ratio(u.encoding_ratio)})",
        f"unique     {size(u.unique_bytes):>11}   distinct objects (dedup {ratio(u.dedup_ratio)})",
        f"stored     {size(u.stored_bytes):>11}   their records in packs "
        f"(compression {ratio(u.compression_ratio)})",
        f"on disk    {size(u.disk_bytes):>11}   allocated by the pack files",
        f"overall    {ratio(u.overall_ratio):>11}   logical / stored",
        "",
    ]
    rows = [(t.name, t.steps, size(t.logical_bytes), size(t.referenced_bytes),
             size(t.unique_bytes), size(t.stored_bytes),
             ratio(t.referenced_bytes / t.unique_bytes if t.unique_bytes else None),
             ratio(t.logical_bytes / t.stored_bytes if t.stored_bytes else None))
            for t in u.tables]
    lines.append(table(("TABLE", "STEPS", "LOGICAL", "REFERENCED", "UNIQUE", "STORED",
                        "DEDUP", "OVERALL"), rows, right=(1, 2, 3, 4, 5, 6, 7)))
    return "\n".join(lines)


def verify_text(r, *, limit: int = 20) -> str:
    head = (f"{'ok' if r.ok else 'PROBLEMS FOUND'}: {plural(r.steps_checked, 'step')}, "
            f"{plural(r.objects_checked, 'object')} ({size(r.bytes_checked)}) checked, "
            f"{plural(r.blocks_decoded, 'block')} decoded")
    lines = [head]
    for p in r.problems[:limit]:
        oid = bytes(p.oid).hex() if p.oid else ""
        where = " ".join(x for x in (
            f"object {oid}" if oid and oid not in p.message else "",
            f"pack {p.pack}" if p.pack and p.pack not in p.message else "",
            f"offset {p.offset}" if p.offset is not None else "") if x)
        lines.append(f"  {p.what}: {p.message}" + (f" [{where}]" if where else ""))
    if len(r.problems) > limit:
        lines.append(f"  ... and {len(r.problems) - limit} more (--json lists them all)")
    return "\n".join(lines)


_ROOT_PROBLEMS = ("damaged-root", "root-rolled-back", "dangling-root")


def repair_plan_text(r, *, limit: int = 20) -> str:
    """What repair will do (or, ``r.dry_run``, would do): the damage its scan found in the
    packs, then each step or root that is not intact and what becomes of it."""
    head = "repair plan (dry run: nothing is changed)" if r.dry_run else "repair plan"
    lines = [f"{head}: {plural(r.packs_scanned, 'pack')} scanned, "
             f"{plural(r.objects_indexed, 'intact object')}"]
    found = [p for p in r.damaged if p.what not in _ROOT_PROBLEMS]
    for p in found[:limit]:
        where = f" [object {p.oid.hex()}]" if p.oid and p.oid.hex() not in p.message else ""
        lines.append(f"  damaged: {p.what}: {p.message}{where}")
    if len(found) > limit:
        lines.append(f"  ... and {len(found) - limit} more (--json lists them all)")
    verb = {"damaged": "would keep", "rolled-back": "would roll back",
            "dropped": "would drop"} if r.dry_run else {
        "damaged": "keeps", "rolled-back": "rolls back", "dropped": "drops"}
    for d in r.roots[:limit]:
        who = f"step {d.step}" if d.step is not None else f"root {d.root!r}"
        lost = plural(len(d.lost), "lost object")
        if d.action == "damaged":
            tables = ", ".join(repr(t) for t in d.tables)
            what = (f"tables {tables} raise CorruptData ({lost}), every other table reads"
                    if tables else f"{lost}; everything else it reaches reads")
            lines.append(f"  {who}: {verb['damaged']} it: {what}")
        else:
            lines.append(f"  {who}: {verb[d.action]}: {d.reason} ({lost})")
    if len(r.roots) > limit:
        lines.append(f"  ... and {len(r.roots) - limit} more (--json lists them all)")
    dropped = sum(d.action == "dropped" for d in r.roots)
    damaged = sum(d.action == "damaged" for d in r.roots)
    lines.append(f"  {'would keep' if r.dry_run else 'keeps'} "
                 f"{plural(r.roots_restored, 'root')} ({damaged} damaged), "
                 f"{'would drop' if r.dry_run else 'drops'} {dropped}")
    return "\n".join(lines)


def repair_text(r) -> str:
    damaged = sum(d.action == "damaged" for d in r.roots)
    dropped = sum(d.action == "dropped" for d in r.roots)
    skipped = sum(p.what == "corrupt" for p in r.damaged)
    return (f"index rebuilt: {plural(r.packs_scanned, 'pack')} scanned, "
            f"{plural(r.objects_indexed, 'object')} indexed, "
            f"{plural(r.roots_restored, 'root')} restored ({damaged} damaged, {dropped} "
            f"dropped); {plural(skipped, 'damaged record')} skipped")


def gc_plan_text(p) -> str:
    drop = ", ".join(map(str, p.drop)) or "none"
    keep = ", ".join(map(str, p.keep)) or "none"
    return (f"dry run: would drop steps {drop}; keep {keep}\n"
            f"would free {plural(p.objects_freed, 'object')} ({size(p.bytes_freed)} of "
            f"records) plus {plural(p.garbage_objects, 'object')} already unreachable")


def gc_text(r) -> str:
    dropped = ", ".join(map(str, r.steps_deleted)) or "none"
    kept = ", ".join(map(str, r.steps_kept)) or "none"
    text = (f"dropped steps {dropped}; kept {kept}\n"
            f"freed {plural(r.objects_freed, 'object')}, {size(r.bytes_freed)} on disk; "
            f"{plural(r.packs_rewritten, 'pack')} rewritten, {r.packs_deleted} deleted; "
            f"{plural(r.objects_live, 'object')} live")
    if getattr(r, "packs_held", 0):
        text += (f"\n{plural(r.packs_held, 'pack')} ({size(r.bytes_held)}) no longer "
                 f"needed stay for the gc grace period (gc_grace_s, {duration(r.grace_s)} "
                 "after this gc) so readers of the old index can finish: a gc run after "
                 "that frees them")
    return text


def transfer_text(r) -> str:
    verb = "exported" if r.direction == "export" else "imported"
    prep = "to" if r.direction == "export" else "from"
    return (f"{verb} step {r.step} ({plural(len(r.tables), 'table')}, {size(r.logical_bytes)}) "
            f"{prep} {r.path}")
