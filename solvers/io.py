"""Reading and writing graphs.

Formats:
- checkmate's own JSON (``{"format": "checkmate-graph", "version": 1, ...}``);
- networkx node-link JSON of the Checkmate training graphs (node fields ``id``, ``name``,
  ``backward``, ``cost_cpu``, ``cost_ram``; links ``source``/``target``);
- networkx node-link JSON of the random layered graphs of Gagrani et al. 2022 (node fields
  ``name``, ``out_cost``, ``duration``; links ``"0"``/``"1"``; ``graph.order``).

The format is detected from the document; :func:`load_graph` raises :class:`GraphError`
with the path and the cause for anything it cannot read: bytes that are not JSON text,
nesting too deep for the parser, ids that are not strings or integers, costs that are not
finite numbers >= 0, sizes that are not whole numbers of bytes below
:data:`~solvers.graph.MAX_NODE_BYTES` (2**53) or that sum to
:data:`~solvers.graph.MAX_TOTAL_BYTES` (2**62) or more, missing fields, duplicate ids,
dangling edges and cycles. No other exception escapes it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from solvers.errors import CheckmateError, GraphError
from solvers.graph import Graph

__all__ = ["load_graph", "save_graph", "graph_from_dict", "graph_to_dict", "read_json"]

GRAPH_FORMAT = "checkmate-graph"
GRAPH_VERSION = 1


def load_graph(path: str | os.PathLike[str]) -> Graph:
    """Load a graph from a JSON file of any supported format.

    Raises:
        GraphError: the file is missing, not JSON, or not a valid graph.
    """
    p = Path(path)
    doc = read_json(p, GraphError, "graph")
    try:
        return graph_from_dict(doc, default_name=p.stem)
    except GraphError as exc:
        raise GraphError(f"{p}: {exc}") from None


def read_json(path: Path, error: type[CheckmateError], what: str) -> Any:
    """The JSON document in ``path``; every way reading it fails (missing, unreadable, not
    UTF-8, malformed or truncated, nested too deeply, a number too long) as ``error`` with
    one line naming the file and the cause (``what`` names the kind of file)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such file (a {what} was expected)") from None
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise error(
            f"{path}: malformed JSON at line {exc.lineno} column {exc.colno} (truncated or hand-edited?): {exc.msg}"
        ) from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not JSON text (byte {exc.start} is not valid {exc.encoding})") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply to be a {what}") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise error(f"{path}: unreadable JSON: {exc}") from None


def save_graph(graph: Graph, path: str | os.PathLike[str]) -> None:
    """Write ``graph`` in checkmate's own JSON format, atomically."""
    from solvers.plan import atomic_write_text

    atomic_write_text(Path(path), json.dumps(graph_to_dict(graph), indent=1))


def graph_to_dict(graph: Graph) -> dict[str, Any]:
    """checkmate's own JSON document for ``graph``."""
    return {
        "format": GRAPH_FORMAT,
        "version": GRAPH_VERSION,
        "name": graph.name,
        "meta": dict(graph.meta),
        "nodes": [
            {
                "id": nd.ext,
                "name": nd.name,
                "cost": nd.cost,
                "mem": nd.mem,
                "backward": nd.backward,
                "recomputable": nd.recomputable,
                "op": nd.op,
                **({"save_cost": nd.save_cost} if nd.save_cost else {}),
            }
            for nd in graph.nodes
        ],
        "edges": [[graph.nodes[u].ext, graph.nodes[v].ext] for u, v in graph.edges],
    }


def graph_from_dict(doc: Any, *, default_name: str = "") -> Graph:
    """Build a graph from a parsed JSON document of any supported format."""
    if not isinstance(doc, dict):
        raise GraphError(f"expected a JSON object, got {type(doc).__name__}")
    try:
        return _from_dict(doc, default_name)
    except RecursionError:
        raise GraphError("the document is nested too deeply to be a graph") from None


def _from_dict(doc: dict[str, Any], default_name: str) -> Graph:
    if doc.get("format") == GRAPH_FORMAT:
        return _from_own(doc, default_name)
    if "nodes" in doc and "links" in doc:
        return _from_node_link(doc, default_name)
    raise GraphError(
        'not a graph document: expected checkmate\'s format ("format": '
        f'"{GRAPH_FORMAT}") or a networkx node-link graph ("nodes" and "links")'
    )


def _from_own(doc: dict[str, Any], default_name: str) -> Graph:
    version = doc.get("version")
    if version != GRAPH_VERSION:
        raise GraphError(f"unknown graph format version {version!r} (this checkmate reads {GRAPH_VERSION})")
    nodes = []
    raw_nodes = _list(doc, "nodes")
    if not raw_nodes:
        raise GraphError("the graph has no nodes")
    for i, nd in enumerate(raw_nodes):
        _need(nd, ("id", "cost", "mem"), f"node #{i}")
        key = _id(nd["id"], f"node #{i} id")
        nodes.append(
            {
                "key": key,
                "name": _str(nd.get("name", str(key)), f"node {key!r} name"),
                "cost": _num(nd["cost"], f"node {key!r} cost"),
                "mem": _num(nd["mem"], f"node {key!r} mem"),
                "backward": _bool(nd.get("backward", False), f"node {key!r} backward"),
                "recomputable": _bool(nd.get("recomputable", True), f"node {key!r} recomputable"),
                "op": _str(nd.get("op", ""), f"node {key!r} op"),
                "save_cost": _num(nd.get("save_cost", 0.0), f"node {key!r} save_cost"),
            }
        )
    edges = [_pair(e, i) for i, e in enumerate(_list(doc, "edges"))]
    meta = doc.get("meta") or {}
    if not isinstance(meta, dict):
        raise GraphError(f"field 'meta' must be a JSON object, got {type(meta).__name__}")
    name = _str(doc.get("name") or default_name, "field 'name'")
    return Graph.build(nodes, edges, name=name, meta=meta)


