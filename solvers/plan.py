"""Plan files: versioned JSON, never pickle; written atomically.

The public contract (version 1; later versions extend it, never break it)::

    {"format": "checkmate-plan", "version": 1, "strategy": str, "status": str,
     "budget_bytes": int, "cost": float, "lower_bound": float | null,
     "peak_memory": int, "solve_seconds": float,
     "schedule": [["compute", node_id] | ["free", node_id], ...]}

Node ids are the graph's external ids (``Node.ext``): the ``id`` field of the Checkmate
graphs, the ``name`` of the random layered ones. Extra fields: ``graph_fingerprint``
(sha256 of the graph's structure and sizes), ``cost_fingerprint``, ``graph_name``,
``total_cost``, ``reference_peak``, ``build_seconds``, ``info``, ``library_version``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solvers.errors import PlanError
from solvers.graph import Graph
from solvers.result import SolveResult
from solvers.schedule import COMPUTE, FREE, Schedule, Step

__all__ = [
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "Plan",
    "plan_to_dict",
    "write_plan",
    "read_plan",
    "graph_fingerprint",
    "cost_fingerprint",
    "atomic_write_text",
]

PLAN_FORMAT = "checkmate-plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """A plan file as read back: the document and its schedule in internal ids."""

    doc: Mapping[str, Any]
    schedule: Schedule
    path: Path | None = field(default=None, compare=False)

    @property
    def strategy(self) -> str:
        return str(self.doc["strategy"])

    @property
    def budget_bytes(self) -> int:
        return int(self.doc["budget_bytes"])


def graph_fingerprint(graph: Graph) -> str:
    """sha256 over what a schedule's validity depends on: ids, edges, sizes, flags."""
    h = hashlib.sha256()
    h.update(repr([(nd.ext, nd.mem, nd.backward, nd.recomputable) for nd in graph.nodes]).encode())
    h.update(repr(graph.edges).encode())
    return h.hexdigest()


def cost_fingerprint(graph: Graph) -> str:
    """sha256 over the node costs (what a schedule's optimality depends on)."""
    return hashlib.sha256(graph.cost.tobytes()).hexdigest()


def plan_to_dict(graph: Graph, result: SolveResult, **extra: Any) -> dict[str, Any]:
    """The plan document for ``result`` (which must carry a schedule)."""
    if result.schedule is None:
        raise PlanError(
            f"strategy {result.strategy!r} produced no schedule ({result.status}); nothing to write"
        )
    ext = graph.ext_ids()
    from solvers import __version__

    doc: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "strategy": result.strategy,
        "status": str(result.status),
        "budget_bytes": int(result.budget),
        "cost": float(result.cost) if result.cost is not None else None,
        "lower_bound": None if result.lower_bound is None else float(result.lower_bound),
        "peak_memory": int(result.peak) if result.peak is not None else None,
        "solve_seconds": float(result.solve_seconds),
        "build_seconds": float(result.build_seconds),
        "total_cost": graph.total_cost,
        "reference_peak": result.info.get("reference"),
        "graph_name": graph.name,
        "graph_fingerprint": graph_fingerprint(graph),
        "cost_fingerprint": cost_fingerprint(graph),
        "library_version": __version__,
        "info": _jsonable(result.info),
        "schedule": [[op, ext[i]] for op, i in result.schedule.steps],
    }
    doc.update(extra)
    return doc


def write_plan(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> Path:
    """Write a plan document atomically (temporary file + rename)."""
    p = Path(path)
    atomic_write_text(p, json.dumps(doc, indent=1))
    return p


def read_plan(path: str | os.PathLike[str], graph: Graph | None = None) -> Plan:
    """Read a plan file; with ``graph``, map its node ids and check the fingerprint.

    Raises:
        PlanError: unreadable, truncated, not a plan, unknown version, or made for
            another graph.
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlanError(f"{p}: no such plan file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{p}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"{p}: not valid JSON (truncated or hand-edited?): {exc.msg} at line {exc.lineno}"
        ) from None
    return plan_from_dict(doc, graph, path=p)


def plan_from_dict(doc: Any, graph: Graph | None = None, *, path: Path | None = None) -> Plan:
    """Check a parsed plan document (see :func:`read_plan`)."""
    where = f"{path}: " if path else ""
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise PlanError(f'{where}not a checkmate plan (missing "format": "{PLAN_FORMAT}")')
    version = doc.get("version")
    if not isinstance(version, int) or version > PLAN_VERSION or version < 1:
        raise PlanError(
            f"{where}plan format version {version!r} is not supported (this checkmate reads {PLAN_VERSION})"
        )
    for key in ("strategy", "status", "budget_bytes", "schedule"):
        if key not in doc:
            raise PlanError(f"{where}plan lacks field {key!r}")
    raw = doc["schedule"]
    if not isinstance(raw, list):
        raise PlanError(f"{where}field 'schedule' must be a list")
    if graph is not None:
        fp = doc.get("graph_fingerprint")
        if fp is not None and fp != graph_fingerprint(graph):
            raise PlanError(f"{where}plan was made for another graph (fingerprint mismatch)")
    steps: list[Step] = []
    for k, step in enumerate(raw):
        if not (isinstance(step, list) and len(step) == 2 and step[0] in (COMPUTE, FREE)):
            raise PlanError(f"{where}schedule step {k} is malformed: {step!r}")
        node = step[1]
        if graph is not None:
            try:
                node = graph.index_of(node)
            except Exception:
                raise PlanError(
                    f"{where}schedule step {k} names node {step[1]!r}, not in the graph"
                ) from None
        elif not isinstance(node, int):
            raise PlanError(f"{where}schedule step {k}: node id {node!r} needs a graph to resolve")
        steps.append((step[0], int(node)))
    return Plan(doc=doc, schedule=Schedule(tuple(steps)), path=path)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
