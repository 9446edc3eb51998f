"""Reading the server's Prometheus metrics (`serve --metrics-port`)."""
from __future__ import annotations

import http.client
import urllib.request

# What a failed read raises: unreachable or timed out, not HTTP, not Prometheus' text format.
UNREADABLE = (OSError, ValueError, http.client.HTTPException)
# (sample name, sorted label pairs) -> value
Snapshot = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 5.0) -> Snapshot:
    # Here: only a run that reads metrics needs prometheus-client on the load generator.
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(snap: Snapshot, name: str, **labels: str) -> float | None:
    return snap.get((name, tuple(sorted(labels.items()))))


def counter_delta(before: Snapshot, after: Snapshot, name: str) -> float | None:
    """Increase of a counter (its `_total` sample) between two scrapes."""
    a, b = value(after, f"{name}_total"), value(before, f"{name}_total")
    return None if a is None or b is None else a - b


def _bound(le: str) -> float | None:
    """A bucket's upper bound; None for one that is no number (what else serves the URL, or a
    proxy in between, may write anything: one odd line must not cost the point its figures)."""
    try:
        return float(le)
    except ValueError:
        return None


def histogram_delta(before: Snapshot, after: Snapshot, name: str) -> dict | None:
    """Observations between two scrapes: count, sum, mean and the count per bucket
    (non-cumulative, keyed by upper bound). None if the server has no such histogram."""
    count_a, count_b = value(after, f"{name}_count"), value(before, f"{name}_count")
    if count_a is None or count_b is None:
        return None
    count = count_a - count_b
    total = (value(after, f"{name}_sum") or 0.0) - (value(before, f"{name}_sum") or 0.0)
    bounds = sorted((bound, le) for sample, labels in after if sample == f"{name}_bucket"
                    if (le := dict(labels).get("le")) is not None and (bound := _bound(le)) is not None)
    buckets: dict[str, float] = {}
    below = 0.0
    for _, le in bounds:
        cumulative = (value(after, f"{name}_bucket", le=le) or 0.0) - (value(before, f"{name}_bucket", le=le) or 0.0)
        buckets[le] = cumulative - below
        below = cumulative
    return {"count": count, "sum": total, "mean": total / count if count else None, "buckets": buckets}
