"""A client of Envoy's admin API: runtime weights and shadow share, stats, readiness."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from recserve.access.config import (
    PROTOCOLS,
    SHADOW_KEY,
    AccessError,
    cluster_name,
    shadow_per_million,
    weight_key,
)


class AdminClient:
    """Envoy's admin interface at ``host:port`` (loopback), with explicit timeouts.

    Args:
        url: ``host:port`` of the admin listener.
        timeout_s: per call.
    """

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s

    def _call(self, path: str, params: Mapping[str, str] | None = None, method: str = "GET") -> str:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        request = urllib.request.Request(f"http://{self.url}{path}{query}", method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return str(response.read().decode())
        except urllib.error.HTTPError as exc:
            raise AccessError(
                f"Envoy admin {method} {path}: HTTP {exc.code} {exc.read().decode()!r}"
            ) from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise AccessError(f"Envoy admin {method} {path} at {self.url}: {exc}") from exc

    def is_ready(self) -> bool:
        """True when Envoy has initialised (``/ready`` answers ``LIVE``)."""
        try:
            return self._call("/ready").strip() == "LIVE"
        except AccessError:
            return False

    def runtime_modify(self, values: Mapping[str, int | str]) -> None:
        """Set runtime keys in Envoy's admin layer, all in one update."""
        if not values:
            return
        reply = self._call("/runtime_modify", {k: str(v) for k, v in values.items()}, method="POST")
        if reply.strip() != "OK":
            raise AccessError(f"Envoy refused the runtime change {dict(values)}: {reply.strip()!r}")

    def set_weights(self, weights: Mapping[str, int]) -> None:
        """Route by these variant weights from now on (both protocols, one update; no reload).

        Variants left out keep their current weight.

        Raises:
            AccessError: a weight is negative, or Envoy refused the change.
        """
        if any(int(w) < 0 for w in weights.values()):
            raise AccessError(f"weights must be >= 0, got {dict(weights)}")
        self.runtime_modify({weight_key(v, p): int(w) for v, w in weights.items() for p in PROTOCOLS})

    def set_shadow_fraction(self, fraction: float) -> None:
        """Mirror this share of live requests to the shadow variant from now on."""
        self.runtime_modify({SHADOW_KEY: shadow_per_million(fraction)})

    def runtime(self) -> dict[str, str]:
        """The runtime keys that are set (``/runtime``): key -> final value."""
        entries: dict[str, Any] = json.loads(self._call("/runtime")).get("entries", {})
        return {key: str(entry.get("final_value", "")) for key, entry in entries.items()}

    def stats(self, pattern: str = "") -> dict[str, int]:
        """Counters and gauges whose name matches the regular expression ``pattern``."""
        params = {"format": "json", **({"filter": pattern} if pattern else {})}
        document: dict[str, Any] = json.loads(self._call("/stats", params))
        return {
            str(stat["name"]): int(stat["value"])
            for stat in document.get("stats", [])
            if "value" in stat and "name" in stat
        }

    def cluster_stat(self, variant: str, protocol: str, stat: str, shadow: bool = False) -> int:
        """One counter or gauge of a cluster, e.g. ``upstream_rq_completed`` (0 when not yet set)."""
        name = f"cluster.{cluster_name(variant, protocol, shadow)}.{stat}"
        return self.stats(f"^{name.replace('.', '[.]')}$").get(name, 0)

    def prometheus(self) -> str:
        """Every stat in the Prometheus text format (``/stats/prometheus``)."""
        return self._call("/stats/prometheus")
