"""FLOP and byte counts of aten ops, for the roofline estimate of :mod:`checkmate.profile`.

Counts are per call of one fx node of a functionalized aten graph, computed from the
``meta['val']`` (FakeTensors) of its inputs and outputs. A multiply-add counts as 2 FLOPs.

Approximations (the roofline only needs the right order of magnitude; a measured op table
in the profile overrides it):

- ``mm``/``addmm``/``bmm``/``baddbmm``: ``2·m·k·n`` (times the batch), plus one FLOP per
  output element for the added term.
- ``convolution``: ``2 · out_numel · (C_in/groups) · prod(kernel)`` (transposed: the same
  with input and output swapped), plus the bias; ``convolution_backward``: one such count
  per requested gradient of input and weight, plus the bias gradient.
- scaled-dot-product attention (flash / efficient / cudnn / math-for-cpu kernels):
  ``2·B·H·L·S·(E + E_v)`` for the two matmuls, softmax ignored; the backward counts 2.5×
  that (four matmuls for the gradients and one to recompute the scores).
- ``native_layer_norm``/batch norm: 5 FLOPs per input element (backward: 8); softmax and
  log-softmax: 5 (backward: 4).
- random ops (``native_dropout``, ``bernoulli``, ``rand_like``): 100 FLOPs per element
  (drawing a random number costs ~100 instructions on a CPU; GPUs stay memory-bound).
- pointwise ops (``torch.Tag.pointwise``): one FLOP per output element, 8 for
  transcendental functions (exp, tanh, erf, gelu, ...); reductions: one per input element.
- every other op: 0 FLOPs, so its estimate is bytes moved / bandwidth.
- bytes moved: the bytes of every tensor input (an expanded input counts the memory it spans,
  not its logical size) plus those of every tensor output. Caches and fusion are ignored.

Only matmul-like ops (mm, convolutions, attention) run at the dtype's tensor-core peak;
:func:`op_cost_terms` says which ops are.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

__all__ = ["CostTerms", "op_cost_terms", "output_shares", "tensor_span_bytes", "flat_tensors"]

aten = torch.ops.aten


@dataclass(frozen=True)
class CostTerms:
    """What the roofline needs to know about one op call.

    Attributes:
        flops: floating-point operations (a multiply-add counts 2).
        bytes: bytes read and written (tensor inputs + outputs).
        matmul: True when the op runs on matrix units (its FLOPs use the dtype's peak).
        dtype: the dtype the peak is looked up for (``"float32"``, ``"bfloat16"``, ...).
    """

    flops: float
    bytes: float
    matmul: bool
    dtype: str


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or nested lists/tuples/dicts of them), in order."""
    out: list[torch.Tensor] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        elif isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
    return out


def tensor_span_bytes(t: torch.Tensor) -> int:
    """Bytes of memory ``t`` spans (an expanded tensor spans less than its numel)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((int(s) - 1) * abs(int(st)) for s, st in zip(t.shape, t.stride()))
    return min(span, t.numel()) * t.element_size()


def _meta(arg: Any) -> Any:
    """The FakeTensor (or value) an fx argument stands for."""
    if isinstance(arg, torch.fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_meta(a) for a in arg)
    return arg


def _numel(t: Any) -> int:
    return int(t.numel()) if isinstance(t, torch.Tensor) else 0


def _prod(xs: Iterable[int]) -> int:
    return math.prod(int(x) for x in xs)


def _mm(args: Sequence[Any], out: Any) -> float:
    a, b = args[0], args[1]
    return 2.0 * _prod(a.shape) * int(b.shape[-1])


def _addmm(args: Sequence[Any], out: Any) -> float:
    return _mm(args[1:], out) + _numel(out)


def _bmm(args: Sequence[Any], out: Any) -> float:
    a, b = args[0], args[1]
    return 2.0 * _prod(a.shape) * int(b.shape[-1])


def _baddbmm(args: Sequence[Any], out: Any) -> float:
    return _bmm(args[1:], out) + _numel(out)


def _conv_flops(
    x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], transposed: bool
) -> float:
    # weight is (C_out, C_in/groups, *k) for a convolution, (C_in, C_out/groups, *k) transposed;
    # each output (input, when transposed) element takes prod(w_shape[1:]) multiply-adds.
    per_element = _prod(w_shape[1:])
    driving = x_shape if transposed else out_shape
    return 2.0 * _prod(driving) * per_element


def _convolution(args: Sequence[Any], out: Any) -> float:
    x, w, bias = args[0], args[1], args[2]
    transposed = bool(args[6]) if len(args) > 6 else False
    flops = _conv_flops(x.shape, w.shape, out.shape, transposed)
    return flops + (_numel(out) if isinstance(bias, torch.Tensor) else 0)


def _convolution_backward(args: Sequence[Any], out: Any) -> float:
    grad_out, x, w = args[0], args[1], args[2]
    transposed = bool(args[7]) if len(args) > 7 else False
    mask = list(args[10]) if len(args) > 10 else [True, True, True]
    fwd = _conv_flops(x.shape, w.shape, grad_out.shape, transposed)
    return fwd * (int(bool(mask[0])) + int(bool(mask[1]))) + (_numel(grad_out) if mask[2] else 0)


def _attention(args: Sequence[Any], out: Any) -> float:
    q, k, v = args[0], args[1], args[2]
    lead = _prod(q.shape[:-1])  # B·H·L
    s = int(k.shape[-2])
    return 2.0 * lead * s * (int(q.shape[-1]) + int(v.shape[-1]))


def _attention_backward(args: Sequence[Any], out: Any) -> float:
    # The backward ops take grad_out first, then q, k, v.
    return 2.5 * _attention(args[1:4], out)


def _per_input_element(k: float) -> Callable[[Sequence[Any], Any], float]:
    def count(args: Sequence[Any], out: Any) -> float:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return k * _numel(first)

    return count


_FLOPS: dict[Any, tuple[Callable[[Sequence[Any], Any], float], bool]] = {
    aten.mm: (_mm, True),
    aten.addmm: (_addmm, True),
    aten.bmm: (_bmm, True),
    aten.baddbmm: (_baddbmm, True),
    aten.convolution: (_convolution, True),
    aten.convolution_backward: (_convolution_backward, True),
    aten.native_layer_norm: (_per_input_element(5), False),
    aten.native_layer_norm_backward: (_per_input_element(8), False),
    aten.native_batch_norm: (_per_input_element(5), False),
    aten._native_batch_norm_legit: (_per_input_element(5), False),
    aten._native_batch_norm_legit_functional: (_per_input_element(5), False),
    aten._native_batch_norm_legit_no_training: (_per_input_element(5), False),
    aten.native_batch_norm_backward: (_per_input_element(8), False),
    aten._softmax: (_per_input_element(5), False),
    aten._log_softmax: (_per_input_element(5), False),
    aten._softmax_backward_data: (_per_input_element(4), False),
    aten.native_dropout: (_per_input_element(100), False),
    aten.bernoulli: (_per_input_element(100), False),
    aten.rand_like: (_per_input_element(100), False),
    aten._log_softmax_backward_data: (_per_input_element(4), False),
}
if hasattr(aten, "_safe_softmax"):
    _FLOPS[aten._safe_softmax] = (_per_input_element(5), False)
for _name in (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
):
    if hasattr(aten, _name):
        _FLOPS[getattr(aten, _name)] = (_attention, True)
    if hasattr(aten, _name + "_backward"):
        _FLOPS[getattr(aten, _name + "_backward")] = (_attention_backward, True)

_TRANSCENDENTAL = frozenset(
    {
        "exp",
        "exp2",
        "expm1",
        "log",
        "log2",
        "log1p",
        "tanh",
        "tanh_backward",
        "sigmoid",
        "sigmoid_backward",
        "erf",
        "erfinv",
        "gelu",
        "gelu_backward",
        "silu",
        "silu_backward",
        "sin",
        "cos",
        "pow",
        "rsqrt",
        "sqrt",
        "softplus",
        "mish",
    }
)


def _is_reduction(op: Any) -> bool:
    return op.overloadpacket.__name__ in {
        "sum",
        "mean",
        "amax",
        "amin",
        "max",
        "min",
        "prod",
        "var",
        "std",
        "norm",
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def op_cost_terms(node: torch.fx.Node) -> CostTerms | None:
    """FLOPs and bytes moved by one call of ``node`` (an aten ``call_function`` node).

    Args:
        node: an fx node whose ``meta['val']`` and whose tensor inputs' ``meta['val']`` are
            FakeTensors (or tuples/lists of them).

    Returns:
        The counts, or None when the node carries no tensor metadata to count from.
    """
    out = node.meta.get("val")
    args = [_meta(a) for a in node.args]
    kwargs = {k: _meta(v) for k, v in node.kwargs.items()}
    ins = flat_tensors(args) + flat_tensors(kwargs)
    outs = flat_tensors(out)
    if not ins and not outs:
        return None
    moved = float(sum(tensor_span_bytes(t) for t in ins) + sum(t.numel() * t.element_size() for t in outs))
    first = next((t for t in ins + outs if t.is_floating_point()), None)
    dtype = _dtype_name(first.dtype) if first is not None else "float32"
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    flops = 0.0
    matmul = False
    if packet is not None and packet in _FLOPS:
        count, matmul = _FLOPS[packet]
        try:
            flops = float(count(args, out))
        except (IndexError, AttributeError, TypeError):
            # An overload with an unexpected argument layout: fall back to bytes only.
            flops, matmul = 0.0, False
    elif packet is not None and target is not operator.getitem:
        tags = getattr(target, "tags", ())
        if torch.Tag.pointwise in tags:
            per = 8.0 if packet.__name__ in _TRANSCENDENTAL else 1.0
            flops = per * sum(t.numel() for t in outs)
        elif _is_reduction(target):
            flops = float(sum(t.numel() for t in ins))
    return CostTerms(flops=flops, bytes=moved, matmul=matmul, dtype=dtype)


#: the parts of a masked op, each counted alone, must add up to the whole within this share
#: for :func:`output_shares` to split it (a convolution's backward: exactly)
_SEPARABLE = 0.02


def output_shares(node: torch.fx.Node, at: int, outputs: Sequence[int]) -> dict[int, float] | None:
    """The share of ``node``'s work that each of ``outputs`` takes, for an op whose argument
    ``at`` is an output mask (``convolution_backward``): the op's FLOP count with the mask
    narrowed to that output alone, over its count with the mask narrowed to ``outputs``.

    Only where the work separates: the counts alone add up to the count together (a
    convolution's input gradient and weight gradient are two convolutions, run by two
    kernels whether asked together or not; measured on CPU, the two alone took 0.81-1.05x
    the time of the two together). None otherwise (a normalization's backward: its input
    gradient needs the reductions that give its weight gradient; an op without a FLOP
    count), and for fewer than two outputs.
    """
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in _FLOPS or len(outputs) < 2 or at >= len(node.args):
        return None
    count, _ = _FLOPS[packet]
    args = [_meta(a) for a in node.args]
    mask = args[at]
    if not isinstance(mask, (list, tuple)) or any(k >= len(mask) or not mask[k] for k in outputs):
        return None

    def flops(keep: Iterable[int]) -> float:
        kept = set(keep)
        narrowed = [bool(m) and k in kept for k, m in enumerate(mask)]
        try:
            return float(count([*args[:at], narrowed, *args[at + 1 :]], node.meta.get("val")))
        except (IndexError, AttributeError, TypeError):
            return 0.0

    whole = flops(outputs)
    parts = {k: flops([k]) for k in outputs}
    if whole <= 0.0 or min(parts.values()) <= 0.0 or abs(sum(parts.values()) - whole) > _SEPARABLE * whole:
        return None
    return {k: v / whole for k, v in parts.items()}
