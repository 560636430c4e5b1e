"""A zoo of ordinary training models through ``checkmate.optimize``, against eager PyTorch.

Each case builds a small model (Hugging Face models from random configs, no downloads;
hand-built CNNs, RNNs, attention, norms, in-place ops, frozen and tied parameters,
dropout, masking, integer inputs), copies it, optimizes the copy at a fraction of each
graph's no-remat peak and runs two training steps (the second reuses the plan) beside the
eager original under the same seeds. Losses and every parameter gradient must be bitwise
equal (the plan runs the same aten ops on the same values), every plan's simulated peak
must be within its budget, and eval / ``no_grad`` forwards must equal eager's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
import torch.nn.functional as F
from torch import nn

import checkmate
from checkmate.api import UnplannedWarning, plans_of

pytestmark = pytest.mark.torch

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


# ----------------------------------------------------------------------------- hand-built


class UNet(nn.Module):
    """Two-level U-Net: strided downsampling, nearest upsampling, skip concatenations."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1), nn.ReLU())
        self.dec2 = nn.Sequential(nn.Conv2d(4 * c, 2 * c, 3, padding=1), nn.ReLU())
        self.dec1 = nn.Sequential(nn.Conv2d(3 * c, c, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        m = self.mid(e2)
        d2 = self.dec2(torch.cat([self.up(m), e2], dim=1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0, mode="nearest"), e1], dim=1))
        return self.out(d1)


