"""Lower bounds on the Checkmate MILP from LP row duals (Lagrangian certificates).

Any row duals ``y`` of the LP relaxation of the Checkmate MILP (Jain et al., MLSys 2020;
:mod:`solvers.formulation`) give a valid lower bound on its optimum by weak duality. The
duals may come from a restricted model of the same graph (:func:`solvers.formulation.liveness_masks`),
several times smaller: :func:`map_duals` carries them to the full model's rows by row key,
so a cheap LP certifies a bound on the full problem.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from solvers.formulation import MilpModel

__all__ = ["map_duals", "lagrangian_bound", "reduced_costs"]

FloatArray = npt.NDArray[np.float64]


def map_duals(model: MilpModel, row_key: npt.ArrayLike, row_dual: npt.ArrayLike) -> FloatArray:
    """Row duals of another model of the same graph (e.g. on a restricted support), by row
    key, as duals for ``model``'s rows (any duals give a valid :func:`lagrangian_bound`;
    these aim to give a good one).

    Memory rows: a restricted model skips the positions it lacks, so its memory row at
    position k sums the full model's rows from the previous position it has up to k; each
    of those gets that row's dual. Release rows it lacks (values it never holds) get the
    dual that makes their FREE columns' reduced costs nonnegative, so that freeing a value
    the restricted model never holds earns nothing. Other rows it lacks get 0.
    """
    keys = np.asarray(row_key, dtype=np.int64)
    dual = np.asarray(row_dual, dtype=np.float64)
    y = np.full(model.num_constraints, np.nan)
    order = np.argsort(model.row_key)
    pos = np.minimum(np.searchsorted(model.row_key[order], keys), len(order) - 1)
    hit = model.row_key[order][pos] == keys
    y[order[pos[hit]]] = dual[hit]
    # memory rows are the first num_r rows, by stage then position; each stage ends on its
    # diagonal, which every model has: fill gaps from the next row with a dual
    num_r = model.index.num_r
    mem_y = y[:num_r][::-1]
    fill = np.where(np.isnan(mem_y), 0, np.arange(num_r))
    np.maximum.accumulate(fill, out=fill)
    y[:num_r] = mem_y[fill][::-1]
    missing = np.isnan(y)
    y[missing] = 0.0
    n = model.index.n
    num_pairs = n + model.num_edges
    release = missing & (model.row_key // (n * num_pairs) == 1)
    if release.any():
        f0 = model.index.f_off
        d_free = model.cost[f0:] - model.A[:, f0:].T @ y
        coo = model.A[:, f0:].tocoo()
        sel = release[coo.row]
        best = np.zeros(model.num_constraints)
        np.minimum.at(best, coo.row[sel], d_free[coo.col[sel]])
        y[release] = np.minimum(best[release], 0.0)
    return y


def lagrangian_bound(model: MilpModel, row_key: npt.ArrayLike, row_dual: npt.ArrayLike) -> float:
    """A lower bound on ``model``'s LP (hence MILP) optimum from any row duals.

    The duals may come from another model of the same graph (see :func:`map_duals`).
    With ``d = cost - A^T y``, every x within the column bounds that satisfies the rows
    costs at least ``Σ_r y_r b_r + Σ_j min(d_j lo_j, d_j hi_j)``, where ``b_r`` is the row's
    lower bound when ``y_r > 0`` and its upper bound otherwise. Duals of the wrong sign for
    a one-sided row are dropped (still a valid bound). The bound is in objective units.
    """
    return _bound_of(model, map_duals(model, row_key, row_dual))


def _bound_of(model: MilpModel, y: FloatArray) -> float:
    y = y.copy()
    y[(y > 0) & ~np.isfinite(model.row_lower)] = 0.0
    y[(y < 0) & ~np.isfinite(model.row_upper)] = 0.0
    rhs = np.where(y > 0, model.row_lower, model.row_upper)
    d = model.cost - model.A.T @ y
    with np.errstate(invalid="ignore"):
        row_part = float(np.sum(np.where(y != 0, y * rhs, 0.0)))
    col_part = float(np.sum(np.minimum(d * model.col_lower, d * model.col_upper)))
    return row_part + col_part


def reduced_costs(model: MilpModel, row_key: npt.ArrayLike, row_dual: npt.ArrayLike) -> FloatArray:
    """``cost - A^T y`` of ``model``'s columns for duals of a model of the same graph."""
    y = map_duals(model, row_key, row_dual)
    return np.asarray(model.cost - model.A.T @ y, dtype=np.float64)
