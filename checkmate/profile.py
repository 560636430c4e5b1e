"""Per-op runtimes of a traced joint graph: measured on a device, or estimated from a profile.

:func:`profile_costs` gives the cost (seconds) of each fx node of a functionalized aten
graph. With ``profile=None`` every op is run on the device and timed
(:mod:`checkmate.timing`); otherwise the costs come from a *device profile*, so that a plan
for a GPU can be made on a machine without one.

Device profiles (``profiles/*.json``), format version 1::

    {
      "format": "checkmate-device-profile",   # required, exactly this
      "version": 1,                           # required; newer versions are refused
      "name": "h100",                         # required, str
      "device": "NVIDIA H100 SXM5 80GB",      # required, str: what the numbers describe
      "peak_flops": {"float32": 6.7e13,       # required: FLOP/s attainable per dtype; float32
                     "bfloat16": 9.89e14,     #   is required and also serves non-matmul ops
                     "float16": 9.89e14},     #   and dtypes that are not listed
      "memory_bandwidth": 3.35e12,            # required: device-memory bytes/s
      "launch_overhead": 5e-6,                # required: seconds added to every non-view op
      "host_bandwidth": 5.0e10,               # required: host<->device bytes/s (paging, POET)
      "host_latency": 1e-5,                   # required: seconds per host<->device transfer
      "ops": {"aten.mm.default(float32[64,128], float32[128,256])": 2.1e-6},  # optional
      "description": "...", "sources": ["..."]  # optional, free text
    }

Numbers are positive and finite (``launch_overhead``, ``host_latency`` and op times may be
0). ``ops`` maps op signatures (:func:`checkmate.timing.op_signature`: the op, then each
argument: tensors as ``dtype[shape]``, with ``{strides}`` when not contiguous; other values
as written) to measured seconds; an op found there takes that time.

The roofline estimate of any other op (see :mod:`checkmate.flops` for what is counted and
how it is approximated)::

    cost = max(flops / peak, bytes_moved / memory_bandwidth) + launch_overhead

where ``peak`` is ``peak_flops[dtype]`` for matmul-like ops (mm, convolutions, attention)
and ``peak_flops["float32"]`` for the rest. Views, ``getitem`` and placeholders cost 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from solvers import device_profiles
from solvers.errors import ProfileError
from solvers.plan import atomic_write_text

if TYPE_CHECKING:
    import torch
    import torch.fx

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "DeviceProfile",
    "ProfileError",
    "available_profiles",
    "load_profile",
    "profile_costs",
    "profile_id",
    "profiles_dir",
    "measured_profile",
    "save_profile",
]

PROFILE_FORMAT = "checkmate-device-profile"
PROFILE_VERSION = 1


@dataclass(frozen=True)
class DeviceProfile:
    """A device's roofline numbers and an optional table of measured op times.

    Attributes:
        name: short name (``"h100"``).
        device: what the numbers describe (``"NVIDIA H100 SXM5 80GB"``).
        peak_flops: attainable FLOP/s per dtype name; ``"float32"`` is always present.
        memory_bandwidth: device-memory bytes/s.
        launch_overhead: seconds added to every op that is not a view.
        host_bandwidth: host<->device bytes/s (for paging strategies).
        host_latency: seconds per host<->device transfer.
        ops: op signature -> measured seconds; takes precedence over the roofline.
        source: the file the profile was read from, if any.
    """

    name: str
    device: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    launch_overhead: float
    host_bandwidth: float
    host_latency: float
    ops: Mapping[str, float] = field(default_factory=dict)
    source: str | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str = "<profile>") -> DeviceProfile:
        """Validate a profile document (the JSON schema in the module docstring).

        Args:
            doc: the parsed JSON.
            where: names the document in error messages (a path).

        Raises:
            ProfileError: naming the first missing or malformed field.
        """
        if not isinstance(doc, Mapping):
            raise ProfileError(f"{where}: a device profile is a JSON object, got {type(doc).__name__}")
        if doc.get("format") != PROFILE_FORMAT:
            raise ProfileError(
                f"{where}: field 'format' must be {PROFILE_FORMAT!r}, got {doc.get('format')!r}; "
                "is this a checkmate device profile?"
            )
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ProfileError(f"{where}: field 'version' must be a positive integer, got {version!r}")
        if version > PROFILE_VERSION:
            raise ProfileError(
                f"{where}: profile format version {version} is newer than this checkmate reads "
                f"({PROFILE_VERSION}); upgrade checkmate"
            )
        name = _string(doc, "name", where)
        device = _string(doc, "device", where)
        peaks = doc.get("peak_flops")
        if not isinstance(peaks, Mapping) or "float32" not in peaks:
            raise ProfileError(
                f"{where}: field 'peak_flops' must be an object of FLOP/s per dtype including 'float32', "
                f"got {peaks!r}"
            )
        peak_flops = {str(k): _number(v, f"peak_flops.{k}", where, positive=True) for k, v in peaks.items()}
        ops_doc = doc.get("ops", {})
        if not isinstance(ops_doc, Mapping):
            raise ProfileError(f"{where}: field 'ops' must be an object mapping op signatures to seconds")
        ops = {str(k): _number(v, f"ops[{k}]", where, positive=False) for k, v in ops_doc.items()}
        return cls(
            name=name,
            device=device,
            peak_flops=peak_flops,
            memory_bandwidth=_number(doc.get("memory_bandwidth"), "memory_bandwidth", where, positive=True),
            launch_overhead=_number(doc.get("launch_overhead"), "launch_overhead", where, positive=False),
            host_bandwidth=_number(doc.get("host_bandwidth"), "host_bandwidth", where, positive=True),
            host_latency=_number(doc.get("host_latency"), "host_latency", where, positive=False),
            ops=ops,
            source=where,
        )

    def to_dict(self) -> dict[str, Any]:
        """The profile as a version-1 JSON document (``from_dict`` reads it back)."""
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": self.name,
            "device": self.device,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "launch_overhead": self.launch_overhead,
            "host_bandwidth": self.host_bandwidth,
            "host_latency": self.host_latency,
            "ops": dict(self.ops),
        }

    def with_ops(self, ops: Mapping[str, float], *, name: str | None = None) -> DeviceProfile:
        """A copy whose ``ops`` table also holds ``ops`` (which win over existing entries).

        Args:
            ops: op signature -> seconds (e.g. from :func:`checkmate.timing.measure_ops`).
            name: a new name for the copy (default: keep the name).
        """
        bad = {k: v for k, v in ops.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ProfileError(f"op times must be non-negative finite seconds; got {bad}")
        merged = {**self.ops, **{str(k): float(v) for k, v in ops.items()}}
        return dataclasses.replace(self, ops=merged, name=name or self.name, source=None)

    def fingerprint(self) -> str:
        """sha256 of the numbers (plans made with other numbers are not reused)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def peak(self, dtype: str, matmul: bool) -> float:
        """FLOP/s for an op on ``dtype``: the dtype's peak for matmul-like ops, else float32's."""
        if matmul:
            return self.peak_flops.get(dtype, self.peak_flops["float32"])
        return self.peak_flops["float32"]

    def estimate(self, node: torch.fx.Node) -> float:
        """Seconds ``node`` takes on this device: the ``ops`` table, else the roofline.

        Args:
            node: an fx node of a functionalized aten graph with ``meta['val']``.

        Returns:
            0.0 for views, ``getitem`` and non-op nodes; otherwise a positive estimate.
        """
        from checkmate.flops import op_cost_terms
        from checkmate.timing import is_free, op_signature

        if is_free(node):
            return 0.0
        if self.ops:
            measured = self.ops.get(op_signature(node))
            if measured is not None:
                return measured
        terms = op_cost_terms(node)
        if terms is None:
            return self.launch_overhead
        compute = terms.flops / self.peak(terms.dtype, terms.matmul)
        memory = terms.bytes / self.memory_bandwidth
        return max(compute, memory) + self.launch_overhead


