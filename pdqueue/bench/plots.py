"""PNG plots of bench results; matplotlib is optional (``available()`` says whether it is there).

Every function takes the result object a bench returned (its JSON form) and a directory,
writes PNG files and returns their paths. Imports matplotlib lazily (Agg backend).
"""

from __future__ import annotations

from pathlib import Path

from pdqueue.protocol import ROLES


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_transfer(result: dict, directory: Path) -> list[Path]:
    """GB/s against transfer size, one line per path (both layouts on one axis)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = sorted(result["sizes"], key=lambda r: r["bytes"])
    paths = [p for p in rows[0]["paths"]]
    for path in paths:
        points = [(r["bytes"] / 2**20, r["paths"][path]["gb_s"]) for r in rows if path in r["paths"]]
        ax.plot(*zip(*points), marker="o", label=path)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes moved (MiB)")
    ax.set_ylabel("GB/s (median, end to end)")
    ax.set_title("KV transfer prefill -> decode process")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = Path(directory) / "transfer.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]


def _cdf(ax, values, label) -> None:
    data = sorted(values)
    if data:
        ax.plot(data, [(i + 1) / len(data) for i in range(len(data))], label=label)


def plot_serve(result: dict, directory: Path) -> list[Path]:
    """TTFT and TBT CDFs per mode (one figure per rate), and goodput against rate; for a
    phased run, each mode's worker roles and stream backlogs over time instead."""
    if result.get("phases"):
        return plot_phases(result, directory) + plot_timelines(result, directory)
    plt = _pyplot()
    written = plot_timelines(result, directory)
    rates = result["rates"]
    for rate in rates:
        fig, (ax_ttft, ax_tbt) = plt.subplots(1, 2, figsize=(12, 4.5))
        for mode, by_rate in result["raw"].items():
            raw = by_rate.get(f"{rate:g}")
            if raw:
                _cdf(ax_ttft, raw["ttft_ms"], mode)
                _cdf(ax_tbt, raw["tbt_ms"], mode)
        for ax, what in ((ax_ttft, "TTFT (ms)"), (ax_tbt, "time between tokens (ms)")):
            ax.set_xscale("log")
            ax.set_xlabel(what)
            ax.set_ylabel("fraction of requests" if ax is ax_ttft else "fraction of gaps")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"{result['model']}, {rate} {result.get('workload', {}).get('rate_unit', 'req/s')}")
        path = Path(directory) / f"serve_cdf_rate{rate:g}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, pooled in result["modes"].items():
        points = [(float(r), f["goodput_rps"]) for r, f in pooled["by_rate"].items()]
        ax.plot(*zip(*sorted(points)), marker="o", label=mode)
    if result.get("workload", {}).get("rate_unit") == "sessions/s":   # --workload multiturn (serve_turns.py)
        ax.set_xlabel("session arrival rate (sessions/s)")
        ax.set_ylabel("goodput (turns/s meeting both SLOs)")
    else:
        ax.plot(rates, rates, linestyle=":", color="grey", label="offered")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("goodput (req/s meeting both SLOs)")
    ax.set_title(f"goodput, TTFT <= {result['slo']['ttft_ms']} ms and p90 TBT <= {result['slo']['tbt_ms']} ms")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = Path(directory) / "serve_goodput.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
    return written


