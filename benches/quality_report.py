"""Statistics, the auto thresholds, tables and plots of the quality experiment
(benches/quality.py writes results.json; this reads it).

Every figure is a mean over seeds of a paired per-seed relative change, with a 95%
Student-t interval: loss change (L_restored - L_base) / L_base, positive is worse; AUC
change (A_restored - A_base) / A_base, negative is worse. A (scheme, restores) cell is
within Check-N-Run's 0.01% budget when the worse end of both intervals is: the loss
interval's upper end below +1e-4 and the AUC interval's lower end above -1e-4.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

__all__ = ["BUDGET", "cells", "derive_policy", "interval", "report", "t975"]

BUDGET = 1e-4


# Student's t, 0.975 quantile, df = 1..30 (beyond: the Cornish-Fisher expansion).
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("an interval needs at least two seeds")
    if df <= len(_T975):
        return _T975[df - 1]
    z, v = 1.959963984540054, float(df)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3))


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% interval)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.inf
    return mean, t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def cells(task: dict) -> dict[tuple[str, int], dict]:
    """Per (scheme, restores) of one task: loss and AUC (mean, half-width), mean bytes per
    checkpoint, number of seeds, whether every run was bit-identical to its base."""
    per: dict[tuple[str, int], list[tuple[dict, dict]]] = {}
    for seed in task["seeds"]:
        for run in seed["runs"]:
            per.setdefault((run["scheme"], run["restores"]), []).append((seed, run))
    out = {}
    for key, pairs in per.items():
        loss = interval([(r["loss"] - s["loss"]) / s["loss"] for s, r in pairs])
        auc = interval([(r["auc"] - s["auc"]) / s["auc"] for s, r in pairs])
        out[key] = {"loss": loss, "auc": auc, "n": len(pairs),
                    "bytes": statistics.fmean(r["bytes"] for _, r in pairs),
                    "identical": all(r["identical"] for _, r in pairs),
                    "within": loss[0] + loss[1] < BUDGET and auc[0] - auc[1] > -BUDGET}
    return out


def derive_policy(doc: dict) -> list[tuple[int, str]]:
    """The auto thresholds the measurement supports: [(max_restores, scheme), ...].

    For each measured number of restores N (ascending), the scheme writing the fewest
    bytes that is within budget on every task at N and at every measured count below N
    (exact always is). A job expecting up to N restores gets that scheme; neighbouring
    counts with the same scheme merge. Beyond the largest N nothing was measured."""
    tasks = [cells(t) for t in doc["tasks"].values()]
    restores = sorted(doc["restores"])

    def ok(scheme: str, n: int) -> bool:  # a cell not measured on a task is not trusted
        return scheme == "exact" or all(
            (scheme, m) in c and c[(scheme, m)]["within"]
            for c in tasks for m in restores if m <= n)

    def cost(scheme: str) -> float:
        return max((c[(scheme, m)]["bytes"] for c in tasks for m in restores
                    if (scheme, m) in c), default=math.inf)

    policy: list[tuple[int, str]] = []
    for n in restores:
        best = min((s for s in doc["schemes"] if ok(s, n)), key=cost)
        if policy and policy[-1][1] == best:
            policy[-1] = (n, best)
        else:
            policy.append((n, best))
    return policy


def _fmt(mi: tuple[float, float]) -> str:
    return f"{mi[0]:+.1e} ± {mi[1]:.1e}"


def markdown(doc: dict) -> str:
    lines = []
    for name, task in doc["tasks"].items():
        c = cells(task)
        base_loss = statistics.fmean(s["loss"] for s in task["seeds"])
        base_auc = statistics.fmean(s["auc"] for s in task["seeds"])
        lines += [f"### {name}: {len(task['seeds'])} seeds, {task['steps']} steps of "
                  f"{task['batch']}, {task['eval_samples']:,} held-out samples; base run "
                  f"loss {base_loss:.4f}, AUC {base_auc:.4f} (mean over seeds)", "",
                  "| scheme | restores | seeds | loss change | AUC change | within 0.01% | "
                  "bytes/ckpt |", "|---|---|---|---|---|---|---|"]
        for scheme in doc["schemes"]:
            for n in doc["restores"]:
                if (scheme, n) not in c:
                    continue
                x = c[(scheme, n)]
                within = "yes" if x["within"] else "**no**"
                if x["identical"]:
                    within += " (bit-identical)"
                lines.append(f"| {scheme} | {n} | {x['n']} | {_fmt(x['loss'])} | "
                             f"{_fmt(x['auc'])} | {within} | {x['bytes'] / 1e3:,.1f} kB |")
        lines.append("")
    policy = derive_policy(doc)
    lines += ["### auto thresholds the measurement supports", "",
              "| expected restores | scheme |", "|---|---|"]
    lo = 0
    for n, scheme in policy:
        lines.append(f"| {lo} – {n} | {scheme} |")
        lo = n + 1
    return "\n".join(lines)


def plots(doc: dict, out: Path) -> list[Path]:
    """quality_restores.png (change against restores, per scheme) and quality_bytes.png
    (bytes per checkpoint against change), one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["tasks"])
    made = []
    fig, axes = plt.subplots(2, len(names), figsize=(5.5 * len(names), 7.5), squeeze=False)
    for col, name in enumerate(names):
        c = cells(doc["tasks"][name])
        for row, metric in enumerate(("loss", "auc")):
            ax = axes[row][col]
            for k, scheme in enumerate(doc["schemes"]):
                ns = [n for n in doc["restores"] if (scheme, n) in c]
                shift = 0.04 * (k - (len(doc["schemes"]) - 1) / 2)
                xs = [n * (1 + shift) for n in ns]  # side by side, bars visible
                ax.errorbar(xs, [c[(scheme, n)][metric][0] for n in ns],
                            yerr=[c[(scheme, n)][metric][1] for n in ns],
                            marker="o", capsize=3, label=scheme)
            sign = 1 if metric == "loss" else -1
            ax.axhline(sign * BUDGET, color="red", ls="--", lw=1, label="0.01% budget")
            ax.axhline(0, color="grey", lw=0.5)
            ax.set_xscale("log")
            ax.set_yscale("symlog", linthresh=1e-5)
            ax.set_xticks(doc["restores"], [str(n) for n in doc["restores"]])
            ax.set_xlabel("restores")
            ax.set_ylabel(f"relative {'loss' if metric == 'loss' else 'AUC'} change")
            ax.set_title(f"{name}: {'loss (up is worse)' if sign > 0 else 'AUC (down is worse)'}")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    made.append(out / "quality_restores.png")
    fig.savefig(made[-1], dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for col, name in enumerate(names):
        c, ax = cells(doc["tasks"][name]), axes[0][col]
        for n in doc["restores"]:
            schemes = sorted((s for s in doc["schemes"] if (s, n) in c),
                             key=lambda s: c[(s, n)]["bytes"])
            xs = [c[(s, n)]["bytes"] / 1e3 for s in schemes]
            ax.errorbar(xs, [c[(s, n)]["loss"][0] for s in schemes],
                        yerr=[c[(s, n)]["loss"][1] for s in schemes],
                        marker="o", capsize=3, label=f"{n} restores")
            for x, s in zip(xs, schemes):
                ax.annotate(s, (x, c[(s, n)]["loss"][0]), fontsize=7)
        ax.axhline(BUDGET, color="red", ls="--", lw=1, label="0.01% budget")
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1e-5)
        ax.set_xlabel("bytes per checkpoint (kB)")
        ax.set_ylabel("relative loss change")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    made.append(out / "quality_bytes.png")
    fig.savefig(made[-1], dpi=90)
    plt.close(fig)
    return made


def report(doc: dict, out: Path | None) -> str:
    """The markdown tables; with ``out``, also the plots and out/report.md."""
    text = markdown(doc)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plots(doc, out)
        (out / "report.md").write_text(text + "\n")
    return text
