"""Plan cache: solve a graph once, reuse the plan file in every later run.

A plan is stored as ``<key>.json`` (the versioned JSON of :mod:`solvers.plan`, never a
pickle) where ``key`` is the sha256 of everything a plan's validity or optimality depends
on: the graph (ids, edges, sizes, flags, node names and ops), its costs, the device
profile id, the budget in bytes, the strategy and its options, the plan-format version
and the planner's revision (the library version and a digest of the planner's source: a
newer planner plans again, released or not). Location:
``$CHECKMATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/checkmate``, else ``~/.cache/checkmate``;
``CHECKMATE_CACHE=0`` turns the cache off.

A plan file the user names (``plan_path=``, ``optimize(..., plan=)``) is theirs: checkmate
reads it and never changes what is in it. When it does not exist it is created as a plan
set (:data:`solvers.plan.PLAN_SET_FORMAT`, one entry per graph and budget), and a plan set
gains an entry for a graph or budget it has none for, so that a model with graph breaks
keeps all its plans in one file and a later process reuses every one. A plan in it is used
when it was made for this graph, budget, strategy, options and profile (the costs may have
been measured again) and the simulator accepts it. A file that is unreadable, a single plan
(``checkmate solve -o``) for something else, or an entry that is rejected (stale,
hand-edited, failing the replay) is left byte for byte as it was: a
:class:`PlanCacheWarning` says why, and the new plan goes to the cache (or nowhere when the
cache is off).

A plan found on disk is trusted only after the simulator replays it against the graph at
hand within the budget (:func:`solvers.schedule.validate`). A plan made for another graph,
a truncated or hand-edited file (its checksum no longer matches) or an unknown format
version is rejected with a warning that says why, and the graph is planned again: a bad
file never crashes a run and is never applied. Writes go to a temporary file renamed into
place, so processes planning the same graph at once never leave a torn file.

Beside the plans, ``least_peak/<graph fingerprint>.json`` records the least peak a search
found for a graph whose budget had no plan (:func:`remember_least_peak`): the minimum an
:class:`~solvers.errors.InfeasibleBudgetError` named. A later process retrying at that
minimum reads it (:func:`recall_least_peak`) to search briefly where it plans the graph
with room left beside it, below that peak. It is a hint, never a plan: a stale or broken
record only changes how long such a search runs.

A request without a plan (proven infeasible, or none found in the time limit) is remembered
in the process (:data:`_INFEASIBLE`), keyed like a plan: asked again with no longer a time
limit, the same error is raised, or the same result returned, at once. A loop
that catches the error and goes on (a batch skipped, a shape the budget cannot hold) asked
the same search again at every such call: 18 s a call for a two-layer transformer at 0.3
of its keep-all peak.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from checkmate.timers import stage
from solvers import Graph, SolveResult, solve
from solvers.api import resolve_budget
from solvers.budget import Budget, BudgetSpec, format_bytes, parse_budget
from solvers.errors import CheckmateError, InfeasibleBudgetError, PlanError
from solvers.plan import (
    PLAN_VERSION,
    Plan,
    atomic_write_text,
    cost_fingerprint,
    document_checksum,
    graph_fingerprint,
    plan_from_dict,
    plan_set_document,
    plan_to_dict,
    planner_revision,
    read_plan,
    read_plan_entries,
    write_plan,
)
from solvers.result import ProgressFn, Status
from solvers.schedule import validate

__all__ = [
    "cached_solve",
    "cache_dir",
    "cache_enabled",
    "cache_key",
    "key_parts",
    "recall_least_peak",
    "remember_least_peak",
    "PlanCacheWarning",
]


class PlanCacheWarning(UserWarning):
    """A plan file on disk was rejected (and the graph re-planned) or could not be written."""


def cache_enabled() -> bool:
    """False when ``CHECKMATE_CACHE`` is ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get("CHECKMATE_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """The cache folder: ``$CHECKMATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/checkmate``, else
    ``~/.cache/checkmate`` (not created here)."""
    explicit = os.environ.get("CHECKMATE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "checkmate"


def key_parts(
    graph: Graph,
    budget_bytes: int,
    strategy: str,
    options: Mapping[str, Any] | None = None,
    profile_id: str = "",
    boundary: int | None = None,
) -> dict[str, Any]:
    """What the cache key hashes, by name (stored in each plan so a mismatch can be named);
    ``boundary`` (:attr:`solvers.budget.Budget.boundary`) only when set, so that the keys
    of plans without one stay as they were."""
    names = hashlib.sha256(repr([(nd.name, nd.op) for nd in graph.nodes]).encode()).hexdigest()
    bound = {} if boundary is None else {"boundary_bytes": int(boundary)}
    return bound | {
        "graph": graph_fingerprint(graph),
        "names": names,
        "costs": cost_fingerprint(graph),
        "profile": str(profile_id),
        "budget_bytes": int(budget_bytes),
        "strategy": str(strategy),
        # default=repr: an option that is not JSON still enters the key (conservatively).
        "options": json.dumps(dict(options or {}), sort_keys=True, default=repr),
        "version": PLAN_VERSION,
        # a newer planner may plan better: its plans are not shadowed by an older one's
        "planner": planner_revision(),
    }


def cache_key(
    graph: Graph,
    budget_bytes: int,
    strategy: str,
    options: Mapping[str, Any] | None = None,
    profile_id: str = "",
    boundary: int | None = None,
) -> str:
    """The sha256 hex digest naming the plan for these inputs (see :func:`key_parts`)."""
    return _digest(key_parts(graph, budget_bytes, strategy, options, profile_id, boundary))


def _digest(parts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cached_solve(
    graph: Graph,
    budget: BudgetSpec,
    strategy: str = "auto",
    *,
    time_limit: float | None = None,
    options: dict[str, Any] | None = None,
    profile_id: str = "",
    plan_path: str | os.PathLike[str] | None = None,
    progress: ProgressFn | None = None,
) -> SolveResult:
    """Solve ``graph`` under ``budget``, reusing a cached plan when one matches.

    A cached plan with status ``feasible`` (optimality not proven) is reused only when the
    time limit asked for is no larger than the one it was solved with; otherwise the
    search runs again with the new limit. A pinned file without a cache key (written by
    ``checkmate solve``) is used when it was made for this graph and fits the budget,
    whatever strategy made it: that is what pinning a plan solved offline means.

    Args:
        graph: the (profiled) graph to plan.
        budget: a :class:`~solvers.budget.Budget` (or a spec ``solvers.parse_budget``
            reads); one that carries its graph's keep-all peak (``Budget.for_graph``) spares
            simulating it.
        strategy: strategy name.
        time_limit: seconds for searching strategies (not part of the key; see above).
        options: strategy options (part of the cache key).
        profile_id: identifies the device profile the costs came from (part of the key).
        plan_path: the user's plan file, read first and never changed (see the module
            docstring: created, or added to when it is a plan set, even when the cache is
            disabled; a rejected plan goes to the cache instead).
        progress: passed to the strategy as ``progress=`` (not part of the key).

    Returns:
        The :class:`SolveResult`; on a hit ``info["cache"] == "hit"``, ``info["plan_path"]``
        names the file, and ``solve_seconds`` is the time spent loading and re-validating it.

    Raises:
        BudgetError: the budget cannot be parsed.
        InfeasibleBudgetError: no schedule fits the budget (nothing is cached).
    """
    opts = dict(options or {})
    spec = parse_budget(budget)
    if spec.least:  # the budget "min" is keyed as -1 bytes: its plan is valid at the peak it was made for
        budget_bytes, resolved = -1, spec
    else:  # resolved once, carrying the keep-all peak: solve() does not simulate it again
        budget_bytes, ref = resolve_budget(graph, spec)
        resolved = Budget(nbytes=budget_bytes, reference=ref, boundary=spec.boundary)
    parts = key_parts(graph, budget_bytes, strategy, opts, profile_id, spec.boundary)
    key = _digest(parts)
    cached = cache_dir() / f"{key}.json" if cache_enabled() else None
    path: Path | None = cached
    pinned = Path(plan_path) if plan_path is not None else None
    if pinned is not None:
        hit, may_add = _from_pinned(pinned, graph, budget_bytes, key, parts, spec.boundary)
        if hit is not None:
            return hit
        if may_add:
            path = pinned

    if path is not None and path != pinned and path.exists():
        hit = _load(path, graph, budget_bytes, key, parts, time_limit, spec.boundary)
        if hit is not None:
            return hit

    seen = _INFEASIBLE.get(key)
    if seen is not None and _within(time_limit, seen[0]):
        if isinstance(seen[1], SolveResult):
            return dataclasses.replace(seen[1], info={**seen[1].info, "cache": "infeasible before"})
        again = copy.copy(seen[1])  # the callers add their notes to the copy
        again.add_note(
            "(found infeasible earlier in this process for the same graph and budget: not searched again)"
        )
        raise again
    if progress is not None:
        opts["progress"] = progress
    try:
        res = solve(graph, resolved, strategy, time_limit=time_limit, **opts)
    except InfeasibleBudgetError as exc:
        _remember_infeasible(key, time_limit, copy.copy(exc))
        raise
    if not res.ok or res.schedule is None:  # none found within the time limit: searched once too
        _remember_infeasible(key, time_limit, res)
    if path is not None and res.ok:
        doc = plan_to_dict(
            graph, res, cache_key=key, key_parts=parts, profile_id=str(profile_id), time_limit=time_limit
        )
        try:
            if path == pinned:
                _add_to_plan_set(path, doc)
            else:
                write_plan(path, doc)
        except (OSError, PlanError) as exc:
            warnings.warn(
                f"could not write plan file {path}: {exc}; the plan is used but not cached",
                PlanCacheWarning,
                stacklevel=2,
            )
        else:
            res = dataclasses.replace(res, info={**res.info, "cache": "miss", "plan_path": str(path)})
    return res


#: requests without a plan in this process: cache key -> (the time limit searched, the error
#: raised or the result without a schedule returned)
_INFEASIBLE: dict[str, tuple[float | None, InfeasibleBudgetError | SolveResult]] = {}
#: the most remembered (the oldest go first)
_INFEASIBLE_MAX = 256


def _remember_infeasible(
    key: str, time_limit: float | None, outcome: InfeasibleBudgetError | SolveResult
) -> None:
    """Remember ``outcome`` for ``key`` (searched with ``time_limit``), forgetting the oldest."""
    _INFEASIBLE[key] = (time_limit, outcome)
    while len(_INFEASIBLE) > _INFEASIBLE_MAX:
        del _INFEASIBLE[next(iter(_INFEASIBLE))]


def _within(time_limit: float | None, searched: float | None) -> bool:
    """Whether a search with ``time_limit`` would search no longer than one with ``searched``
    (None: the strategy's default, comparable only with itself)."""
    if time_limit is None or searched is None:
        return time_limit == searched
    return time_limit <= searched


#: key parts a plan in the user's file may differ in and still be used: costs measured
#: again on another run, and the release that made it
_PIN_MAY_DIFFER = ("costs", "planner")


def _from_pinned(
    path: Path, graph: Graph, budget_bytes: int, key: str, parts: Mapping[str, Any], boundary: int | None
) -> tuple[SolveResult | None, bool]:
    """(a plan from the user's file ``path``, or None; whether a new plan may be added to it).

    A file that does not exist may be created; a plan set may gain an entry when it has
    none for this graph and request. Anything else rejected leaves the file as it is."""
    if not path.exists():
        return None, True
    try:
        entries, is_set = read_plan_entries(path)
    except PlanError as exc:
        _warn_pinned(path, str(exc))
        return None, False
    wanted = {k: v for k, v in parts.items() if k not in _PIN_MAY_DIFFER}
    fp = graph_fingerprint(graph)
    reasons: list[str] = []
    for entry in entries:
        if is_set:
            if not isinstance(entry, dict) or entry.get("graph_fingerprint") != fp:
                continue  # another graph's entry
            stored = entry.get("key_parts")
            if not isinstance(stored, dict) or any(stored.get(k) != v for k, v in wanted.items()):
                continue  # the same graph at another budget (or strategy, options, profile)
        try:
            plan = plan_from_dict(entry, graph, path=path)
            hit = _hit(path, plan, graph, budget_bytes, key, parts, ignore=_PIN_MAY_DIFFER, boundary=boundary)
            return hit, False
        except (CheckmateError, ValueError, KeyError, TypeError) as exc:
            reasons.append(str(exc))
    if is_set and not reasons:
        return None, True  # a plan set without an entry for this request: add one
    _warn_pinned(path, "; ".join(reasons) or "no plan in it")
    return None, False


def _warn_pinned(path: Path, why: str) -> None:
    where = f"the plan cache ({cache_dir()})" if cache_enabled() else "no file (the cache is off)"
    warnings.warn(
        f"plan file {path} not used: {why}. It is left as it is; the new plan goes to {where}",
        PlanCacheWarning,
        stacklevel=4,
    )


def _add_to_plan_set(path: Path, doc: Mapping[str, Any]) -> None:
    """Add the plan ``doc`` to the plan set at ``path`` (created if missing), changing no
    entry already there. The file is read again right before the write, so entries that
    another process added meanwhile are kept (a write in between can still be lost)."""
    entries: list[Any] = []
    if path.exists():
        entries, is_set = read_plan_entries(path)
        if not is_set:
            raise PlanError(f"{path}: became a single plan meanwhile; it is not changed")
    sealed = {**doc, "checksum": document_checksum(doc)}
    atomic_write_text(path, json.dumps(plan_set_document([*entries, sealed]), indent=1))


def _load(
    path: Path,
    graph: Graph,
    budget_bytes: int,
    key: str,
    parts: Mapping[str, Any],
    time_limit: float | None,
    boundary: int | None,
) -> SolveResult | None:
    """The cached result stored in ``path`` if it is sound for these inputs; else warn and None."""
    try:
        plan = read_plan(path, graph)
        doc = plan.doc
        if doc.get("cache_key") is None or "checksum" not in doc:
            raise PlanError(f"{path}: plan lacks its cache key or checksum (written by hand?)")
        res = _hit(path, plan, graph, budget_bytes, key, parts, boundary=boundary)
    except (CheckmateError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"rejected plan file, re-planning: {exc}", PlanCacheWarning, stacklevel=3)
        return None
    if res.status == Status.FEASIBLE and _longer(time_limit, doc.get("time_limit")):
        return None  # a longer search was asked for than the one that produced this plan
    return res


def _hit(
    path: Path,
    plan: Plan,
    graph: Graph,
    budget_bytes: int,
    key: str,
    parts: Mapping[str, Any],
    ignore: tuple[str, ...] = (),
    boundary: int | None = None,
) -> SolveResult:
    """The result of a plan read from ``path``, checked against this request's key parts
    (but those in ``ignore``) and replayed by the simulator within the budget (and holding
    at most ``boundary`` bytes at its forward/backward boundary, when given).

    Raises:
        PlanError, SimulationError: the plan is not for this request or does not replay.
    """
    start = time.perf_counter()
    doc = plan.doc
    stored_key = doc.get("cache_key")
    if stored_key is not None and stored_key != key:
        stored = doc.get("key_parts")
        differs = [k for k in parts if stored.get(k) != parts[k]] if isinstance(stored, dict) else ["key"]
        differs = [k for k in differs if k not in ignore]
        if differs or not isinstance(stored, dict):
            raise PlanError(f"{path}: plan was made for a different {', '.join(differs) or 'key'}")
    status = Status(str(doc["status"]))
    if status not in (Status.OPTIMAL, Status.FEASIBLE):
        raise PlanError(f"{path}: plan has status {status}, not a usable schedule")
    if budget_bytes < 0:  # the budget "min": the least peak, as planned
        budget_bytes = int(plan.doc["budget_bytes"])
    with stage("validate"):  # the replay a cache hit costs (benchmarks count them)
        sim = validate(graph, plan.schedule, budget_bytes)
    if boundary is not None and sim.boundary > boundary:
        raise PlanError(
            f"{path}: plan holds {format_bytes(sim.boundary)} at its forward/backward boundary, over the "
            f"{format_bytes(boundary)} asked"
        )
    lower = doc.get("lower_bound")
    info = dict(doc.get("info") or {})
    info.update(
        cache="hit",
        plan_path=str(path),
        planned_solve_seconds=doc.get("solve_seconds"),
        planned_build_seconds=doc.get("build_seconds"),
    )
    return SolveResult(
        strategy=str(doc["strategy"]),
        status=status,
        budget=budget_bytes,
        schedule=plan.schedule,
        cost=sim.cost,
        peak=sim.peak,
        lower_bound=None if lower is None else float(lower),
        build_seconds=0.0,
        solve_seconds=time.perf_counter() - start,
        info=info,
    )


def _longer(asked: float | None, planned: Any) -> bool:
    """True when the time limit ``asked`` exceeds ``planned`` (None = unlimited)."""
    if asked is None:
        return planned is not None
    return planned is not None and float(asked) > float(planned)


#: the format of a least-peak record (:func:`remember_least_peak`)
LEAST_PEAK_FORMAT = "checkmate-least-peak"


def _least_peak_path(fingerprint: str) -> Path:
    return cache_dir() / "least_peak" / f"{fingerprint}.json"


def remember_least_peak(graph: Graph, peak: int) -> None:
    """Record ``peak``, the least peak a search found for ``graph`` (its structure and
    sizes), for later processes (:func:`recall_least_peak`); a lower record stands. Nothing
    is written when the cache is off; a write that fails is skipped (it is a hint)."""
    if not cache_enabled():
        return
    fingerprint = graph_fingerprint(graph)
    known = _recalled(fingerprint)
    if known is not None and known <= peak:
        return
    # the planner's revision: a newer planner may find lower peaks
    doc = {
        "format": LEAST_PEAK_FORMAT,
        "graph": fingerprint,
        "peak": int(peak),
        "planner": planner_revision(),
    }
    try:
        atomic_write_text(_least_peak_path(fingerprint), json.dumps(doc, sort_keys=True))
    except OSError:
        return


def recall_least_peak(graph: Graph) -> int | None:
    """The least peak an earlier process recorded for ``graph`` (:func:`remember_least_peak`),
    or None: none recorded, the cache off, or a record that does not read as one made for
    this graph by this planner."""
    return _recalled(graph_fingerprint(graph)) if cache_enabled() else None


def _recalled(fingerprint: str) -> int | None:
    """:func:`recall_least_peak` of the graph whose fingerprint is ``fingerprint``."""
    try:
        doc = json.loads(_least_peak_path(fingerprint).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != LEAST_PEAK_FORMAT:
        return None
    if doc.get("graph") != fingerprint or doc.get("planner") != planner_revision():
        return None
    peak = doc.get("peak")
    return peak if isinstance(peak, int) and not isinstance(peak, bool) and peak > 0 else None