def _string(doc: Mapping[str, Any], key: str, where: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value:
        raise ProfileError(f"{where}: field {key!r} must be a non-empty string, got {value!r}")
    return value


def _number(value: Any, key: str, where: str, *, positive: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > 0 if positive else value >= 0):
        return float(value)
    need = "a positive" if positive else "a non-negative"
    raise ProfileError(f"{where}: field '{key}' must be {need} finite number, got {value!r}")


def profiles_dir() -> Path:
    """The folder of the shipped profiles (``profiles/``; see :mod:`solvers.device_profiles`)."""
    return device_profiles.profiles_dir()


def available_profiles() -> list[str]:
    """Names of the shipped profiles (``"a100"``, ``"cpu"``, ``"h100"``, ...), sorted."""
    return device_profiles.available()


def load_profile(spec: str | Path | DeviceProfile) -> DeviceProfile:
    """A device profile from a shipped name, a JSON file, or a DeviceProfile (returned as is).

    Args:
        spec: ``"h100"``, ``"a100"``, ``"cpu"`` (see :func:`available_profiles`), or a path to
            a profile JSON file, or a DeviceProfile.

    Returns:
        The validated profile.

    Raises:
        ProfileError: the name is unknown (the message lists the shipped ones), the file
            cannot be read or parsed, or a field is missing or malformed (named).
    """
    if isinstance(spec, DeviceProfile):
        return spec
    try:
        path, doc = device_profiles.load_document(spec, error=ProfileError)
    except ProfileError as exc:
        if str(exc).startswith("unknown device profile"):
            raise ProfileError(f"{exc}, or profile=None to measure") from None
        raise
    return DeviceProfile.from_dict(doc, where=str(path))


def save_profile(profile: DeviceProfile, path: str | Path) -> Path:
    """Write ``profile`` as version-1 JSON (atomically); :func:`load_profile` reads it back.

    Returns:
        The path written.
    """
    out = Path(path).expanduser()
    atomic_write_text(out, json.dumps(profile.to_dict(), indent=2, sort_keys=False) + "\n")
    return out


def measured_profile(
    gm: torch.fx.GraphModule,
    nodes: Sequence[torch.fx.Node],
    *,
    device: torch.device | str,
    base: str | Path | DeviceProfile,
    name: str | None = None,
) -> DeviceProfile:
    """``base`` plus the measured times of the ops of ``nodes`` on ``device``.

    Measure once on the machine that will train, save the result with :func:`save_profile`,
    and plan with it anywhere: ops of the graph take their measured times, other ops the
    roofline of ``base``.

    Args:
        gm: the graph module the nodes belong to.
        nodes: fx nodes of a functionalized aten graph with ``meta['val']``.
        device: the device to measure on.
        base: the roofline numbers for ops not measured (a profile name, path or object).
        name: the new profile's name (default: ``base``'s).

    Raises:
        ProfileError: ``base`` is unknown or malformed.
    """
    from checkmate.timing import measure_ops

    prof = load_profile(base)
    return prof.with_ops(measure_ops(gm, nodes, device=device), name=name)


def profile_id(profile: str | Path | DeviceProfile | None, device: torch.device | str) -> str:
    """A string that changes whenever the costs would: for plan-cache keys.

    Args:
        profile: as for :func:`profile_costs`.
        device: the device measured on when ``profile`` is None.
    """
    if profile is None:
        from checkmate.timing import device_tag

        return "measured:" + device_tag(device)
    prof = load_profile(profile)
    return f"profile:{prof.name}:{prof.fingerprint()[:16]}"


def profile_costs(
    gm: torch.fx.GraphModule,
    nodes: Sequence[torch.fx.Node],
    *,
    profile: str | Path | DeviceProfile | None,
    device: torch.device | str,
) -> list[float]:
    """Runtime in seconds of each node of a joint (functionalized, aten-level) graph.

    Args:
        gm: the graph module the nodes belong to (``get_attr`` constants are read from it).
        nodes: fx nodes whose ``meta['val']`` holds FakeTensors (or tuples/lists of them).
        profile: None to run and time every op on ``device`` (results cached by op
            signature, see :mod:`checkmate.timing`); a shipped profile name, a path to a
            profile JSON file, or a DeviceProfile to estimate instead.
        device: the device to measure on (ignored when a profile is given).

    Returns:
        One cost per node, in order; 0.0 for views, ``getitem`` and placeholders.

    Raises:
        ProfileError: the profile is unknown or malformed.

    Example:
        >>> costs = profile_costs(gm, list(gm.graph.nodes), profile="h100", device="cpu")  # doctest: +SKIP
    """
    if profile is None:
        from checkmate.timing import measure_costs

        return measure_costs(gm, nodes, device=device)
    prof = load_profile(profile)
    return [prof.estimate(node) for node in nodes]
