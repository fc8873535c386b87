"""A server's Prometheus ``/metrics`` as the latency dashboard's ``metrics_fn``: the exposition text
parsed into ``{series: value}`` (:func:`parse_prometheus_text`) and a function that fetches it
(:func:`http_metrics_fn`; :class:`workbench.lab.load_views.LatencyDashboard` polls it)."""

from __future__ import annotations

from collections.abc import Callable


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Prometheus exposition text -> {series: value}; labelled series keep their labels in the
    key (``name{a="b"}``).  Comments and unparsable lines are skipped."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.rpartition("}") if "}" in line else ("", "", line)
        name, value = (head + "}", rest.split()) if head else (rest.split()[0], rest.split()[1:])
        try:
            out[name.strip()] = float(value[0])
        except (IndexError, ValueError):
            continue
    return out


def http_metrics_fn(url: str, timeout: float = 0.5) -> Callable[[], dict]:
    """A ``metrics_fn`` that GETs a Prometheus ``/metrics`` URL (blocking; the dashboard calls
    it from its poller thread)."""
    def fetch() -> dict:
        import httpx

        r = httpx.get(url, timeout=timeout)
        r.raise_for_status()
        return parse_prometheus_text(r.text)
    return fetch
