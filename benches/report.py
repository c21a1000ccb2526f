"""Turn raw benchmark jobs into medians, ratios against torch.save, Markdown and plots.

Ratios are taken against ``torch_save`` (the baseline every PyTorch user has): write
reduction and capacity reduction as torch.save bytes / system bytes (higher is better),
time ratios as system seconds / torch.save seconds (lower is better).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

__all__ = ["TARGETS", "check_targets", "markdown", "median_merge", "plot", "summarize"]

# The targets set for the store (issues 3 and 14), checked on the 5% Zipf workload.
TARGET_WORKLOAD = "zipf-5pct"
TARGETS = {
    "write_reduction_int8": 20.0,   # >= : torch.save bytes / cnr_int8 incremental bytes
    "write_reduction_exact": 8.0,   # >= : same for cnr_exact
    "incr_put_ratio": 0.25,         # <= : cnr incremental put s / torch.save+fsync s
    "stall_ratio": 0.1,             # <= : stall of a blocking=False put / torch.save+fsync
    "restore_ratio": 1.0,           # <= : cnr restore of the latest step / torch.load, cold
    "warm_restore_ratio": 1.0,      # <= : the same, page cache warm
    "inplace_ratio": 0.6,           # <= : get_tables(out=) / (torch.load + copy_), warm
    "full_put_ratio_exact": 1.2,    # <= : first (full) put / torch.save+fsync
    "full_put_ratio_int8": 1.0,
    "vs_int8": 2.0,                 # <= : int4/int3/int2 incremental put / int8's
}


def median_merge(runs: list[Any]) -> Any:
    """Merge repeated runs of the same shape: medians of numbers, all() of flags."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_merge([r[k] for r in runs if k in r]) for k in first}
    if isinstance(first, list):
        return [median_merge([r[i] for r in runs]) for i in range(min(len(r) for r in runs))]
    if isinstance(first, bool):
        return all(runs)
    if isinstance(first, (int, float)):
        if any(r is None for r in runs):
            return None
        return statistics.median(runs)
    return first


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _row(result: dict[str, Any]) -> dict[str, Any]:
    steps = result["steps"]
    incr = steps[1:]
    err = result.get("latest_error", {})
    return {
        "logical_bytes": result["logical_bytes"],
        "full_bytes": steps[0]["bytes_written"],
        "incr_bytes": _mean([s["bytes_written"] for s in incr]),
        "cum_bytes": steps[-1]["cum_bytes"],
        "full_put_s": steps[0]["put_s"],
        "incr_put_s": _mean([s["put_s"] for s in incr]),
        "incr_stall_s": _mean([s["stall_s"] for s in incr]),
        # torch.save both ways (benches/peers.py TorchSave); put_s is the faster of them
        "full_put_keep_s": steps[0].get("put_keep_s"),
        "full_put_replace_s": steps[0].get("put_replace_s"),
        "incr_put_keep_s": _mean([s["put_keep_s"] for s in incr if "put_keep_s" in s]),
        "incr_put_replace_s": _mean([s["put_replace_s"] for s in incr
                                     if "put_replace_s" in s]),
        "restore_latest_s": result["restore_latest_s"],
        "restore_oldest_s": result["restore_oldest_s"],
        "restore_warm_s": result.get("restore_warm_s"),
        "restore_warm_first_s": result.get("restore_warm_first_s"),
        "restore_inplace_s": result.get("restore_inplace_s"),
        "inplace_peak_over_start": result.get("inplace_peak_over_start"),
        "inplace_bit_exact": result.get("inplace_bit_exact"),
        "put_peak_over_start": result["put_peak_over_start"],
        "restore_peak_over_start": result["restore_peak_over_start"],
        "bit_exact_latest": err.get("bit_exact"),
        "oldest_bit_exact": result.get("oldest_bit_exact"),
        "rel_rmse": err.get("rel_rmse"),
        "max_abs_err": err.get("max_abs_err"),
        "per_step": [{k: st.get(k) for k in ("step", "bytes_written", "cum_bytes", "put_s",
                                            "stall_s")} for st in steps],
    }


