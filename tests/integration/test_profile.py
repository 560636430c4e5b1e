"""Per-op costs of traced joint graphs: roofline known answers, measured times, the cache."""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module
from torch._functorch.partitioners import default_partition
from torch.fx.experimental.proxy_tensor import make_fx

from checkmate import timing
from checkmate.cache import cache_dir
from checkmate.profile import (
    DeviceProfile,
    ProfileError,
    load_profile,
    measured_profile,
    profile_costs,
    profile_id,
    save_profile,
)
from checkmate.timing import ProfileWarning, is_free, op_signature

pytestmark = pytest.mark.torch

aten = torch.ops.aten

# Round numbers so that roofline answers can be worked out by hand.
UNIT = DeviceProfile(
    name="unit",
    device="test device",
    peak_flops={"float32": 1e9, "bfloat16": 4e9},
    memory_bandwidth=1e9,
    launch_overhead=1e-6,
    host_bandwidth=1e9,
    host_latency=0.0,
)


def joint_graph(model: nn.Module, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    """The functionalized joint forward+backward aten graph AOTAutograd builds for a step."""
    captured: list[torch.fx.GraphModule] = []

    def partition(joint: torch.fx.GraphModule, joint_inputs: object, **kwargs: object) -> object:
        captured.append(joint)
        return default_partition(joint, joint_inputs, **kwargs)  # type: ignore[arg-type]

    def compiler(gm: torch.fx.GraphModule, example: object) -> object:
        return make_boxed_func(gm.forward)

    traced = aot_module(model, fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition)
    traced(*inputs).sum().backward()
    return captured[0]


def single_op(fn: object, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, torch.fx.Node]:
    """A fake-traced graph of ``fn`` and its one non-free op node."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)  # type: ignore[arg-type]
    ops = [n for n in gm.graph.nodes if not is_free(n)]
    assert len(ops) == 1, [n.target for n in ops]
    return gm, ops[0]


@pytest.fixture(scope="module")
def cnn_graph() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 32),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(32, 10),
    )
    return joint_graph(model, torch.randn(4, 3, 8, 8))


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Two intra-op threads on a busy 2-core machine stall on scheduler ticks (4-8 ms per op);
    # one thread measures the op, not the neighbours.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- roofline ----------------------------------------------------------------------------


def test_mm_roofline_is_compute_bound_known_answer() -> None:
    gm, node = single_op(torch.mm, torch.randn(64, 128), torch.randn(128, 256))
    flops = 2 * 64 * 128 * 256
    moved = (64 * 128 + 128 * 256 + 64 * 256) * 4
    assert flops / 1e9 > moved / 1e9  # compute-bound on UNIT
    assert profile_costs(gm, [node], profile=UNIT, device="cpu") == [pytest.approx(flops / 1e9 + 1e-6)]


def test_bf16_mm_uses_the_bf16_peak() -> None:
    _gm, node = single_op(torch.mm, torch.randn(64, 128).bfloat16(), torch.randn(128, 256).bfloat16())
    assert UNIT.estimate(node) == pytest.approx(2 * 64 * 128 * 256 / 4e9 + 1e-6)


def test_elementwise_roofline_is_bandwidth_bound_known_answer() -> None:
    _gm, node = single_op(torch.relu, torch.randn(1000, 100))
    assert UNIT.estimate(node) == pytest.approx(2 * 1000 * 100 * 4 / 1e9 + 1e-6)


def test_expanded_input_counts_the_memory_it_spans() -> None:
    _gm, node = single_op(lambda a, b: a + b, torch.randn(1000, 100), torch.randn(100))
    # a, the broadcast b (100 floats, not 100 000) and the output.
    assert UNIT.estimate(node) == pytest.approx((1000 * 100 * 2 + 100) * 4 / 1e9 + 1e-6)


def test_convolution_flops_known_answer() -> None:
    conv = lambda x, w, b: torch.conv2d(x, w, b, padding=1)  # noqa: E731
    _gm, node = single_op(conv, torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4))
    assert node.target is aten.convolution.default
    flops = 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3) + 2 * 4 * 8 * 8
    slow = DeviceProfile("slow", "x", {"float32": 1e6}, 1e15, 0.0, 1e9, 0.0)  # compute-bound
    assert slow.estimate(node) == pytest.approx(flops / 1e6)


def test_ops_table_takes_precedence_over_the_roofline() -> None:
    _gm, node = single_op(torch.mm, torch.randn(8, 16), torch.randn(16, 4))
    sig = op_signature(node)
    assert sig == "aten.mm.default(float32[8,16], float32[16,4])"
    table = dataclasses.replace(UNIT, ops={sig: 0.25})
    assert table.estimate(node) == 0.25


def test_signature_shows_strides_of_non_contiguous_inputs() -> None:
    _gm, node = single_op(lambda a, b: torch.mm(a, b.t()), torch.randn(8, 16), torch.randn(4, 16))
    assert op_signature(node) == "aten.mm.default(float32[8,16], float32[16,4]{1,16})"


def test_shipped_profiles_estimate_a_joint_graph(cnn_graph: torch.fx.GraphModule) -> None:
    nodes = list(cnn_graph.graph.nodes)
    per = {
        name: profile_costs(cnn_graph, nodes, profile=name, device="cpu") for name in ("cpu", "a100", "h100")
    }
    for name, costs in per.items():
        assert len(costs) == len(nodes)
        for node, cost in zip(nodes, costs):
            if is_free(node):
                assert cost == 0.0, (name, node.target)
            else:
                assert cost > 0.0, (name, node.target)
    # The faster device is never slower on any op, and strictly faster in total.
    assert all(h <= a for h, a in zip(per["h100"], per["a100"]))
    assert sum(per["h100"]) < sum(per["a100"]) < sum(per["cpu"])


def test_views_getitem_and_placeholders_are_free(cnn_graph: torch.fx.GraphModule) -> None:
    nodes = list(cnn_graph.graph.nodes)
    kinds = {str(n.target) for n in nodes if is_free(n) and n.op == "call_function"}
    assert {"aten.t.default", "aten.view.default", "<built-in function getitem>"} <= kinds
    assert not any(is_free(n) for n in nodes if n.target in (aten.mm.default, aten.convolution.default))
    assert all(is_free(n) for n in nodes if n.op in ("placeholder", "output"))


def test_profile_id_changes_with_the_numbers() -> None:
    a = profile_id(UNIT, "cpu")
    b = profile_id(dataclasses.replace(UNIT, memory_bandwidth=2e9), "cpu")
    assert a != b and a.startswith("profile:unit:")
    assert profile_id(None, "cpu").startswith("measured:")


# --- errors ------------------------------------------------------------------------------


def test_unknown_profile_name_lists_the_available_ones() -> None:
    with pytest.raises(
        ProfileError, match=r"unknown device profile 'v100'; available profiles: .*a100.*cpu.*h100"
    ):
        load_profile("v100")


def test_malformed_profile_file_names_the_field(tmp_path: Path) -> None:
    doc = load_profile("h100").to_dict()
    doc["memory_bandwidth"] = -1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"bad\.json: field 'memory_bandwidth' must be a positive"):
        load_profile(path)
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(str(path))
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "missing.json")


def test_profile_from_a_file_path_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(UNIT.to_dict()))
    assert load_profile(path) == UNIT


# --- measured ----------------------------------------------------------------------------


def test_measured_costs_are_positive_and_cached(cnn_graph: torch.fx.GraphModule, one_thread: None) -> None:
    nodes = list(cnn_graph.graph.nodes)
    first = profile_costs(cnn_graph, nodes, profile=None, device="cpu")
    assert len(first) == len(nodes)
    for node, cost in zip(nodes, first):
        assert (cost == 0.0) == is_free(node), node.target
    # Timing the same op twice never gives the same float: equal values came from the cache.
    assert profile_costs(cnn_graph, nodes, profile=None, device="cpu") == first
    files = list((cache_dir() / "op_times").glob("*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["format"] == "checkmate-op-times" and doc["version"] == timing.OP_TIMES.version
    assert {op_signature(n) for n in nodes if not is_free(n)} == set(doc["ops"])
    timing.OP_TIMES.clear()  # a new process: the times come back from disk
    assert profile_costs(cnn_graph, nodes, profile=None, device="cpu") == first


def test_cache_off_writes_nothing(
    cnn_graph: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    nodes = [n for n in cnn_graph.graph.nodes if n.target is aten.mm.default]
    assert all(c > 0 for c in profile_costs(cnn_graph, nodes, profile=None, device="cpu"))
    assert not (cache_dir() / "op_times").exists()


def test_measured_matmul_is_slower_than_a_tiny_add(one_thread: None) -> None:
    big, mm = single_op(torch.mm, torch.randn(256, 512), torch.randn(512, 512))
    small, add = single_op(torch.add, torch.randn(16), torch.randn(16))
    t_mm = profile_costs(big, [mm], profile=None, device="cpu")[0]
    t_add = profile_costs(small, [add], profile=None, device="cpu")[0]
    # 134 MFLOP vs 16 additions; one thread of any x86 core does < 200 GFLOP/s.
    assert t_mm > 134e6 / 200e9
    assert t_mm > 10 * t_add


def test_profiling_does_not_change_the_random_stream(cnn_graph: torch.fx.GraphModule) -> None:
    nodes = [n for n in cnn_graph.graph.nodes if "dropout" in str(n.target)]
    assert nodes
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    timing.OP_TIMES.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileWarning)
        profile_costs(cnn_graph, nodes, profile=None, device="cpu")
    assert torch.equal(torch.rand(4), expected)


def test_an_op_that_cannot_run_is_estimated_with_a_warning() -> None:
    gm, node = single_op(torch.mm, torch.randn(8, 16), torch.randn(16, 4))
    src = node.args[0]
    assert isinstance(src, torch.fx.Node)
    del src.meta["val"]  # nothing to materialize the input from
    with pytest.warns(ProfileWarning, match=r"aten\.mm\.default .*LookupError"):
        (cost,) = profile_costs(gm, [node], profile=None, device="cpu")
    assert cost > 0


def test_a_measured_profile_plans_like_the_measurement_elsewhere(
    cnn_graph: torch.fx.GraphModule, tmp_path: Path, one_thread: None
) -> None:
    nodes = list(cnn_graph.graph.nodes)
    measured = profile_costs(cnn_graph, nodes, profile=None, device="cpu")
    prof = measured_profile(cnn_graph, nodes, device="cpu", base="h100", name="my-box")
    path = save_profile(prof, tmp_path / "my-box.json")
    # Read back on "another machine": every op takes its measured time, not the H100 roofline.
    assert profile_costs(cnn_graph, nodes, profile=path, device="cpu") == measured
    assert load_profile(path).name == "my-box"
    assert load_profile(path).peak_flops == load_profile("h100").peak_flops
    with pytest.raises(ProfileError, match="non-negative finite"):
        prof.with_ops({"aten.mm.default()": -1.0})


def test_constants_of_the_graph_module_are_used_and_named(one_thread: None) -> None:
    const = torch.randn(16, 4)
    gm = make_fx(lambda x: torch.mm(x, const))(torch.randn(8, 16))  # real mode keeps constants
    (node,) = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    arg = node.args[1]
    assert isinstance(arg, torch.fx.Node) and arg.op == "get_attr"
    assert op_signature(node) == "aten.mm.default(float32[8,16], float32[16,4])"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileWarning)
        assert profile_costs(gm, [node], profile=None, device="cpu")[0] > 0


def test_profiling_a_500_op_graph_takes_seconds() -> None:
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, norm_first=True) for _ in range(3)]
    gm = joint_graph(nn.Sequential(*layers), torch.randn(8, 32, 64))
    nodes = list(gm.graph.nodes)
    assert len(nodes) >= 500
    timing.OP_TIMES.clear()
    start = time.perf_counter()
    costs = profile_costs(gm, nodes, profile=None, device="cpu")
    elapsed = time.perf_counter() - start
    print(f"profiled {len(nodes)} nodes in {elapsed:.2f} s")
    assert elapsed < 20.0, f"profiling {len(nodes)} nodes took {elapsed:.1f} s"
    assert sum(costs) > 0


def test_ops_timed_inside_the_partitioner_run_on_real_tensors(one_thread: None) -> None:
    # the partitioner runs under AOTAutograd's fake mode (and its Python dispatcher): timed
    # there as they were, ops ran on fake tensors, and every op measured the ~0.2 ms of a fake
    # dispatch whatever its size (a 268 MFLOP addmm and a 4-element add alike)
    import checkmate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU())
    opt = checkmate.optimize(model, 1.0)
    opt(torch.randn(256, 512)).sum().backward()
    rec = checkmate.plans_of(opt)[0]
    cost = {
        name: float(rec.joint.graph.cost[i]) for i, names in enumerate(rec.joint.members) for name in names
    }
    products = [c for name, c in cost.items() if name.startswith(("addmm", "mm"))]
    assert products, sorted(cost)
    # 268 MFLOP each (the forward's addmm, the backward's two mm); one x86 thread does < 200 GFLOP/s
    assert min(products) > 268e6 / 200e9, products


def test_bandwidth_measured_inside_a_fake_mode_is_the_devices() -> None:
    # Inductor's cost model measures the memory bandwidth from inside the partitioner, as above
    from torch._subclasses.fake_tensor import FakeTensorMode

    from checkmate import fusion

    fusion._measured_speed.cache_clear()
    try:
        with FakeTensorMode():
            bandwidth, launch = fusion.device_speed(None, "cpu")
    finally:
        fusion._measured_speed.cache_clear()
    # a copy of 64 MiB through a CPU's memory: well under 1 TB/s (a fake copy "ran" at ~6 TB/s)
    assert 1e8 < bandwidth < 1e12
    assert launch > 0


def _recording_node(vals: list[torch.Tensor], seen: list[tuple[str, ...]]) -> tuple[Any, Any]:
    """A graph calling one Python function on placeholders with example values ``vals``;
    the function records its arguments' device types in ``seen``."""

    def op(*args: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(a.device.type for a in args))
        return args[0]

    g = torch.fx.Graph()
    phs = []
    for k, v in enumerate(vals):
        ph = g.placeholder(f"x{k}")
        ph.meta["val"] = v
        phs.append(ph)
    node = g.call_function(op, tuple(phs))
    g.output(node)
    return torch.fx.GraphModule(torch.nn.Module(), g), node


def test_an_op_given_mixed_devices_is_timed_with_its_cpu_scalars_on_the_cpu() -> None:
    # CUDA attention's dropout takes its philox seed and offset as CPU scalars and reads them
    # on the host: timed with device copies, its backward segfaulted. 'meta' stands for the
    # accelerator here: the rule is about device kinds, not CUDA.
    from checkmate.timing import _measure_node, _Pool

    seen: list[tuple[str, ...]] = []
    gm, node = _recording_node([torch.empty(8, device="meta"), torch.tensor(3)], seen)
    _measure_node(gm, node, _Pool(torch.device("meta")))
    assert seen and set(seen) == {("meta", "cpu")}

    seen.clear()  # a graph wholly on the CPU, timed on another device: moved there whole
    gm, node = _recording_node([torch.empty(8), torch.tensor(3)], seen)
    _measure_node(gm, node, _Pool(torch.device("meta")))
    assert seen and set(seen) == {("meta", "meta")}


@torch.library.custom_op("checkmate_test::seeded", mutates_args=())
def _seeded(x: torch.Tensor, philox_seed: torch.Tensor) -> torch.Tensor:
    _SEEDED_SEEN.append((x.device.type, philox_seed.device.type))
    return x.clone()


@_seeded.register_fake  # what runs on 'meta' tensors
def _(x: torch.Tensor, philox_seed: torch.Tensor) -> torch.Tensor:
    _SEEDED_SEEN.append((x.device.type, philox_seed.device.type))
    return torch.empty_like(x)


_SEEDED_SEEN: list[tuple[str, str]] = []


def test_a_philox_argument_is_timed_on_the_cpu_whatever_its_example_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the traced example value of CUDA attention's philox seed says CUDA; flash and efficient
    # attention read it on the host (checkmate.ops names them; this op stands in for them)
    from checkmate import ops
    from checkmate.timing import _measure_node, _Pool

    monkeypatch.setattr(ops, "_HOST_PHILOX_OPS", ops._HOST_PHILOX_OPS | {"checkmate_test::seeded"})

    g = torch.fx.Graph()
    x, seed = g.placeholder("x"), g.placeholder("seed")
    x.meta["val"], seed.meta["val"] = torch.empty(8, device="meta"), torch.empty((), device="meta")
    node = g.call_function(torch.ops.checkmate_test.seeded.default, (x, seed))
    g.output(node)
    _SEEDED_SEEN.clear()
    _measure_node(torch.fx.GraphModule(torch.nn.Module(), g), node, _Pool(torch.device("meta")))
    assert _SEEDED_SEEN and set(_SEEDED_SEEN) == {("meta", "cpu")}
