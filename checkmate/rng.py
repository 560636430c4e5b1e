"""Dropout recomputed with the draws it made: the generator's state, kept, replays its mask.

A random op runs exactly once in a planned step: recomputed, it would draw fresh numbers
and the gradients would no longer be PyTorch's. Dropout's output is recomputed from its
mask already (:func:`checkmate.trace.recompute_dropout_from_mask`), but the mask itself, one
byte per element, had to be kept from the forward to the backward. ``torch.utils.checkpoint``
does better: it saves the random generator's state before a region and restores it to run
the region again (``preserve_rng_state``), drawing the same numbers. Six transformer
blocks with dropout 0.1 ran in 49.06 MiB checkpointed eagerly, where checkmate's least
peak, every mask kept, was 57.04 MiB.

The same here, per dropout: :func:`replay_dropout_draws` puts a ``checkmate::rng_state``
call right before each ``native_dropout`` of the joint graph. That op copies the state of
the generator the dropout draws from (the CPU's 5,056 bytes, or a CUDA device's seed and
offset, 16 bytes) and, tagged random, runs exactly once, in order with the other random
ops. The dropout's mask becomes recomputable and reads the state: its first computation is
the dropout itself, drawing from the live generator (now at that state) as eager does; a
recompute is :func:`replay_native_dropout`, which sets the generator to the state, draws
the same mask, and sets the generator back, so draws after it are eager's too
(:mod:`checkmate.codegen`). The plan keeps a few kilobytes of state where it kept a mask.

Inductor draws its own random numbers (not eager's) and compiles the step's graph whole,
so a step planned for Inductor keeps its masks as before.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

__all__ = ["RNG_STATE", "replay_dropout_draws", "replay_native_dropout", "rng_state", "take_state"]

#: ``meta`` key of a ``native_dropout`` node: the name of the ``rng_state`` node before it
RNG_STATE = "checkmate_rng_state"

#: devices whose default generator's state can be read and set (other devices keep masks)
_DEVICES = frozenset({"cpu", "cuda"})


def _get_state(device: torch.device) -> torch.Tensor:
    """A copy of the state of ``device``'s default generator (a CPU byte tensor)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    """Set ``device``'s default generator to ``state`` (from :func:`_get_state`)."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def take_state(x: torch.Tensor) -> torch.Tensor:
    """A copy of the state of the default generator of ``x``'s device (a CPU byte tensor).
    The traced graph takes it through :func:`rng_state`; the generated step calls this plain
    function (about 4 us on the CPU, where the custom op's dispatch takes about 23)."""
    return _get_state(x.device)


@torch.library.custom_op("checkmate::rng_state", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def rng_state(x: torch.Tensor) -> torch.Tensor:
    """:func:`take_state` as an op of the traced graph: tagged random, it runs exactly once,
    in order with the other random ops."""
    return take_state(x)


@rng_state.register_fake
def _rng_state_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(_state_bytes(x.device), dtype=torch.uint8, device="cpu")


_SIZES: dict[str, int] = {}


def _state_bytes(device: torch.device) -> int:
    """Bytes of the state of ``device``'s default generator (read once per device type)."""
    kind = device.type
    if kind not in _SIZES:
        _SIZES[kind] = 16 if kind == "cuda" else int(torch.get_rng_state().numel())
    return _SIZES[kind]


def replay_native_dropout(
    x: torch.Tensor, p: float, train: bool | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout(x, p, train)`` drawn from the generator ``state`` (what the dropout
    drew from when it first ran); the generator is left where it was."""
    now = _get_state(x.device)
    _set_state(x.device, state)
    try:
        return torch.ops.aten.native_dropout.default(x, p, train)
    finally:
        _set_state(x.device, now)


def replay_dropout_draws(gm: fx.GraphModule) -> int:
    """Put a ``checkmate::rng_state`` call before each training-mode ``native_dropout`` of
    ``gm`` on a CPU or CUDA tensor, and name it in the dropout's ``meta[RNG_STATE]`` (see the
    module docstring). Mutates ``gm``.

    Returns:
        The number of dropouts whose draws can now be replayed.
    """
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.native_dropout.default:
            continue
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if len(node.args) < 3 or node.args[2] is not True or not isinstance(val, torch.Tensor):
            continue
        if val.device.type not in _DEVICES or RNG_STATE in node.meta:
            continue
        if not any(u.target is operator.getitem and u.args[1] == 1 for u in node.users):
            continue  # no mask read: nothing to replay
        with gm.graph.inserting_before(node):
            state = gm.graph.call_function(torch.ops.checkmate.rng_state.default, (x,))
        mode = getattr(val, "fake_mode", None)
        with mode if mode is not None else contextlib.nullcontext():
            state.meta["val"] = _rng_state_fake(val)
        node.meta[RNG_STATE] = state.name
        done += 1
    if done:
        gm.recompile()
    return done
