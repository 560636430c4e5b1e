"""The plan cache: hits, misses, rejected files, concurrent writers, the off switch.

The strategy used here is a real (if simple) one registered for the tests: compute every
node once in id order, free each output after its last read. It counts its calls, so a
hit is seen to skip solving.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest

import checkmate.cache
from checkmate.cache import PlanCacheWarning, cache_dir, cache_key, cached_solve
from checkmate.timers import observe
from solvers import Budget, Graph, SolveResult, Status, solve, validate, write_plan
from solvers.boundary import boundary_hold
from solvers.errors import InfeasibleBudgetError, PlanError
from solvers.plan import PLAN_VERSION, document_checksum, plan_to_dict, read_plan, read_plan_document
from solvers.schedule import schedule_from_order, simulate
from solvers.strategies import STRATEGIES
from tests.graphs import chain

NAME = "test-keep-all"
CALLS: list[int] = []


def keep_all_counted(
    graph: Graph, budget: int, *, time_limit: float | None = None, claim: str = "optimal", **_: Any
) -> SolveResult:
    """Checkpoint-all as a strategy; ``claim`` sets the status it reports when it fits."""
    CALLS.append(graph.n)
    sched = schedule_from_order(graph, range(graph.n))
    sim = simulate(graph, sched)
    status = Status(claim) if sim.peak <= budget else Status.NO_SOLUTION
    return SolveResult(NAME, status, budget, sched, sim.cost, sim.peak, lower_bound=graph.total_cost)


def _register() -> None:
    STRATEGIES[NAME] = (f"{__name__}:keep_all_counted", "tests: checkpoint-all that counts its calls")


@pytest.fixture(autouse=True)
def _strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(STRATEGIES, NAME, (f"{__name__}:keep_all_counted", "tests"))
    monkeypatch.delenv("CHECKMATE_CACHE", raising=False)
    monkeypatch.setattr(checkmate.cache, "_INFEASIBLE", {}, raising=False)
    CALLS.clear()


def _graph(mem: int = 1) -> Graph:
    return chain(6, training=True, mem=mem)


def _files() -> list[Path]:
    return sorted(cache_dir().glob("*.json"))


def test_hit_skips_solving() -> None:
    g = _graph()
    first = cached_solve(g, 1.0, NAME, profile_id="cpu")
    assert first.info["cache"] == "miss" and len(CALLS) == 1
    assert len(_files()) == 1
    second = cached_solve(g, 1.0, NAME, profile_id="cpu")
    assert len(CALLS) == 1, "a hit must not run the strategy"
    assert second.info["cache"] == "hit"
    assert second.status == Status.OPTIMAL
    assert second.schedule is not None and first.schedule is not None
    assert second.schedule.steps == first.schedule.steps
    assert second.cost == first.cost and second.peak == first.peak
    assert second.lower_bound == first.lower_bound
    validate(g, second.schedule, second.budget)


def test_a_request_without_a_plan_is_searched_once_per_process_unless_given_longer() -> None:
    """A loop catching the error and going on asked the same search at every call (18 s a call
    for a two-layer transformer at 0.3 of its keep-all peak)."""
    g = _graph()
    first = cached_solve(g, 0.5, NAME, time_limit=5, profile_id="cpu")
    assert first.status == Status.NO_SOLUTION and len(CALLS) == 1
    again = cached_solve(g, 0.5, NAME, time_limit=5, profile_id="cpu")
    assert again.status == Status.NO_SOLUTION and again.peak == first.peak  # its attempt over the budget
    assert len(CALLS) == 1 and again.info["cache"] == "infeasible before"
    cached_solve(g, 0.5, NAME, time_limit=3, profile_id="cpu")  # no longer a search: not again
    assert len(CALLS) == 1
    cached_solve(g, 0.5, NAME, time_limit=20, profile_id="cpu")  # a longer search may find one
    cached_solve(g, 0.6, NAME, time_limit=20, profile_id="cpu")  # another budget
    assert len(CALLS) == 3
    assert not _files(), "nothing without a plan is written"
    with pytest.raises(InfeasibleBudgetError) as proven:  # below what any schedule needs
        cached_solve(g, 1, "ilp", time_limit=5, profile_id="cpu")
    with pytest.raises(InfeasibleBudgetError) as known:
        cached_solve(g, 1, "ilp", time_limit=5, profile_id="cpu")
    assert str(known.value).startswith(str(proven.value)) and "not searched again" in str(known.value)
    assert known.value.minimum == proven.value.minimum and not proven.value.notes


def test_the_keep_all_peak_is_simulated_once_per_call_and_a_hit_reports_its_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cached_solve resolves the budget once and hands the solver the resolved Budget (with
    its reference): the keep-all peak is simulated once, or never when the budget carries it;
    a hit's re-validation is a ``validate`` stage (what benchmarks count)."""
    import solvers.api

    sims: list[int] = []
    real = solvers.api.keep_all_peak
    monkeypatch.setattr(solvers.api, "keep_all_peak", lambda g: sims.append(1) or real(g))
    g = _graph()
    cached_solve(g, 1.0, NAME)
    assert len(sims) == 1  # a miss: resolved once, not again inside solve
    seen: list[str] = []
    with observe(lambda name, dt: seen.append(name)):
        hit = cached_solve(g, Budget(fraction=1.0).for_graph(real(g)), NAME)
    assert hit.info["cache"] == "hit" and seen == ["validate"]
    assert len(sims) == 1  # the budget carried the reference


