"""Graph IR, JSON I/O and the import of the public graphs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from solvers import (
    Graph,
    GraphError,
    Node,
    graph_from_dict,
    graph_to_dict,
    keep_all_peak,
    load_graph,
    save_graph,
)
from tests.graphs import PUBLIC, chain, public_graph


def test_build_sorts_topologically_and_keeps_external_ids() -> None:
    g = Graph.build(
        [
            {"key": "z", "cost": 1, "mem": 1},
            {"key": "y", "cost": 1, "mem": 2},
            {"key": "x", "cost": 1, "mem": 3},
        ],
        [("x", "y"), ("y", "z")],
    )
    assert [nd.ext for nd in g.nodes] == ["x", "y", "z"]
    assert g.edges == ((0, 1), (1, 2))
    assert g.preds[2] == (1,) and g.succs[0] == (1,)
    assert g.index_of("y") == 1
    assert list(g.mem) == [3, 2, 1]


@pytest.mark.parametrize(
    ("nodes", "edges", "match"),
    [
        ([{"key": 0, "cost": 1, "mem": 1}, {"key": 0, "cost": 1, "mem": 1}], [], "duplicate node id 0"),
        ([{"key": 0, "cost": 1, "mem": 1}], [(0, 7)], "dangling edge"),
        ([{"key": 0, "cost": 1, "mem": -5}], [], "negative size"),
        ([{"key": 0, "cost": -1, "mem": 1}], [], "cost"),
        ([{"key": 0, "cost": 1, "mem": 1}], [(0, 0)], "self-loop"),
        (
            [{"key": i, "cost": 1, "mem": 1} for i in range(3)],
            [(0, 1), (1, 2), (2, 0)],
            "cycle through nodes",
        ),
    ],
)
def test_build_rejects_bad_graphs(
    nodes: list[dict[str, object]], edges: list[tuple[int, int]], match: str
) -> None:
    with pytest.raises(GraphError, match=match):
        Graph.build(nodes, edges)


def test_direct_construction_checks_order() -> None:
    with pytest.raises(GraphError, match="topological"):
        Graph((Node(0, "a", 1, 1), Node(1, "b", 1, 1)), ((1, 0),))
    with pytest.raises(GraphError, match="duplicate edge"):
        Graph((Node(0, "a", 1, 1), Node(1, "b", 1, 1)), ((0, 1), (0, 1)))


def test_graph_is_frozen() -> None:
    g = chain(3)
    with pytest.raises(AttributeError):
        g.name = "x"  # type: ignore[misc]
    with pytest.raises(ValueError):
        g.mem[0] = 7


def test_own_format_round_trip(tmp_path, diamond) -> None:
    path = tmp_path / "g.json"
    save_graph(diamond, path)
    back = load_graph(path)
    assert back == diamond
    assert graph_to_dict(back) == graph_to_dict(diamond)


def test_load_errors_name_the_file(tmp_path) -> None:
    with pytest.raises(GraphError, match="no such file"):
        load_graph(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GraphError, match=r"bad\.json: malformed JSON at line 1"):
        load_graph(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(GraphError, match="not a graph document"):
        load_graph(other)
    cyc = tmp_path / "cyc.json"
    cyc.write_text(
        json.dumps(
            {
                "directed": True,
                "nodes": [{"id": i, "cost_cpu": 1, "cost_ram": 1} for i in range(2)],
                "links": [{"source": 0, "target": 1}, {"source": 1, "target": 0}],
            }
        )
    )
    with pytest.raises(GraphError, match="cycle"):
        load_graph(cyc)


def test_unknown_version_rejected() -> None:
    with pytest.raises(GraphError, match="version"):
        graph_from_dict({"format": "checkmate-graph", "version": 99, "nodes": [], "edges": []})


# Keep-all peaks stated in benchmarks/graphs/README.md: our reading of the files and our
# simulator's memory convention must reproduce them exactly.
@pytest.mark.parametrize(
    ("name", "n", "e", "n_bwd", "peak"),
    [
        ("VGG16_b256_224x224.json", 45, 87, 23, 15_825_108_992),
        ("VGG19_b256_224x224.json", 51, 99, 26, 17_058_234_368),
        ("vgg_unet_b32_416x608.json", 71, 148, 36, 20_959_461_376),
        ("fcn_8_vgg_b32_416x608.json", 73, 149, 37, 13_484_795_520),
        ("segnet_b32_416x608.json", 77, 151, 39, 19_943_884_288),
        ("MobileNet_b512_224x224.json", 185, 367, 93, 34_701_056_000),
        ("ResNet50_b256_224x224.json", 353, 751, 177, 38_059_356_160),
        ("random_layered_n100.json", 100, 236, 0, 46_319),
        ("random_layered_n250.json", 250, 944, 0, 146_840),
        ("random_layered_n500.json", 500, 2_461, 0, 284_439),
        ("random_layered_n1000.json", 1000, 5_875, 0, 608_619),
    ],
)
def test_public_graphs_import(name: str, n: int, e: int, n_bwd: int, peak: int) -> None:
    g = public_graph(name)
    assert (g.n, len(g.edges), int(g.backward_mask.sum())) == (n, e, n_bwd)
    assert keep_all_peak(g) == peak


def test_random_layered_ids_are_names() -> None:
    g = public_graph("random_layered_n100.json")
    doc = json.loads((PUBLIC / "random_layered_n100.json").read_text())
    assert g.ext_ids() == doc["graph"]["order"]


def test_solvers_never_imports_torch() -> None:
    code = (
        "import sys, solvers\n"
        f"g = solvers.load_graph({str(PUBLIC / 'VGG16_b256_224x224.json')!r})\n"
        "r = solvers.solve(g, 1.0, 'checkpoint-all')\n"
        "assert r.ok, r\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