def plot_phases(result: dict, directory: Path) -> list[Path]:
    """One row per mode: the number of workers in each role over time (top) and the request
    and handoff backlogs (bottom), with the phase boundaries marked."""
    plt = _pyplot()
    modes = [m for m in result["raw"] if result["raw"][m].get("phases")]
    fig, axes = plt.subplots(len(modes), 2, figsize=(13, 3.2 * max(1, len(modes))), squeeze=False)
    bounds, t = [], 0.0
    for ph in result["phases"]:
        bounds.append((t, ph["name"]))
        t += ph["duration_s"]
    for row, mode in zip(axes, modes):
        timeline = result["raw"][mode]["phases"]["timeline"]
        ts = [p["t"] for p in timeline]
        ax_roles, ax_backlog = row
        for role in ROLES:
            ax_roles.step(ts, [sum(r == role for r in p["roles"].values()) for p in timeline], where="post",
                          label=role)
        ax_backlog.plot(ts, [p["request_backlog"] for p in timeline], label="requests")
        ax_backlog.plot(ts, [p["handoff_backlog"] for p in timeline], label="handoffs")
        for ax, what in ((ax_roles, "workers"), (ax_backlog, "entries waiting")):
            for start, name in bounds:
                ax.axvline(start, color="grey", linestyle=":")
                ax.text(start, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
            ax.set_ylabel(what)
            ax.set_title(mode, fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        ax_backlog.set_xlabel("seconds")
        ax_roles.set_xlabel("seconds")
    path = Path(directory) / "serve_phases.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]


def _timelines(result: dict) -> list[tuple[str, str, list[dict]]]:
    """(mode, rate key or "phases", samples) for every run that kept a timeline."""
    out = []
    for mode, by_rate in result["raw"].items():
        for key, raw in by_rate.items():
            timeline = raw.get("timeline") if isinstance(raw, dict) else None
            if timeline:
                out.append((mode, key, timeline))
    return out


def plot_timelines(result: dict, directory: Path) -> list[Path]:
    """One PNG per mode, one row per rate (or the phased run): the workers' roles and running
    requests; the levers (each TBT budget, each decode worker's spare share); the request and
    handoff backlogs beside the prompts placed on decode workers and the decodes migrated,
    both cumulative. Samples come from the heartbeats every 0.5 s (serve_bench._sample_timeline)."""
    plt = _pyplot()
    written = []
    runs = _timelines(result)
    for mode in dict.fromkeys(m for m, _k, _t in runs):
        rows = [(key, t) for m, key, t in runs if m == mode]
        fig, axes = plt.subplots(len(rows), 3, figsize=(16, 3.2 * len(rows)), squeeze=False)
        for (key, timeline), (ax_roles, ax_levers, ax_flow) in zip(rows, axes):
            ts = [p["t"] for p in timeline]
            ids = sorted({w for p in timeline for w in p.get("workers", p["roles"])})
            for wid in ids:
                states = [p.get("workers", {}).get(wid, {}) for p in timeline]
                roles = [s.get("role") or p["roles"].get(wid) for s, p in zip(states, timeline)]
                ax_roles.step(ts, [s.get("running", 0) for s in states], where="post", label=f"{wid} running")
                changes = [(t, role) for i, (t, role) in enumerate(zip(ts, roles))
                           if role and (i == 0 or role != roles[i - 1])]
                for t, role in changes:
                    ax_roles.annotate(role[0].upper(), (t, 0), fontsize=8, xytext=(0, -10), textcoords="offset points")
                budgets = [s.get("tbt_budget_ms") for s in states]
                if any(b for b in budgets):
                    ax_levers.step(ts, [b or float("nan") for b in budgets], where="post", label=f"{wid} TBT budget ms")
                spare = [s.get("spare") for s in states]
                if any(x is not None for x in spare):
                    ax_levers.plot(ts, [100 * x if x is not None else float("nan") for x in spare],
                                   label=f"{wid} spare %")
            ax_flow.plot(ts, [p["request_backlog"] for p in timeline], label="requests waiting")
            ax_flow.plot(ts, [p["handoff_backlog"] for p in timeline], label="handoffs waiting")
            for field, label in (("placed_out", "prompts placed (cum.)"), ("migrated_out", "decodes migrated (cum.)")):
                values = [sum(w.get(field, 0) for w in p.get("workers", {}).values()) for p in timeline]
                if any(values):
                    ax_flow.step(ts, values, where="post", label=label)
            title = f"{mode}, {'phased load' if key == 'phases' else key + ' req/s'}"
            for ax, what in ((ax_roles, "running (roles: P/D/C at changes)"), (ax_levers, "ms / %"),
                             (ax_flow, "entries")):
                ax.set_title(title, fontsize=9)
                ax.set_ylabel(what)
                ax.set_xlabel("seconds")
                ax.grid(True, alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
        path = Path(directory) / f"serve_timeline_{mode}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
