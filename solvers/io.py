"""Reading and writing graphs.

Formats:
- checkmate's own JSON (``{"format": "checkmate-graph", "version": 1, ...}``);
- networkx node-link JSON of the Checkmate training graphs (node fields ``id``, ``name``,
  ``backward``, ``cost_cpu``, ``cost_ram``; links ``source``/``target``);
- networkx node-link JSON of the random layered graphs of Gagrani et al. 2022 (node fields
  ``name``, ``out_cost``, ``duration``; links ``"0"``/``"1"``; ``graph.order``).

The format is detected from the document; :func:`load_graph` raises :class:`GraphError`
with the path and the cause for anything it cannot read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from solvers.errors import GraphError
from solvers.graph import Graph

__all__ = ["load_graph", "save_graph", "graph_from_dict", "graph_to_dict"]

GRAPH_FORMAT = "checkmate-graph"
GRAPH_VERSION = 1


def load_graph(path: str | os.PathLike[str]) -> Graph:
    """Load a graph from a JSON file of any supported format.

    Raises:
        GraphError: the file is missing, not JSON, or not a valid graph.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise GraphError(f"{p}: no such file") from None
    except OSError as exc:
        raise GraphError(f"{p}: cannot read ({exc.strerror})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GraphError(f"{p}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    try:
        return graph_from_dict(doc, default_name=p.stem)
    except GraphError as exc:
        raise GraphError(f"{p}: {exc}") from None


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
            }
            for nd in graph.nodes
        ],
        "edges": [[graph.nodes[u].ext, graph.nodes[v].ext] for u, v in graph.edges],
    }


def graph_from_dict(doc: Any, *, default_name: str = "") -> Graph:
    """Build a graph from a parsed JSON document of any supported format."""
    if not isinstance(doc, dict):
        raise GraphError(f"expected a JSON object, got {type(doc).__name__}")
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
    for i, nd in enumerate(_list(doc, "nodes")):
        _need(nd, ("id", "cost", "mem"), f"node #{i}")
        nodes.append(
            {
                "key": nd["id"],
                "name": nd.get("name", str(nd["id"])),
                "cost": _num(nd["cost"], f"node {nd['id']!r} cost"),
                "mem": _num(nd["mem"], f"node {nd['id']!r} mem"),
                "backward": nd.get("backward", False),
                "recomputable": nd.get("recomputable", True),
                "op": nd.get("op", ""),
            }
        )
    edges = [_pair(e, i) for i, e in enumerate(_list(doc, "edges"))]
    return Graph.build(nodes, edges, name=doc.get("name") or default_name, meta=doc.get("meta") or {})


def _from_node_link(doc: dict[str, Any], default_name: str) -> Graph:
    gattr = doc.get("graph") or {}
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
            nodes.append(
                {
                    "key": nd["id"],
                    "name": nd.get("name", str(nd["id"])),
                    "cost": _num(nd["cost_cpu"], f"node {nd['id']!r} cost_cpu"),
                    "mem": _num(nd["cost_ram"], f"node {nd['id']!r} cost_ram"),
                    "backward": nd.get("backward", False),
                }
            )
        src_key, dst_key = "source", "target"
        order = None
        kind = "checkmate"
    elif "out_cost" in first:  # random layered graphs (Gagrani et al. 2022)
        for i, nd in enumerate(raw_nodes):
            _need(nd, ("name", "out_cost", "duration"), f"node #{i}")
            nodes.append(
                {
                    "key": nd["name"],
                    "name": str(nd["name"]),
                    "cost": _num(nd["duration"], f"node {nd['name']!r} duration"),
                    "mem": _num(nd["out_cost"], f"node {nd['name']!r} out_cost"),
                }
            )
        src_key, dst_key = ("0", "1") if "0" in (links[0] if links else {}) else ("source", "target")
        order = gattr.get("order")
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
        edges.append((ln[src_key], ln[dst_key]))
    return Graph.build(
        nodes, edges, name=gattr.get("name") or default_name, order=order, meta={"source_format": kind}
    )


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
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GraphError(f"{where} must be a number, got {value!r}")
    return value


def _pair(e: Any, i: int) -> tuple[Any, Any]:
    if not isinstance(e, list) or len(e) != 2:
        raise GraphError(f"edge #{i} must be a [source, target] pair, got {e!r}")
    return e[0], e[1]