def _from_node_link(doc: dict[str, Any], default_name: str) -> Graph:
    gattr = doc.get("graph") or {}
    if not isinstance(gattr, dict):
        raise GraphError(f"field 'graph' must be a JSON object, got {type(gattr).__name__}")
    raw_nodes = _list(doc, "nodes")
    links = _list(doc, "links")
    if not raw_nodes:
        raise GraphError("the graph has no nodes")
    first = raw_nodes[0]
    if not isinstance(first, dict):
        raise GraphError("nodes must be JSON objects")
    nodes = []
    if "cost_ram" in first or "cost_cpu" in first:  # Checkmate training graphs
        for i, nd in enumerate(raw_nodes):
            _need(nd, ("id", "cost_cpu", "cost_ram"), f"node #{i}")
            key = _id(nd["id"], f"node #{i} id")
            nodes.append(
                {
                    "key": key,
                    "name": _str(nd.get("name", str(key)), f"node {key!r} name"),
                    "cost": _num(nd["cost_cpu"], f"node {key!r} cost_cpu"),
                    "mem": _num(nd["cost_ram"], f"node {key!r} cost_ram"),
                    "backward": _bool(nd.get("backward", False), f"node {key!r} backward"),
                }
            )
        src_key, dst_key = "source", "target"
        order = None
        kind = "checkmate"
    elif "out_cost" in first:  # random layered graphs (Gagrani et al. 2022)
        for i, nd in enumerate(raw_nodes):
            _need(nd, ("name", "out_cost", "duration"), f"node #{i}")
            key = _id(nd["name"], f"node #{i} name")
            nodes.append(
                {
                    "key": key,
                    "name": str(key),
                    "cost": _num(nd["duration"], f"node {key!r} duration"),
                    "mem": _num(nd["out_cost"], f"node {key!r} out_cost"),
                }
            )
        first_link = links[0] if links and isinstance(links[0], dict) else {}
        src_key, dst_key = ("0", "1") if "0" in first_link else ("source", "target")
        order = gattr.get("order")
        if order is not None and not isinstance(order, list):
            raise GraphError(f"field 'graph.order' must be a list of node names, got {type(order).__name__}")
        if order is not None:
            order = [_id(k, f"graph.order[{j}]") for j, k in enumerate(order)]
        kind = "random-layered"
    else:
        raise GraphError(
            "unknown node-link node fields: expected Checkmate's (cost_cpu, cost_ram) or "
            "the random layered graphs' (out_cost, duration)"
        )
    edges = []
    for i, ln in enumerate(links):
        if not isinstance(ln, dict) or src_key not in ln or dst_key not in ln:
            raise GraphError(f"link #{i} lacks {src_key!r}/{dst_key!r}")
        edges.append((_id(ln[src_key], f"link #{i} {src_key}"), _id(ln[dst_key], f"link #{i} {dst_key}")))
    name = _str(gattr.get("name") or default_name, "field 'graph.name'")
    return Graph.build(nodes, edges, name=name, order=order, meta={"source_format": kind})


def _list(doc: dict[str, Any], key: str) -> list[Any]:
    value = doc.get(key)
    if not isinstance(value, list):
        raise GraphError(f"field {key!r} must be a list")
    return value


def _need(nd: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(nd, dict):
        raise GraphError(f"{where} must be a JSON object")
    missing = [k for k in keys if k not in nd]
    if missing:
        raise GraphError(f"{where} lacks field(s) {', '.join(missing)}")


def _num(value: Any, where: str) -> float:
    """A finite number >= 0 (sizes are checked to be whole numbers by Graph.build)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphError(f"{where} must be a number, got {_short(value)}")
    try:
        ok = 0 <= float(value) < math.inf
    except OverflowError:  # an int beyond float's range
        ok = False
    if not ok:
        raise GraphError(f"{where} must be a finite number >= 0, got {_short(value)}")
    return value


def _id(value: Any, where: str) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise GraphError(f"{where} must be a string or an integer, got {_short(value)}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise GraphError(f"{where} must be a string, got {_short(value)}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise GraphError(f"{where} must be true or false, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    """``repr(value)`` cut to one short line (values in error messages come from files)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # deep nesting; an int too long to print
        text = f"a {type(value).__name__}"
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


def _pair(e: Any, i: int) -> tuple[int | str, int | str]:
    if not isinstance(e, list) or len(e) != 2:
        raise GraphError(f"edge #{i} must be a [source, target] pair, got {_short(e)}")
    return _id(e[0], f"edge #{i} source"), _id(e[1], f"edge #{i} target")
