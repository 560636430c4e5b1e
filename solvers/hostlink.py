"""The host <-> device link that paging strategies (POET) charge transfers with.

A transfer of b bytes, either way, costs ``latency + b / bandwidth`` graph cost units. The
numbers come from a device profile (``profiles/*.json``: ``host_bandwidth`` in bytes/s and
``host_latency`` in s, read here as plain JSON so that ``solvers`` stays torch-free) or are
given directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solvers import device_profiles
from solvers.errors import CheckmateError
from solvers.graph import Graph

__all__ = ["HostLink", "host_link"]

_DEFAULT_PROFILE = "h100"


@dataclass(frozen=True)
class HostLink:
    """The host <-> device link: a transfer of b bytes takes ``latency + b / bandwidth``.

    Attributes:
        bandwidth: bytes per graph cost unit (bytes/s for graphs profiled in seconds);
            ``math.inf`` for free bandwidth.
        latency: graph cost units per transfer.
        source: where the numbers came from (a profile name, or "options").
    """

    bandwidth: float
    latency: float = 0.0
    source: str = "options"

    def time(self, nbytes: int) -> float:
        """Cost of moving ``nbytes`` in either direction."""
        return self.latency + (nbytes / self.bandwidth if nbytes else 0.0)


def host_link(
    graph: Graph,
    *,
    bandwidth: float | None = None,
    latency: float | None = None,
    profile: str | Path | None = None,
) -> HostLink:
    """The host link to plan with: explicit numbers, else a device profile's.

    The profile is ``profile`` (a name in ``profiles/`` or a JSON path), else the one the
    graph was profiled with (``graph.meta["profile"] = "profile:NAME:..."``), else
    ``cpu`` for graphs measured on a CPU, else ``h100``. Profile numbers are in seconds
    and bytes/s, so they fit graphs whose costs are seconds. ``bandwidth`` and
    ``latency`` override the profile's.

    Raises:
        CheckmateError: the profile is unknown or lacks ``host_bandwidth``; a number is
            negative, or the bandwidth is zero.
    """
    name = str(profile) if profile is not None else _profile_of(graph)
    bw, lat, source = bandwidth, latency, "options"
    if bw is None or lat is None:
        doc = _read_profile(name)
        bw = float(doc["host_bandwidth"]) if bw is None else bw
        lat = float(doc.get("host_latency", 0.0)) if lat is None else lat
        source = f"profile {name}"
    if not (bw > 0) or not (lat >= 0):
        raise CheckmateError(
            f"host link: bandwidth must be > 0 and latency >= 0 (got bandwidth={bw}, latency={lat})"
        )
    return HostLink(float(bw), float(lat), source)


def _profile_of(graph: Graph) -> str:
    tag = str(graph.meta.get("profile", ""))
    if tag.startswith("profile:"):
        return tag.split(":")[1]
    if tag.startswith("measured:") and tag.endswith("-cpu"):
        return "cpu"
    return _DEFAULT_PROFILE


def _read_profile(name: str) -> dict[str, Any]:
    try:
        _, doc = device_profiles.load_document(name)
    except CheckmateError as exc:
        raise CheckmateError(
            f"cannot read device profile {name!r} ({exc}); or pass bandwidth= and latency="
        ) from None
    if "host_bandwidth" not in doc:
        raise CheckmateError(f"device profile {name!r} has no host_bandwidth; pass bandwidth=")
    return dict(doc)