@pytest.mark.parametrize(
    "change",
    [
        {"mem": 2},  # sizes (shapes, dtypes) changed
        {"budget": 1.5},
        {"profile_id": "h100"},
        {"options": {"claim": "feasible"}},
    ],
)
def test_miss_after_a_change(change: dict[str, Any]) -> None:
    base: dict[str, Any] = {"budget": 1.0, "profile_id": "cpu", "options": None}
    cached_solve(_graph(), base["budget"], NAME, profile_id="cpu")
    args = {**base, **change}
    res = cached_solve(
        _graph(change.get("mem", 1)),
        args["budget"],
        NAME,
        profile_id=args["profile_id"],
        options=args["options"],
    )
    assert res.info["cache"] == "miss"
    assert len(CALLS) == 2
    assert len(_files()) == 2


def test_key_depends_on_every_part() -> None:
    g = _graph()
    keys = {
        cache_key(g, 100, NAME),
        cache_key(g, 101, NAME),
        cache_key(g, 100, "other"),
        cache_key(g, 100, NAME, {"x": 1}),
        cache_key(g, 100, NAME, profile_id="p"),
        cache_key(g, 100, NAME, boundary=50),
        cache_key(_graph(mem=3), 100, NAME),
        cache_key(chain(6, training=True, cost=2.0), 100, NAME),
    }
    assert len(keys) == 8
    assert cache_key(g, 100, NAME, {"a": 1, "b": 2}) == cache_key(_graph(), 100, NAME, {"b": 2, "a": 1})


def _only_file() -> Path:
    (path,) = _files()
    return path


def _assert_replanned(g: Graph, match: str, path: Path | None = None) -> None:
    with pytest.warns(PlanCacheWarning, match=match):
        res = cached_solve(g, 1.0, NAME, plan_path=path)
    assert res.info["cache"] == "miss"
    assert res.schedule is not None
    validate(g, res.schedule, res.budget)
    # the bad file was replaced by a sound one: the next call hits without a warning
    again = cached_solve(g, 1.0, NAME, plan_path=path)
    assert again.info["cache"] == "hit"


