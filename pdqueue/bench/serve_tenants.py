"""`bench serve --tenants FILE --tenant-rates A=R,B=R`: tenants sharing one cluster (issue 27).

Each mode's cluster gets a gateway (`pdqueue serve --tenants FILE`) in front of it, and each
tenant named in ``--tenant-rates`` sends its own seeded Poisson load (the bench's workload:
short chat prompts and long documents) at its own rate for ``--duration`` seconds, through
the gateway, with the first API key the file gives it. So one tenant can be sent at, say,
5x what its ``requests_per_s`` lets in while the other stays within its own, and the figures
say whether the flood moved the quiet tenant's TTFT.

Per tenant (``tenant_figures``):

- ``sent`` = ``answered`` + ``rate_limited`` (HTTP 429 from the gateway) + ``failed`` (any
  other error or no answer within the drain timeout);
- ``admitted`` = ``sent`` - ``rate_limited``; ``ttft_ms``/``tbt_ms`` (p50/p90/p99, over the
  answered requests; a TBT gap is between two SSE chunks, which may carry several tokens);
- ``slo_met``: admitted requests with TTFT <= ``--slo-ttft-ms`` and the p90 of their gaps
  <= ``--slo-tbt-ms``; ``slo_attainment`` = ``slo_met / admitted`` (a 429 is the limit
  working, not a missed SLO); ``ttft_p99_within_slo``.

Pure functions of the records, and the tenants file read through the gateway's own loader.
Imports the standard library, pdqueue.frontends.tenants and the bench's own modules
(``serve_report.latencies``: TTFT, gaps and SLO as ``bench serve``'s figures count them).
"""

from __future__ import annotations

from pdqueue.bench.serve_client import Record
from pdqueue.bench.serve_load import Planned, Settings, plan_requests
from pdqueue.bench.serve_report import latencies
from pdqueue.bench.stats import summary


def parse_tenant_rates(text: str) -> tuple[tuple[str, float], ...]:
    """``chat=1,flood=5`` -> (("chat", 1.0), ("flood", 5.0)); ValueError saying what is wrong."""
    out: list[tuple[str, float]] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, sep, rate = item.partition("=")
        name = name.strip()
        try:
            value = float(rate)
        except ValueError:
            value = float("nan")
        if not sep or not name or not value > 0 or value == float("inf"):
            raise ValueError(f"{item!r}: expected TENANT=RATE with a rate > 0 (req/s), e.g. chat=1,flood=5")
        if name in dict(out):
            raise ValueError(f"tenant {name!r} is given twice")
        out.append((name, value))
    if not out:
        raise ValueError("no tenant given; expected TENANT=RATE,..., e.g. chat=1,flood=5")
    return tuple(out)


def tenant_keys(path: str, rates) -> dict[str, str]:
    """The API key each tenant of ``rates`` sends with: the first of its ``api_keys`` in the
    tenants file (``TenantError``/``ValueError`` naming the problem)."""
    from pdqueue.frontends.tenants import load_tenants

    tenants = {t.name: t for t in load_tenants(path)}
    unknown = [name for name, _ in rates if name not in tenants]
    if unknown:
        verb = "is not a tenant" if len(unknown) == 1 else "are not tenants"
        raise ValueError(f"{', '.join(map(repr, unknown))} {verb} of {path} (its tenants: {', '.join(tenants)})")
    return {name: tenants[name].api_keys[0] for name, _ in rates}


def plan_tenant_requests(settings: Settings) -> list[Planned]:
    """Every tenant's seeded Poisson arrivals over ``duration_s`` at its own rate (its own
    seed), merged in arrival order; ``Planned.tenant`` says whose they are."""
    out: list[Planned] = []
    for index, (name, rate) in enumerate(settings.tenant_rates):
        count = max(1, round(rate * settings.duration_s))
        out += [Planned(p.at_s, p.kind, p.prompt_ids, p.max_tokens, tenant=name)
                for p in plan_requests(settings, rate, count, salt=1000 + index)]
    return sorted(out, key=lambda p: p.at_s)


def tenant_figures(records: list[Record], settings: Settings) -> dict:
    """The figures of one mode, by tenant (the module docstring says what each is)."""
    out = {}
    for name, rate in settings.tenant_rates:
        mine = [r for r in records if r.planned.tenant == name]
        answered = [r for r in mine if r.finished is not None and r.error is None and r.token_times]
        limited = [r for r in mine if r.http_status == 429]
        ttft, per_request, met = latencies(answered, settings)
        admitted = len(mine) - len(limited)
        ttft_summary = summary(ttft)
        out[name] = {
            "rate": rate, "sent": len(mine), "answered": len(answered), "rate_limited": len(limited),
            "failed": len(mine) - len(answered) - len(limited), "admitted": admitted,
            "errors": sorted({r.error for r in mine if r.error and r.http_status != 429})[:5],
            "ttft_ms": ttft_summary, "tbt_ms": summary(g for request in per_request for g in request),
            "slo_met": met, "slo_attainment": met / admitted if admitted else None,
            "ttft_p99_within_slo": bool(answered) and ttft_summary["p99"] <= settings.slo_ttft_ms,
        }
    return out


def format_tenants_table(result: dict) -> str:
    slo = result["slo"]
    lines = [f"model {result['model']}; SLO: TTFT <= {slo['ttft_ms']:g} ms, p90 TBT <= {slo['tbt_ms']:g} ms; "
             f"tenants {result['tenants_file']}, {result['duration_s']:g} s of arrivals each",
             f"{'mode':<25}{'tenant':<14}{'req/s':>7}{'sent':>6}{'answered':>9}{'429':>6}{'failed':>7}"
             f"  {'TTFT p50/p99 ms':>18}  {'TBT p50/p99 ms':>16}{'attain':>8}  p99<=SLO"]
    for mode, figures in result["modes"].items():
        for name, f in figures["tenants"].items():
            attain = "-" if f["slo_attainment"] is None else f"{f['slo_attainment']:.2f}"
            lines.append(f"{mode:<25}{name:<14}{f['rate']:>7g}{f['sent']:>6}{f['answered']:>9}{f['rate_limited']:>6}"
                         f"{f['failed']:>7}  {f['ttft_ms']['p50']:>8.0f}/{f['ttft_ms']['p99']:<9.0f}"
                         f"  {f['tbt_ms']['p50']:>7.0f}/{f['tbt_ms']['p99']:<8.0f}{attain:>8}  "
                         f"{'yes' if f['ttft_p99_within_slo'] else 'no'}")
    return "\n".join(lines)