def summarize(merged: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """workload -> system -> summary row, with ratios against torch_save.

    When the baselines ran on one workload only (their cost does not depend on which rows
    changed), that one measurement is the reference for every workload.
    """
    workloads: list[str] = []
    for job in merged.values():
        workloads += [w for w in job["workloads"] if w not in workloads]
    ref_job = merged.get("torch_save", {}).get("workloads", {})
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for w in workloads:
        ref = ref_job.get(w) or (next(iter(ref_job.values())) if ref_job else None)
        ref_row = _row(ref) if ref else None
        out[w] = {}
        for system, job in merged.items():
            res = job["workloads"].get(w)
            if res is None:
                continue
            row = _row(res)
            if ref_row:
                row["write_reduction"] = _ratio(ref_row["incr_bytes"], row["incr_bytes"])
                row["capacity_reduction"] = _ratio(ref_row["cum_bytes"], row["cum_bytes"])
                row["incr_put_ratio"] = _ratio(row["incr_put_s"], ref_row["incr_put_s"])
                row["stall_ratio"] = _ratio(row["incr_stall_s"], ref_row["incr_put_s"])
                row["restore_ratio"] = _ratio(row["restore_latest_s"], ref_row["restore_latest_s"])
                row["full_put_ratio"] = _ratio(row["full_put_s"], ref_row["full_put_s"])
                row["warm_restore_ratio"] = _ratio(row["restore_warm_s"],
                                                   ref_row["restore_warm_s"])
                row["warm_first_ratio"] = _ratio(row["restore_warm_first_s"],
                                                 ref_row["restore_warm_first_s"])
                row["inplace_ratio"] = _ratio(row["restore_inplace_s"],
                                              ref_row["restore_inplace_s"])
            out[w][system] = row
        # Sub-byte schemes against int8 (same workload, same run): the range search's cost.
        for system, row in out[w].items():
            if not system.startswith(("cnr_int4", "cnr_int3", "cnr_int2")):
                continue
            int8 = out[w].get("cnr_int8" + system[len("cnr_int4"):])
            if int8:
                row["vs_int8"] = _ratio(row["incr_put_s"], int8["incr_put_s"])
    return out


def check_targets(summary: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One line per target and cnrstore system: measured value and whether it is met."""
    rows = summary.get(TARGET_WORKLOAD, {})
    checks = []

    def add(system: str, key: str, limit: float, at_least: bool) -> None:
        value = rows.get(system, {}).get(key)
        met = None if value is None else (value >= limit if at_least else value <= limit)
        op = ">=" if at_least else "<="
        checks.append(
            {"system": system, "target": f"{key} {op} {limit:g}", "value": value, "met": met}
        )

    for scheme in ("int8", "exact"):
        limit = TARGETS[f"write_reduction_{scheme}"]
        add(f"cnr_{scheme}", "write_reduction", limit, True)
    for system in sorted(s for s in rows if s.startswith("cnr_")):
        key = "stall_ratio" if system.endswith("_async") else "incr_put_ratio"
        add(system, key, TARGETS[key], False)
        for key in ("restore_ratio", "warm_restore_ratio", "inplace_ratio"):
            if rows[system].get(key) is not None or key == "restore_ratio":
                add(system, key, TARGETS[key], False)
        scheme = (system.split("_") + [""])[1]
        if f"full_put_ratio_{scheme}" in TARGETS and not system.endswith("_async"):
            add(system, "full_put_ratio", TARGETS[f"full_put_ratio_{scheme}"], False)
        if rows[system].get("vs_int8") is not None:
            add(system, "vs_int8", TARGETS["vs_int8"], False)
    return checks


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return f"{value / 1e6:.1f}"
    if kind == "s":
        return f"{value:.3f}"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "err":
        return f"{value:.1e}"
    if kind == "flag":
        return "yes" if value else "no"
    return str(value)


COLUMNS = (
    ("system", "system", ""),
    ("full MB", "full_bytes", "bytes"),
    ("incr MB/step", "incr_bytes", "bytes"),
    ("write red.", "write_reduction", "x"),
    ("stored MB", "cum_bytes", "bytes"),
    ("full put s", "full_put_s", "s"),
    ("incr put s", "incr_put_s", "s"),
    ("stall s", "incr_stall_s", "s"),
    ("put/ts", "incr_put_ratio", "x"),
    ("restore latest s", "restore_latest_s", "s"),
    ("restore oldest s", "restore_oldest_s", "s"),
    ("restore/ts", "restore_ratio", "x"),
    ("warm restore s", "restore_warm_s", "s"),
    ("warm/ts", "warm_restore_ratio", "x"),
    ("1st warm/ts", "warm_first_ratio", "x"),
    ("in-place s", "restore_inplace_s", "s"),
    ("in-place/(ts+copy)", "inplace_ratio", "x"),
    ("full put/ts", "full_put_ratio", "x"),
    ("incr x int8", "vs_int8", "x"),
    ("put peak +MB", "put_peak_over_start", "bytes"),
    ("restore peak +MB", "restore_peak_over_start", "bytes"),
    ("in-place peak +MB", "inplace_peak_over_start", "bytes"),
    ("rel. RMSE", "rel_rmse", "err"),
    ("oldest exact", "oldest_bit_exact", "flag"),
)


def markdown(summary: dict[str, Any], checks: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Checkpoint benchmark",
        "",
        f"Tables: {meta['logical_mb']:.1f} MB fp32 in {meta['n_tables']} tables "
        f"(scale {meta['scale']:g}); 1 full + {meta['steps']} incremental steps; "
        f"median of {meta['repeat']} run(s); cache eviction: {meta['cache_eviction']}; "
        f"peak memory by {meta['memory_method']}.",
        "MB = 10^6 bytes allocated on disk (st_blocks). Ratios against torch.save "
        "(+fsync), timed both ways at every step (a file kept per step; one file replaced "
        "per step), the faster of the two being the peer; stall = time until put_tables "
        "returns.",
        "",
    ]
    for workload, rows in summary.items():
        ts = rows.get("torch_save") or {}
        if ts.get("incr_put_keep_s") is not None:
            lines += [f"torch.save+fsync ({workload}): incremental step "
                      f"{ts['incr_put_keep_s']:.3f} s kept per step, "
                      f"{ts['incr_put_replace_s']:.3f} s replaced per step; "
                      f"full {ts['full_put_keep_s']:.3f} s / {ts['full_put_replace_s']:.3f} s.",
                      ""]
            break
    header = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    for workload, rows in summary.items():
        lines += [f"## {workload}", "", header, rule]
        for system, row in rows.items():
            cells = [system] + [_fmt(row.get(key), kind) for _, key, kind in COLUMNS[1:]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    per_step = summary.get(TARGET_WORKLOAD) or next(iter(summary.values()), {})
    if per_step:
        name = TARGET_WORKLOAD if TARGET_WORKLOAD in summary else next(iter(summary))
        lines += [f"### Per step ({name}): MB written / MB stored / put s / stall s", "",
                  "| system | " + " | ".join(
                      f"step {st['step']}" for st in next(iter(per_step.values()))["per_step"])
                  + " |",
                  "|---|" + "---|" * len(next(iter(per_step.values()))["per_step"])]
        for system, row in per_step.items():
            cells = [f"{st['bytes_written'] / 1e6:.1f} / {st['cum_bytes'] / 1e6:.1f} / "
                     f"{st['put_s']:.3f} / {st['stall_s']:.3f}" for st in row["per_step"]]
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
        lines.append("")
    fp = meta.get("fingerprint") or {}
    if fp.get("available"):
        for device in ("cpu", "cuda"):
            if device in fp:
                lines.append(
                    f"Fingerprint throughput ({device}): {fp[device]['gb_per_s']:.2f} GB/s "
                    f"over {fp['bytes'] / 1e6:.0f} MB."
                )
    elif fp:
        lines.append(f"Fingerprint throughput: not measured ({fp.get('reason')}).")
    cli = meta.get("cli_startup") or {}
    if cli:
        peer = cli.get("python -c pass", {}).get("median_s")
        lines += ["", "## CLI start-up (median wall s; peer: `python -c pass`)", "",
                  "| command | s | x peer | imports torch |", "|---|---|---|---|"]
        for name, r in cli.items():
            ratio = f"{r['median_s'] / peer:.1f}" if peer else "-"
            lines.append(f"| `{name}` | {r['median_s']:.3f} | {ratio} | "
                         f"{'**yes**' if r['imports_torch'] else 'no'} |")
    lines += ["", f"## Targets ({TARGET_WORKLOAD})", "", "| system | target | value | met |",
              "|---|---|---|---|"]
    for c in checks:
        met = "-" if c["met"] is None else ("yes" if c["met"] else "**no**")
        value = "-" if c["value"] is None else f"{c['value']:.3g}"
        lines.append(f"| {c['system']} | {c['target']} | {value} | {met} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], out_dir: Path) -> list[str]:
    """Bar charts (PNG) of incremental bytes and put time; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for key, label, fname in (
        ("incr_bytes", "bytes written per incremental step (MB)", "incr_bytes.png"),
        ("incr_put_s", "incremental put time (s)", "incr_put_s.png"),
    ):
        workloads = list(summary)
        systems = sorted({s for rows in summary.values() for s in rows})
        fig, ax = plt.subplots(figsize=(max(6, len(workloads) * 1.6), 4))
        width = 0.8 / max(1, len(systems))
        for i, system in enumerate(systems):
            ys = [summary[w].get(system, {}).get(key) or 0 for w in workloads]
            ys = [y / 1e6 for y in ys] if key.endswith("bytes") else ys
            ax.bar([j + i * width for j in range(len(workloads))], ys, width, label=system)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=100)
        plt.close(fig)
        written.append(fname)
    return written


RESTORE_BARS = (("restore_latest_s", "latest, cold"), ("restore_oldest_s", "oldest, cold"),
                ("restore_warm_s", "latest, warm (median of 3)"),
                ("restore_inplace_s", "latest, into existing tensors"))


def plot_restores(summary: dict[str, Any], out: Path, workload: str | None = None) -> None:
    """Restore time per system (PNG at ``out``): one bar per restore kind and system, for
    ``workload`` (default: the first). torch_save's restore is torch.load, dcp's dcp.load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = workload or next(iter(summary))
    rows = summary[work]
    systems = list(rows)
    peer = {"torch_save": "torch.load", "safetensors": "safetensors load", "dcp": "dcp.load"}
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(systems)), 4.2))
    width = 0.8 / len(RESTORE_BARS)
    for i, (key, label) in enumerate(RESTORE_BARS):
        ys = [rows[s].get(key) or 0.0 for s in systems]
        ax.bar([j + i * width for j in range(len(systems))], ys, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(systems))],
                  [peer.get(s, s) for s in systems], fontsize=8)
    ax.set_ylabel("restore time (s)")
    mb = next(iter(rows.values()))["logical_bytes"] / 1e6
    ax.set_title(f"Restore time per system: {mb:.0f} MB of tables, {work}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