class RNNLM(nn.Module):
    """Embedding -> LSTM or GRU -> tied-free linear head; returns the cross-entropy loss."""

    def __init__(self, kind: str, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(d, d, num_layers=2, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(idx))
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class InPlace(nn.Module):
    """In-place residual additions and activations on fresh tensors (as ResNets write them)."""

    def __init__(self, d: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            h += x  # addmm saves its inputs, not its output: mutating it is allowed
            x = h.relu_()
        y = x * 0.5
        y.clamp_(max=2.0)
        return torch.sigmoid(y)


class BNNet(nn.Module):
    """BatchNorm1d/2d in training mode (running stats are buffers updated each step)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c, momentum=0.3)
        self.fc = nn.Linear(c, 16)
        self.bn3 = nn.BatchNorm1d(16)
        self.calls: torch.Tensor
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return self.bn3(self.fc(h.mean(dim=(2, 3))))


class Norms(nn.Module):
    """LayerNorm, GroupNorm, InstanceNorm and RMS-style normalization."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.gn = nn.GroupNorm(4, c)
        self.inorm = nn.InstanceNorm2d(c, affine=True)
        self.ln = nn.LayerNorm(c)
        self.fc = nn.Linear(c, c)
        self.scale = nn.Parameter(torch.ones(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gn(self.conv(x)))
        h = self.inorm(h)
        t = self.ln(h.flatten(2).transpose(1, 2))
        t = self.fc(t)
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class Constants(nn.Module):
    """Tensors created in forward (``torch.tensor``, ``arange``): lifted into the graph as
    constants (``get_attr`` nodes)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.tensor([1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0])
        h = torch.tanh(self.fc1(x)) * w + torch.arange(8.0)
        return self.fc2(torch.tanh(h) + torch.tensor(0.5))


class DictTuple(nn.Module):
    """Returns a dict holding a tuple and a non-tensor; some outputs need no gradient."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)
        self.c = nn.Linear(2 * d, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.tanh(self.a(x))
        return {"main": self.b(h), "aux": (self.c(h), h.argmax(-1)), "n": 3}


class Frozen(nn.Module):
    """A frozen feature extractor (requires_grad False) under a trainable head."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.head = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 8))
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.head[0].bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class Tied(nn.Module):
    """Tied embedding/output head and one linear applied twice (shared weights)."""

    def __init__(self, vocab: int = 96, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = torch.tanh(self.mix(h))
        h = torch.tanh(self.mix(h))
        return self.head(h)


class MHA(nn.Module):
    """nn.MultiheadAttention with a key padding mask and a causal attention mask."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, dropout=0.1)
        self.ln = nn.LayerNorm(d)
        self.ff = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        y, _ = self.attn(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)
        return self.ff(self.ln(x + y))


class SDPA(nn.Module):
    """F.scaled_dot_product_attention, causal, with attention dropout."""

    def __init__(self, d: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Dropouts(nn.Module):
    """nn.Dropout, F.dropout, Dropout1d (whole channels) and AlphaDropout."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.d1 = nn.Dropout1d(0.2)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(2 * d, 2 * d)
        self.alpha = nn.AlphaDropout(0.1)
        self.fc3 = nn.Linear(2 * d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.d1(F.relu(self.fc1(x)))
        h = self.alpha(F.selu(self.drop(self.fc2(h))))
        return self.fc3(F.dropout(h, 0.1, self.training))


class EmbedCE(nn.Module):
    """Embedding with padding_idx, cross-entropy with ignore_index and label smoothing."""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.fc = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.fc(F.gelu(self.emb(idx)))
        a = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
        b = F.cross_entropy(logits.transpose(1, 2), target.clamp(min=0), label_smoothing=0.1)
        return a + 0.5 * b


class Masked(nn.Module):
    """torch.where, masked_fill, boolean masks from integer inputs, clamp and abs."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.arange(t, device=x.device)[None, :] < lengths[:, None]
        h = self.fc1(x)
        h = torch.where(mask[..., None], h, torch.zeros_like(h))
        s = (h @ h.transpose(1, 2)).masked_fill(~mask[:, None, :], float("-inf")).softmax(-1)
        g = self.fc2(s @ h)
        return torch.where(g > 0, g, 0.1 * g).clamp(-3, 3).abs().sum(1) / lengths[:, None]


# ------------------------------------------------------------------------- Hugging Face


def _bert(mlm: bool) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM, BertModel

    cfg = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    return BertForMaskedLM(cfg) if mlm else BertModel(cfg)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128, use_cache=False)
    return GPT2LMHeadModel(cfg)


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(  # type: ignore[call-arg]
        vocab_size=128,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        dropout_rate=0.1,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(cfg)


def _bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=128,
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        dropout=0.1,
        use_cache=False,
    )
    return BartForConditionalGeneration(cfg)


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(  # type: ignore[call-arg]
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
        hidden_dropout_prob=0.1,
    )
    return ViTForImageClassification(cfg)


def _tokens(b: int, t: int, vocab: int, lo: int = 0) -> torch.Tensor:
    return torch.randint(lo, vocab, (b, t))


def _labels(b: int, t: int, vocab: int) -> torch.Tensor:
    y = torch.randint(0, vocab, (b, t))
    y[:, ::3] = -100  # ignored positions
    return y


# --------------------------------------------------------------------------------- cases


def _loss(out: Any) -> torch.Tensor:
    """A scalar loss from any output: the model's own loss, or a sum over every float output."""
    if hasattr(out, "loss") and out.loss is not None:
        return out.loss  # type: ignore[no-any-return]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    leaves = torch.utils._pytree.tree_leaves(out)
    parts = [x.float().pow(2).mean() for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
    assert parts, "the model returned no float tensor"
    return torch.stack(parts).sum()


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    inputs: Callable[[], Inputs]
    hf: bool = False


def _pos(*xs: Any) -> Inputs:
    return xs, {}


CASES: dict[str, Case] = {
    "bert_mlm": Case(
        lambda: _bert(True),
        lambda: ((), {"input_ids": _tokens(4, 24, 128), "labels": _labels(4, 24, 128)}),
        hf=True,
    ),
    "bert_model": Case(
        lambda: _bert(False),
        lambda: (
            (),
            {
                "input_ids": _tokens(4, 24, 128),
                "attention_mask": (torch.arange(24) < 20).long().expand(4, 24),
            },
        ),
        hf=True,
    ),
    "gpt2_lm_labels": Case(
        _gpt2, lambda: ((), {"input_ids": _tokens(4, 32, 128), "labels": _labels(4, 32, 128)}), hf=True
    ),
    "t5": Case(
        _t5,
        lambda: ((), {"input_ids": _tokens(4, 16, 128, 1), "labels": _tokens(4, 12, 128, 1)}),
        hf=True,
    ),
    "bart": Case(
        _bart,
        lambda: ((), {"input_ids": _tokens(4, 16, 128, 3), "labels": _tokens(4, 12, 128, 3)}),
        hf=True,
    ),
    "vit": Case(
        _vit,
        lambda: ((), {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 10, (4,))}),
        hf=True,
    ),
    "unet": Case(UNet, lambda: _pos(torch.randn(2, 3, 16, 16))),
    "lstm_lm": Case(lambda: RNNLM("lstm"), lambda: _pos(_tokens(4, 12, 64), _tokens(4, 12, 64))),
    "gru_lm": Case(lambda: RNNLM("gru"), lambda: _pos(_tokens(4, 12, 64), _tokens(4, 12, 64))),
    "inplace": Case(InPlace, lambda: _pos(torch.randn(64, 64, requires_grad=True))),
    "batchnorm": Case(BNNet, lambda: _pos(torch.randn(16, 3, 16, 16))),
    "norms": Case(Norms, lambda: _pos(torch.randn(2, 3, 8, 8))),
    "constants": Case(Constants, lambda: _pos(torch.randn(256, 8))),
    "dict_tuple": Case(DictTuple, lambda: _pos(torch.randn(32, 32))),
    "frozen": Case(Frozen, lambda: _pos(torch.randn(64, 64))),
    "tied": Case(Tied, lambda: _pos(_tokens(4, 16, 96))),
    "mha": Case(
        MHA,
        lambda: _pos(
            torch.randn(4, 12, 32), torch.arange(12)[None, :] >= torch.tensor([[12], [9], [6], [12]])
        ),
    ),
    "sdpa": Case(SDPA, lambda: _pos(torch.randn(4, 16, 32))),
    "dropout": Case(Dropouts, lambda: _pos(torch.randn(32, 16, 32))),
    "embed_ce": Case(EmbedCE, lambda: _pos(_tokens(4, 16, 64), _labels(4, 16, 64))),
    "masked": Case(Masked, lambda: _pos(torch.randn(4, 10, 32), torch.tensor([10, 7, 3, 1]))),
}


def _clone(inputs: Inputs) -> Inputs:
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return x

    args, kwargs = inputs
    return tuple(one(x) for x in args), {k: one(v) for k, v in kwargs.items()}


def _step(model: nn.Module, inputs: Inputs, seed: int) -> tuple[torch.Tensor, Any]:
    torch.manual_seed(seed)
    args, kwargs = inputs
    out = model(*args, **kwargs)
    loss = _loss(out)
    loss.backward()
    return loss.detach(), out


def _grads(model: nn.Module, inputs: Inputs) -> list[torch.Tensor | None]:
    gs = [p.grad for p in model.parameters()]
    gs += [x.grad for x in inputs[0] if isinstance(x, torch.Tensor) and x.requires_grad]
    return gs


def _assert_equal(a: list[Any], b: list[Any], what: str) -> None:
    assert len(a) == len(b), what
    for k, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what} {k}: one is None"
        if x is not None:
            assert x.shape == y.shape, f"{what} {k}: shapes {x.shape} != {y.shape}"
            assert torch.equal(x, y), f"{what} {k}: max diff {(x.double() - y.double()).abs().max().item()}"


#: case -> fraction of each graph's no-remat peak, below 1.0 so that the plan must drop and
#: recompute something (the test asserts it does): 0.5 where a plan exists; otherwise one of
#: 0.6 / 0.7 / 0.8 / 0.9 / 0.95 (at these small sizes the parameter gradients and the
#: largest single op are a large share of the peak; the figures are in the zoo sweep's report)
FRACTION = {
    "bert_mlm": 0.7,
    "bert_model": 0.7,
    "gpt2_lm_labels": 0.6,  # the loss graph after the break is planned keep-all (a warning)
    "t5": 0.7,
    "bart": 0.9,
    "vit": 0.9,
    "unet": 0.9,
    "lstm_lm": 0.5,
    "gru_lm": 0.5,
    "inplace": 0.9,
    "batchnorm": 0.9,
    # its least peak found within the 3 s limit sits at 70.0-70.3% of its keep-all peak, varying
    # between runs (0.7 was refused as infeasible in 11 of 12 runs on 2026-11-29, on this code and
    # on the code before it alike): 0.75 still recomputes (asserted below)
    "norms": 0.75,
    "constants": 0.7,
    "dict_tuple": 0.8,
    "frozen": 0.8,
    "tied": 0.8,
    "mha": 0.9,
    "sdpa": 0.9,
    "dropout": 0.7,
    "embed_ce": 0.8,
    "masked": 0.95,
}

#: Dynamo does not trace nn.LSTM/nn.GRU (torch._dynamo.config.allow_rnn is False): the frame
#: runs eagerly and nothing is planned (test_rnn_runs_eagerly_and_says_so)
RNN = ("lstm_lm", "gru_lm")

#: (case, fraction): every case at its fraction, and cheap ones at 1.0 (the eager path)
PARAMS = [
    pytest.param(
        name,
        FRACTION[name],
        id=f"{name}-{FRACTION[name]}",
        marks=[pytest.mark.slow] if CASES[name].hf else [],
    )
    for name in CASES
    if name not in RNN
] + [pytest.param(n, 1.0, id=f"{n}-1.0") for n in ("inplace", "batchnorm", "tied", "masked", "constants")]


@pytest.mark.parametrize(("name", "fraction"), PARAMS)
def test_zoo_matches_eager(name: str, fraction: float) -> None:
    case = CASES[name]
    if case.hf:
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    eager = case.make()
    eager.train()
    model = copy.deepcopy(eager)
    inputs = case.inputs()
    inputs_e = _clone(inputs)
    inputs_o = _clone(inputs)

    opt = checkmate.optimize(model, fraction, profile="cpu", time_limit=3)
    l_opt, _ = _step(opt, inputs_o, seed=1)
    l_eager, _ = _step(eager, inputs_e, seed=1)
    assert torch.equal(l_opt, l_eager), f"step 1 loss {l_opt.item()} != {l_eager.item()}"
    _assert_equal(_grads(opt, inputs_o), _grads(eager, inputs_e), "step 1 gradient")
    _assert_equal(list(opt.buffers()), list(eager.buffers()), "step 1 buffer")

    records = plans_of(opt)
    assert records, "nothing was planned"
    for r in records:
        assert r.result.peak is not None and r.result.peak <= r.result.budget, r.summary()
        if r.asked_budget is not None:  # a fraction infeasible for a small graph (GPT-2's loss)
            assert r.asked_budget < r.result.budget <= r.reference_peak, r.summary()
    if fraction < 1.0:  # below the no-remat peak something must be recomputed
        assert sum(r.recomputes for r in records) > 0, "; ".join(r.summary() for r in records)

    # a second step on the same shapes reuses the plans (gradients accumulate)
    l_opt2, _ = _step(opt, inputs_o, seed=2)
    l_eager2, _ = _step(eager, inputs_e, seed=2)
    assert torch.equal(l_opt2, l_eager2)
    # no new solve: a recompile (ViT's loss sets config.problem_type on its first call, a
    # Dynamo guard) reuses the plan of the same graph, or finds it in the plan cache
    again = plans_of(opt)[len(records) :]
    assert all(r.cache == "hit" or r.reused_from is not None for r in again), [
        (r.cache, r.reused_from, r.summary()) for r in again
    ]
    _assert_equal(_grads(opt, inputs_o), _grads(eager, inputs_e), "step 2 gradient")
    _assert_equal(list(opt.buffers()), list(eager.buffers()), "step 2 buffer")

    # evaluation and no_grad run the original forward
    opt.eval()
    eager.eval()
    with torch.no_grad():
        torch.manual_seed(3)
        out_o = opt(*inputs_o[0], **inputs_o[1])
        torch.manual_seed(3)
        out_e = eager(*inputs_e[0], **inputs_e[1])
    assert torch.equal(_loss(out_o), _loss(out_e))
    print(f"\n{name} at {fraction:.0%}: " + "; ".join(r.summary() for r in records))


@pytest.mark.parametrize("name", RNN)
def test_rnn_runs_eagerly_and_says_so(name: str) -> None:
    """An LSTM/GRU frame is not captured by Dynamo (allow_rnn=False; torch 2.13/2.14): the
    step runs eagerly with an UnplannedWarning, nothing is planned, the gradients are eager's
    (allow_rnn=True traces them: GRU planned at 0.8, bitwise equal)."""
    case = CASES[name]
    torch.manual_seed(0)
    eager = case.make()
    eager.train()
    model = copy.deepcopy(eager)
    inputs = case.inputs()
    inputs_e = _clone(inputs)
    inputs_o = _clone(inputs)
    opt = checkmate.optimize(model, FRACTION[name], profile="cpu", time_limit=3)
    with pytest.warns(UnplannedWarning):
        l_opt, _ = _step(opt, inputs_o, seed=1)
    l_eager, _ = _step(eager, inputs_e, seed=1)
    assert plans_of(opt) == [], [r.summary() for r in plans_of(opt)]
    assert torch.equal(l_opt, l_eager)
    _assert_equal(_grads(opt, inputs_o), _grads(eager, inputs_e), "gradient")


@pytest.mark.parametrize("name", RNN)
def test_an_rnn_dynamo_is_allowed_to_trace_is_planned_within_a_byte_budget(name: str) -> None:
    """With ``torch._dynamo.config.allow_rnn = True`` (what the UnplannedWarning above
    suggests), Dynamo unrolls the 2-layer LSTM/GRU over its 12 time steps and checkmate plans
    that graph at a batch of 16: the plan recomputes something, the step after the one that
    plans measures within a byte budget of 0.6 (GRU) or 0.85 (LSTM: its least peak found is
    76% of keep-all) of the unrolled step's peak under plain torch.compile, and the gradients
    equal eager's within 1e-5 of the largest (the unrolled cells are aten ops, not the fused
    kernel, and sum in another order). The budget is not taken from eager's peak: the fused
    LSTM held 2.9x the unrolled step's keep-all peak at the case's batch of 4, so a fraction of
    it needed no plan."""
    torch._dynamo.reset()  # a frame Dynamo skipped earlier in this process without allow_rnn stays skipped
    try:
        _plan_an_unrolled_rnn(name)
    finally:
        torch._dynamo.reset()  # and one it compiled here with allow_rnn would be reused after


def _plan_an_unrolled_rnn(name: str) -> None:
    from checkmate.memory import measure_peak

    case = CASES[name]
    with torch._dynamo.config.patch(allow_rnn=True):
        torch.manual_seed(0)
        eager = case.make()
        eager.train()
        model = copy.deepcopy(eager)
        inputs = _pos(_tokens(16, 12, 64), _tokens(16, 12, 64))  # the case's batch of 4 is mostly weights
        compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager")
        _step(compiled, _clone(inputs), seed=1)  # compiles, outside the measurement
        fraction = 0.85 if name == "lstm_lm" else 0.6  # the unrolled LSTM's least peak: 76% of keep-all
        budget = int(fraction * measure_peak(lambda: _step(compiled, _clone(inputs), seed=1)))
        opt = checkmate.optimize(model, budget, profile="cpu", time_limit=3)
        _step(opt, _clone(inputs), seed=1)  # plans, outside the measurement
        records = plans_of(opt)
        assert len(records) == 1 and records[0].recomputes > 0, [r.summary() for r in records]
        opt.zero_grad()
        inputs_o, inputs_e = _clone(inputs), _clone(inputs)
        peak = measure_peak(lambda: _step(opt, inputs_o, seed=1))
        print(f"\n{name}: {peak / budget:.3f}x a budget of {budget:,} B; {records[0].summary()}")
        assert peak <= budget, f"{peak} > {budget}: {records[0].summary()}"
        _step(eager, inputs_e, seed=1)
        scale = max(g.abs().max().item() for g in _grads(eager, inputs_e) if g is not None)
        for k, (a, b) in enumerate(zip(_grads(opt, inputs_o), _grads(eager, inputs_e), strict=True)):
            assert (a is None) == (b is None), k
            if a is not None:
                assert (a - b).abs().max().item() <= 1e-5 * scale, (k, (a - b).abs().max().item() / scale)
