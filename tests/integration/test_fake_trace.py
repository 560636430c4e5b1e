"""``checkmate trace --fake``: a trace on fake tensors is the real trace, without the storage."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from checkmate.cli import cli
from checkmate.cli_trace import trace_factory
from solvers import load_graph
from solvers.graph import Graph

pytestmark = pytest.mark.torch

FACTORY = textwrap.dedent(
    """
    import torch

    def llama():
        # a 2-layer Llama decoder in bf16 (SDPA attention, RMSNorm, SwiGLU, RoPE), random init
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, use_cache=False,
        )
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
        ids = torch.randint(0, 256, (2, 32))
        return model, ids

    def huge():
        # 4 x 40 GB of float32 weights: traceable only on fake tensors (the guard keeps a
        # broken fake mode from trying to allocate them)
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(torch.empty(1), FakeTensor):
            raise RuntimeError("huge() must run on fake tensors")
        torch.manual_seed(0)
        layers = [torch.nn.Linear(100_000, 100_000, bias=False) for _ in range(4)]
        return torch.nn.Sequential(*layers), torch.randn(2, 100_000)

    def converts():
        return torch.nn.Linear(8, 8).to(torch.bfloat16), torch.randn(2, 8, dtype=torch.bfloat16)
    """
)


@pytest.fixture(scope="module")
def factory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fake") / "fake_models.py"
    path.write_text(FACTORY)
    return path


def _rows(g: Graph) -> list[tuple[object, ...]]:
    return [(n.key, n.op, n.mem, n.cost, n.backward, n.recomputable) for n in g.nodes]


def test_fake_trace_equals_real_trace(factory: Path) -> None:
    pytest.importorskip("transformers")
    (real,) = trace_factory(f"{factory}:llama", profile="h100")
    (fake,) = trace_factory(f"{factory}:llama", profile="h100", fake=True)
    assert real.n > 200  # the whole step: two decoder layers, the head and the backward
    # same ops in the same order, same output bytes, same profile costs, same edges
    assert _rows(fake) == _rows(real)
    assert sorted(fake.edges) == sorted(real.edges)
    assert fake.meta["fake"] is True and real.meta["fake"] is False
    # bf16 as the model declares: the matmuls' outputs hold 2 bytes an element
    mms = [n for n in fake.nodes if n.op == "aten.mm.default"]
    assert mms and any(n.mem == 2 * 2 * 32 * 64 for n in mms)


def test_fake_trace_of_a_model_larger_than_memory(factory: Path, tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    res = CliRunner().invoke(cli, ["trace", f"{factory}:huge", "--fake", "--profile", "h100", "-o", str(out)])
    assert res.exit_code == 0, res.output
    g = load_graph(out)
    assert json.loads(out.read_text())["meta"]["fake"] is True
    # each weight gradient is a 40 GB output: sizes come from the fake tensors' shapes
    assert max(g.mem) == 100_000 * 100_000 * 4
    # a 2x100000x100000 matmul at the h100 profile's float32 peak (67 TFLOP/s): ~0.6 ms
    assert 1e-4 < max(g.cost) < 1e-1


def test_fake_needs_a_profile(factory: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["trace", f"{factory}:huge", "--fake", "-o", str(tmp_path / "g.json")])
    assert res.exit_code != 0 and "--profile" in res.output, res.output


def test_fake_factory_that_converts_its_model_is_told_what_to_do(factory: Path) -> None:
    from solvers.errors import CheckmateError

    with pytest.raises(CheckmateError, match="set_default_dtype"):
        trace_factory(f"{factory}:converts", profile="h100", fake=True)