def test_rejects_truncated_file() -> None:
    g = _graph()
    cached_solve(g, 1.0, NAME)
    path = _only_file()
    text = path.read_text()
    path.write_text(text[: len(text) // 3])
    _assert_replanned(g, "truncated")
    assert len(CALLS) == 2


def test_rejects_hand_edited_file() -> None:
    g = _graph()
    cached_solve(g, 1.0, NAME)
    path = _only_file()
    doc = json.loads(path.read_text())
    doc["schedule"] = doc["schedule"][:-1]  # drop the last free
    path.write_text(json.dumps(doc))
    _assert_replanned(g, "modified")


def test_rejects_wrong_version() -> None:
    g = _graph()
    cached_solve(g, 1.0, NAME)
    path = _only_file()
    doc = json.loads(path.read_text())
    doc["version"] = PLAN_VERSION + 1
    write_plan(path, doc)  # well-formed and sealed; only the version is unknown
    _assert_replanned(g, "version")


def test_rejects_schedule_the_simulator_refuses() -> None:
    """A sealed, well-formed plan whose steps are wrong for the graph is never used."""
    g = _graph()
    cached_solve(g, 1.0, NAME)
    path = _only_file()
    doc = json.loads(path.read_text())
    doc["schedule"] = [s for s in doc["schedule"] if s != ["compute", 3]]
    write_plan(path, doc)
    _assert_replanned(g, "not resident")


def _rejected_pinned_goes_to_the_cache(g: Graph, pinned: Path, match: str, budget: object = 1.0) -> None:
    """A rejected plan in the user's file: a warning, the file byte for byte as it was, the
    new plan in the cache (where the next call finds it)."""
    before = pinned.read_bytes()
    with pytest.warns(PlanCacheWarning, match=match):
        res = cached_solve(g, budget, NAME, plan_path=pinned)
    assert pinned.read_bytes() == before, "checkmate changed the user's plan file"
    assert res.info["cache"] == "miss" and res.info["plan_path"] == str(_only_file())
    with pytest.warns(PlanCacheWarning, match=match):
        again = cached_solve(g, budget, NAME, plan_path=pinned)
    assert again.info["cache"] == "hit" and again.info["plan_path"] == str(_only_file())
    assert pinned.read_bytes() == before


def test_rejects_foreign_plan(tmp_path: Path) -> None:
    """A single plan (as ``checkmate solve -o`` writes) made for another graph."""
    pinned = tmp_path / "pinned.json"
    other = chain(5, training=True)
    res = cached_solve(other, 1.0, NAME, plan_path=tmp_path / "scratch.json")
    write_plan(pinned, plan_to_dict(other, res))
    _rejected_pinned_goes_to_the_cache(_graph(), pinned, "another graph")
    assert len(CALLS) == 2


def test_a_plan_holding_more_than_the_boundary_asked_is_not_used(tmp_path: Path) -> None:
    # a plan pinned offline fits any budget it replays within, whatever made it: but not a
    # bound on what it holds at its forward/backward boundary that it breaks
    g = _graph()
    pinned = tmp_path / "p.json"
    write_plan(pinned, plan_to_dict(g, solve(g, 1.0, "checkpoint-all")))
    assert boundary_hold(g, read_plan(pinned, g).schedule) == 6
    with pytest.warns(PlanCacheWarning, match="holds 6 B at its forward/backward boundary, over the 3 B"):
        res = cached_solve(g, Budget(nbytes=7, boundary=3), "ilp", plan_path=pinned)
    assert res.info["cache"] == "miss"
    assert boundary_hold(g, res.schedule) <= 3 and res.peak is not None and res.peak <= 7
    again = cached_solve(g, Budget(nbytes=7, boundary=3), "ilp")
    assert again.info["cache"] == "hit" and again.schedule == res.schedule


def test_pinned_plan_for_other_budget_is_left_as_it_is(tmp_path: Path) -> None:
    pinned = tmp_path / "p.json"
    g = _graph()
    scratch = tmp_path / "scratch.json"
    cached_solve(g, 1.0, NAME, plan_path=scratch)
    # one plan with its cache key, as optimize(plan=) wrote before plan sets
    pinned.write_text(json.dumps(json.loads(scratch.read_text())["plans"][0]))
    _rejected_pinned_goes_to_the_cache(g, pinned, "budget_bytes", 1.2)


@pytest.mark.parametrize("spoil", ["hand-edited", "truncated", "fails the replay"])
def test_rejected_entry_of_a_plan_set_is_left_as_it_is(spoil: str, tmp_path: Path) -> None:
    pinned = tmp_path / "p.json"
    g = _graph()
    cached_solve(g, 1.0, NAME, plan_path=pinned)  # creates a plan set of one entry
    doc = json.loads(pinned.read_text())
    assert doc["format"] == "checkmate-plans" and len(doc["plans"]) == 1
    entry = doc["plans"][0]
    if spoil == "truncated":
        pinned.write_text(pinned.read_text()[:-50])
        match = "malformed JSON"
    else:
        entry["schedule"] = [s for s in entry["schedule"] if s != ["compute", 3]]
        if spoil == "fails the replay":
            entry["checksum"] = document_checksum(entry)
            match = "not resident"
        else:
            match = "modified"
        pinned.write_text(json.dumps(doc))
    _rejected_pinned_goes_to_the_cache(g, pinned, match)


def test_plan_set_gains_an_entry_per_graph_and_budget(tmp_path: Path) -> None:
    pinned = tmp_path / "p.json"
    graphs = [_graph(), chain(4, training=True)]
    for g in graphs:
        assert cached_solve(g, 1.0, NAME, plan_path=pinned).info["cache"] == "miss"
    cached_solve(graphs[0], 1.5, NAME, plan_path=pinned)  # same graph, another budget
    assert len(json.loads(pinned.read_text())["plans"]) == 3 and len(CALLS) == 3
    before = pinned.read_bytes()
    for g, budget in [(graphs[0], 1.0), (graphs[1], 1.0), (graphs[0], 1.5)]:
        res = cached_solve(g, budget, NAME, plan_path=pinned)
        assert res.info["cache"] == "hit" and res.info["plan_path"] == str(pinned)
    assert len(CALLS) == 3 and pinned.read_bytes() == before and _files() == []
    # the CLI reads the entry for the graph it is given, and asks for one when there are several
    assert read_plan(pinned, graphs[1]).doc["n_nodes"] == graphs[1].n
    with pytest.raises(PlanError, match="give the graph"):
        read_plan_document(pinned)


def test_pinned_plan_with_costs_measured_again_is_used(tmp_path: Path) -> None:
    pinned = tmp_path / "p.json"
    cached_solve(_graph(), 1.0, NAME, plan_path=pinned)
    remeasured = chain(6, training=True, cost=1.1)
    assert cached_solve(remeasured, 1.0, NAME, plan_path=pinned).info["cache"] == "hit"
    assert len(CALLS) == 1


def test_feasible_plan_replanned_for_longer_search() -> None:
    g = _graph()
    opts = {"claim": "feasible"}
    cached_solve(g, 1.0, NAME, time_limit=5, options=opts)
    assert cached_solve(g, 1.0, NAME, time_limit=5, options=opts).info["cache"] == "hit"
    assert cached_solve(g, 1.0, NAME, time_limit=2, options=opts).info["cache"] == "hit"
    assert cached_solve(g, 1.0, NAME, time_limit=50, options=opts).info["cache"] == "miss"
    assert len(CALLS) == 2


def test_cache_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    g = _graph()
    for _ in range(2):
        res = cached_solve(g, 1.0, NAME)
        assert "cache" not in res.info
    assert len(CALLS) == 2
    assert not cache_dir().exists() or _files() == []


def test_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CHECKMATE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("CHECKMATE_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "checkmate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "checkmate"


def test_unwritable_cache_warns_and_still_plans(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("CHECKMATE_CACHE_DIR", str(blocker / "sub"))
    with pytest.warns(PlanCacheWarning, match="could not write"):
        res = cached_solve(_graph(), 1.0, NAME)
    assert res.ok


# ---------------------------------------------------------------- concurrent writers
def _worker(args: tuple[str, int, int]) -> list[str]:
    """In a fresh process: plan the same graph repeatedly into one pinned file, each time
    with other options (so every call rewrites the file), reading it back in between."""
    import warnings

    pinned, wid, rounds = args
    _register()
    g = _graph()
    problems: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanCacheWarning)  # other writers' plans have other keys
        for k in range(rounds):
            res = cached_solve(g, 1.0, NAME, options={"writer": wid, "round": k}, plan_path=pinned)
            if not res.ok or res.schedule is None:
                problems.append(f"writer {wid} round {k}: {res.status}")
                continue
            validate(g, res.schedule, res.budget)
            try:
                json.loads(Path(pinned).read_text())
            except ValueError as exc:
                problems.append(f"writer {wid} round {k}: torn file: {exc}")
    return problems


def _same_key_worker(_: int) -> str:
    _register()
    res = cached_solve(_graph(), 1.0, NAME)
    return str(res.info.get("cache"))


def test_concurrent_writers_never_tear_a_file(tmp_path: Path) -> None:
    pinned = tmp_path / "shared.json"
    ctx = mp.get_context("spawn")  # fresh interpreters, as separate training jobs would be
    with ctx.Pool(4) as pool:
        problems = pool.map(_worker, [(str(pinned), w, 15) for w in range(4)])
        # and several processes missing the same cache key at once
        outcomes = pool.map(_same_key_worker, range(4))
    assert [p for ps in problems for p in ps] == []
    json.loads(pinned.read_text())
    assert set(outcomes) <= {"hit", "miss"}
    path = _only_file()
    read_plan(path, _graph())
    assert cached_solve(_graph(), 1.0, NAME).info["cache"] == "hit"
    leftovers = [p for p in [*tmp_path.iterdir(), *cache_dir().iterdir()] if p.suffix == ".tmp"]
    assert leftovers == [], "temporary files left behind"
    assert os.environ.get("CHECKMATE_CACHE") is None


def test_a_plan_cached_by_another_planner_is_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key holds the planner's revision (its version and source digest): a planner that
    changed plans again instead of reusing what an older one cached."""
    import checkmate.cache

    g = _graph()
    assert cached_solve(g, 1.0, NAME).info["cache"] == "miss"
    assert cached_solve(g, 1.0, NAME).info["cache"] == "hit"
    monkeypatch.setattr(checkmate.cache, "planner_revision", lambda: "0.0.0+another")
    assert cached_solve(g, 1.0, NAME).info["cache"] == "miss"
    assert len(CALLS) == 2 and len(_files()) == 2


def test_the_planner_revision_follows_the_planners_source(tmp_path: Path) -> None:
    import shutil

    import solvers
    from solvers.plan import planner_revision, source_digest

    root = Path(solvers.__file__).resolve().parent
    assert planner_revision() == f"{solvers.__version__}+{source_digest(root)[:16]}"
    copy = tmp_path / "solvers"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == source_digest(root)
    with (copy / "strategies" / "auto.py").open("a") as f:
        f.write("\n# a strategy changed\n")
    assert source_digest(copy) != source_digest(root)


def test_a_least_peak_recorded_is_read_back_for_its_graph_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from checkmate.cache import recall_least_peak, remember_least_peak

    g, other = chain(6, mem=4), chain(6, mem=8)
    assert recall_least_peak(g) is None
    remember_least_peak(g, 40)
    assert recall_least_peak(g) == 40
    assert recall_least_peak(other) is None  # another graph's sizes: not its record
    remember_least_peak(g, 44)  # a higher peak found later does not replace a lower one
    assert recall_least_peak(g) == 40
    remember_least_peak(g, 36)
    assert recall_least_peak(g) == 36
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    assert recall_least_peak(g) is None
    remember_least_peak(other, 12)
    monkeypatch.setenv("CHECKMATE_CACHE", "1")
    assert recall_least_peak(other) is None  # nothing was written with the cache off


@pytest.mark.parametrize(
    "text",
    ["{not json", "[]", '{"format": "other", "peak": 5}', "PEAK_STR", "PEAK_NEGATIVE", "PLANNER_OLD"],
)
def test_a_least_peak_record_that_does_not_read_as_one_is_ignored(text: str) -> None:
    from checkmate import cache
    from solvers.plan import graph_fingerprint

    g = chain(5, mem=4)
    cache.remember_least_peak(g, 30)
    path = cache._least_peak_path(graph_fingerprint(g))
    doc = json.loads(path.read_text())
    if text == "PEAK_STR":
        text = json.dumps({**doc, "peak": "30"})
    elif text == "PEAK_NEGATIVE":
        text = json.dumps({**doc, "peak": -3})
    elif text == "PLANNER_OLD":
        text = json.dumps({**doc, "planner": "0.0.1+0000"})
    path.write_text(text)
    assert cache.recall_least_peak(g) is None
    cache.remember_least_peak(g, 31)  # a broken record is replaced
    assert cache.recall_least_peak(g) == 31
