"""Plan files: versioned JSON, never pickle; written atomically.

The public contract (version 1; later versions extend it, never break it)::

    {"format": "checkmate-plan", "version": 1, "strategy": str, "status": str,
     "budget_bytes": int, "cost": float, "lower_bound": float | null,
     "peak_memory": int, "solve_seconds": float,
     "schedule": [["compute", node_id] | ["free", node_id], ...]}

Paging plans (POET) also hold ``["pageout", node_id]`` and ``["pagein", node_id]`` steps.

Node ids are the graph's external ids (``Node.ext``): the ``id`` field of the Checkmate
graphs, the ``name`` of the random layered ones. Extra fields (all optional for readers):
``graph_fingerprint`` (sha256 of the graph's structure and sizes), ``cost_fingerprint``,
``graph_name``, ``n_nodes``, ``total_cost``, ``reference_peak``, ``build_seconds``, ``info``,
``library_version``, ``overhead`` (cost / total_cost), ``recomputes`` (compute steps beyond
the first of each node), ``decisions`` (one entry per node: ``{"id", "name", "computes",
"checkpoint"}``; ``checkpoint`` = the output is kept across a stage boundary), ``stages``
(``{"R": [[node_id, ...] per stage], "S": [...]}`` when the strategy had Checkmate's (R, S)
matrices), ``profile_id`` (the device profile the costs came from), ``time_limit`` (of the
search that made it), ``cache_key`` and ``key_parts`` (written by the plan cache,
:mod:`checkmate.cache`), and ``checksum`` (``"sha256:<hex>"`` of the canonical JSON of every
other field, added by :func:`write_plan`: a file edited by hand no longer matches and is
rejected).

A *plan set* holds several plans in one file, one entry per graph (``checkmate.optimize(...,
plan="p.json")`` writes one when Dynamo splits a step into several graphs)::

    {"format": "checkmate-plans", "version": 1, "plans": [<plan document>, ...]}

Each entry is a whole plan document with its own checksum. :func:`read_plan` picks the
entry made for the graph it is given; :func:`read_plan_document` takes a set of one entry,
or the entry for ``graph``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from solvers.errors import PlanError
from solvers.graph import Graph
from solvers.plan_schema import PLAN_FORMAT, PLAN_VERSION, check_document, document_checksum, load_json, short
from solvers.result import SolveResult
from solvers.schedule import COMPUTE, FREE, PAGEIN, Schedule, Step

__all__ = [
    "planner_revision",
    "source_digest",
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "PLAN_SET_FORMAT",
    "read_plan_entries",
    "plan_set_document",
    "is_plan_set",
    "Plan",
    "plan_to_dict",
    "write_plan",
    "read_plan",
    "graph_fingerprint",
    "cost_fingerprint",
    "atomic_write_text",
    "plan_from_dict",
    "read_plan_document",
    "document_checksum",
    "stage_matrices",
    "checkpointed",
]

BoolMatrix = npt.NDArray[np.bool_]

PLAN_SET_FORMAT = "checkmate-plans"
PLAN_SET_VERSION = 1


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
    """sha256 over the node costs and, where there are any, the save costs (what a
    schedule's optimality depends on; a graph without save costs hashes as before them)."""
    data = graph.cost.tobytes()
    if graph.save_cost.any():
        data += graph.save_cost.tobytes()
    return hashlib.sha256(data).hexdigest()


@functools.cache
def planner_revision() -> str:
    """The library version and a digest of the planner's source (this package's modules).

    The plan cache keys plans by it (:mod:`checkmate.cache`), so that a plan made by an
    older planner is planned again by a newer one, released or not: the version alone did
    not change when a strategy did, and a cached plan shadowed the better one for good.
    """
    from solvers import __version__

    try:
        digest = source_digest(Path(__file__).resolve().parent)
    except OSError:  # installed without readable sources: the version alone
        return __version__
    return f"{__version__}+{digest[:16]}"


def source_digest(root: Path) -> str:
    """sha256 of the ``*.py`` files under ``root``: their paths and contents, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def plan_to_dict(graph: Graph, result: SolveResult, **extra: Any) -> dict[str, Any]:
    """The plan document for ``result`` (which must carry a schedule)."""
    if result.schedule is None:
        raise PlanError(
            f"strategy {result.strategy!r} produced no schedule ({result.status}); nothing to write"
        )
    ext = graph.ext_ids()
    from solvers import __version__

    counts = result.schedule.compute_counts(graph.n)
    held = checkpointed(graph, result.schedule)
    cost = float(result.cost) if result.cost is not None else None
    total = graph.total_cost
    doc: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "strategy": result.strategy,
        "status": str(result.status),
        "budget_bytes": int(result.budget),
        "cost": cost,
        "lower_bound": None if result.lower_bound is None else float(result.lower_bound),
        "peak_memory": int(result.peak) if result.peak is not None else None,
        "solve_seconds": float(result.solve_seconds),
        "build_seconds": float(result.build_seconds),
        "total_cost": total,
        "overhead": cost / total if cost is not None and total > 0 else None,
        "recomputes": int(np.maximum(counts - 1, 0).sum()),
        "reference_peak": result.info.get("reference"),
        "graph_name": graph.name,
        "n_nodes": graph.n,
        "graph_fingerprint": graph_fingerprint(graph),
        "cost_fingerprint": cost_fingerprint(graph),
        "library_version": __version__,
        "info": _jsonable(result.info),
        "decisions": [
            {"id": nd.ext, "name": nd.name, "computes": int(counts[nd.id]), "checkpoint": bool(held[nd.id])}
            for nd in graph.nodes
        ],
        "schedule": [[op, ext[i]] for op, i in result.schedule.steps],
    }
    if result.schedule.R is not None and result.schedule.S is not None:
        doc["stages"] = {
            "R": [[ext[i] for i in np.flatnonzero(row)] for row in result.schedule.R],
            "S": [[ext[i] for i in np.flatnonzero(row)] for row in result.schedule.S],
        }
    doc.update(extra)
    return doc


def write_plan(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> Path:
    """Write a plan document atomically (temporary file + rename), sealed with a checksum.

    Args:
        path: the file to write; its folder is created if needed.
        doc: a plan document (see :func:`plan_to_dict`); a ``checksum`` field is added.

    Returns:
        The path written.

    Raises:
        OSError: the file cannot be written (nothing is left behind).
    """
    p = Path(path)
    sealed = {**doc, "checksum": document_checksum(doc)}
    atomic_write_text(p, json.dumps(sealed, indent=1))
    return p


def read_plan(path: str | os.PathLike[str], graph: Graph | None = None) -> Plan:
    """Read a plan file; with ``graph``, map its node ids and check the fingerprint.

    Raises:
        PlanError: unreadable (not JSON text, nested too deeply), truncated, not a plan,
            unknown version, a field of the wrong type (see ``_FIELD_KINDS``), a malformed
            schedule step, or made for another graph. No other exception escapes.
    """
    p = Path(path)
    return plan_from_dict(_pick(load_json(p), graph, f"{p}: "), graph, path=p)


def read_plan_document(path: str | os.PathLike[str], graph: Graph | None = None) -> dict[str, Any]:
    """Read and check a plan file (node ids stay as written); of a plan set, the entry for
    ``graph`` (or its only entry).

    Raises:
        PlanError: unreadable, truncated, not a plan, unknown version, a field of the
            wrong type, a malformed schedule step, or edited by hand; a plan set with no
            entry for ``graph``, or several entries and no graph.
    """
    p = Path(path)
    doc = _pick(load_json(p), graph, f"{p}: ")
    check_document(doc, f"{p}: ")
    return dict(doc)


def read_plan_entries(path: str | os.PathLike[str]) -> tuple[list[Any], bool]:
    """The documents in a plan file, unchecked, and whether it is a plan set (else a file
    of one plan, or of something else, which :func:`plan_from_dict` rejects).

    Raises:
        PlanError: unreadable or not JSON; a plan set of an unknown version or without a list.
    """
    p = Path(path)
    doc = load_json(p)
    if not is_plan_set(doc):
        return [doc], False
    return _set_entries(doc, f"{p}: "), True


def is_plan_set(doc: Any) -> bool:
    """True for a plan set document (see the module docstring)."""
    return isinstance(doc, dict) and doc.get("format") == PLAN_SET_FORMAT


def plan_set_document(entries: list[Mapping[str, Any]]) -> dict[str, Any]:
    """A plan set of ``entries`` (plan documents already sealed with their checksum)."""
    return {"format": PLAN_SET_FORMAT, "version": PLAN_SET_VERSION, "plans": [dict(e) for e in entries]}


def _set_entries(doc: Mapping[str, Any], where: str) -> list[Any]:
    version = doc.get("version")
    if isinstance(version, bool) or version != PLAN_SET_VERSION:
        raise PlanError(
            f"{where}plan set version {short(version)} is not supported (this checkmate reads {PLAN_SET_VERSION})"
        )
    plans = doc.get("plans")
    if not isinstance(plans, list):
        raise PlanError(f"{where}plan set lacks its list of 'plans'")
    return plans


def _pick(doc: Any, graph: Graph | None, where: str) -> Any:
    """``doc`` itself, or of a plan set the entry for ``graph`` (its only entry without one)."""
    if not is_plan_set(doc):
        return doc
    entries = _set_entries(doc, where)
    if graph is None:
        if len(entries) == 1:
            return entries[0]
        raise PlanError(
            f"{where}a plan set of {len(entries)} plans, one per graph (written by optimize(plan=...)): "
            "give the graph to pick one (checkmate show FILE -g GRAPH)"
        )
    fp = graph_fingerprint(graph)
    for entry in entries:
        if isinstance(entry, dict) and entry.get("graph_fingerprint") == fp:
            return entry
    raise PlanError(
        f"{where}plan set of {len(entries)} plans holds none for this graph (fingerprint mismatch)"
    )


def plan_from_dict(doc: Any, graph: Graph | None = None, *, path: Path | None = None) -> Plan:
    """Check a parsed plan document (see :func:`read_plan`)."""
    where = f"{path}: " if path else ""
    check_document(doc, where)
    raw = doc["schedule"]
    if graph is not None:
        fp = doc.get("graph_fingerprint")
        if fp is not None and fp != graph_fingerprint(graph):
            raise PlanError(f"{where}plan was made for another graph (fingerprint mismatch)")
    steps: list[Step] = []
    for k, step in enumerate(raw):  # each step was checked to be [op, str | int]
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
    R = S = None
    stages = doc.get("stages")
    if graph is not None and isinstance(stages, dict):
        R = _stage_rows(stages.get("R"), graph, where)
        S = _stage_rows(stages.get("S"), graph, where)
        if R is None or S is None or R.shape != S.shape:
            R = S = None
    return Plan(doc=doc, schedule=Schedule(tuple(steps), R=R, S=S), path=path)


def checkpointed(graph: Graph, schedule: Schedule) -> BoolMatrix:
    """Per node: is its output resident at the start of some stage (a column of the S of
    :func:`stage_matrices` that is not all false)? In O(nodes + steps) memory and time,
    without the (T, n) matrices (a 400,000-node chain would need 160 GB of them)."""
    n = graph.n
    held = np.zeros(n, dtype=bool)
    if schedule.S is not None:
        S = np.asarray(schedule.S, dtype=bool)
        if S.size:
            held |= S.any(axis=0)
        return held
    resident = np.zeros(n, dtype=bool)
    seen = np.zeros(n, dtype=bool)
    since = np.zeros(n, dtype=np.int64)  # stages begun when the value last became resident
    stages = 0
    in_stage = False
    for op, i in schedule.steps:
        if op == COMPUTE:
            if not in_stage:  # a stage begins: every resident value is in its row of S
                in_stage = True
                stages += 1
            if not resident[i]:
                resident[i], since[i] = True, stages
            if not seen[i]:
                seen[i] = True
                in_stage = False
        elif op == PAGEIN and not resident[i]:
            resident[i], since[i] = True, stages
        elif op == FREE and resident[i]:
            resident[i] = False
            held[i] |= stages > since[i]
    held |= resident & (stages > since)
    return held


def stage_matrices(graph: Graph, schedule: Schedule) -> tuple[BoolMatrix, BoolMatrix]:
    """The (R, S) matrices of ``schedule`` in the sense of Checkmate (Jain et al. 2020).

    Returns the schedule's own matrices when it has them. Otherwise stages are derived from
    the steps: stage t ends with the t-th compute of a node computed for the first time
    (for a frontier-advancing schedule, the first compute of node t); ``R[t, i]`` = node i
    is computed in stage t; ``S[t, i]`` = node i is resident right before the first compute
    of stage t.

    Returns:
        ``(R, S)``, two bool arrays of shape (T, n) (T = n for a schedule computing every node).
    """
    if schedule.R is not None and schedule.S is not None:
        return np.asarray(schedule.R, dtype=bool), np.asarray(schedule.S, dtype=bool)
    n = graph.n
    resident = np.zeros(n, dtype=bool)
    seen = np.zeros(n, dtype=bool)
    r_rows: list[list[int]] = []
    s_rows: list[BoolMatrix] = []
    cur: list[int] | None = None
    for op, i in schedule.steps:
        if op == COMPUTE:
            if cur is None:
                cur = []
                s_rows.append(resident.copy())
            cur.append(i)
            resident[i] = True
            if not seen[i]:
                seen[i] = True
                r_rows.append(cur)
                cur = None
        elif op == PAGEIN:  # a paged-in value is resident like a computed one
            resident[i] = True
        elif op == FREE:
            resident[i] = False
    if cur is not None:  # trailing recomputes without a new node: their own stage
        r_rows.append(cur)
    T = len(r_rows)
    R = np.zeros((T, n), dtype=bool)
    for t, row in enumerate(r_rows):
        R[t, row] = True
    S = np.array(s_rows, dtype=bool).reshape(T, n)
    return R, S


def _stage_rows(rows: Any, graph: Graph, where: str) -> BoolMatrix | None:
    if not isinstance(rows, list):
        return None
    M = np.zeros((len(rows), graph.n), dtype=bool)
    for t, row in enumerate(rows):
        if not isinstance(row, list):
            raise PlanError(f"{where}stage {t} of 'stages' is not a list")
        try:
            M[t, [graph.index_of(x) for x in row]] = True
        except Exception:
            raise PlanError(f"{where}stage {t} of 'stages' names a node not in the graph") from None
    return M


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; users expect their umask
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
