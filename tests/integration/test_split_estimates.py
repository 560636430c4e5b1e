"""The model of a step split into several graphs (:mod:`checkmate.split`): what each graph
holds while the others run, and the outputs a loop drops."""

from __future__ import annotations

import pytest
import torch

from checkmate.split import OutputWatch, Share, step_estimates

pytestmark = pytest.mark.torch

MiB = 2**20


def test_a_later_graphs_gradients_count_only_while_a_graph_runs_backward() -> None:
    # graph 0 peaks in its forward (9 MiB) and in its backward (6 MiB); graph 1 leaves 4 MiB
    # of parameter gradients, which do not exist yet while graph 0's forward runs
    first = Share(held=2 * MiB, forward=9 * MiB, backward=6 * MiB, grads=1 * MiB)
    second = Share(held=1 * MiB, forward=3 * MiB, backward=5 * MiB, grads=4 * MiB)
    got = step_estimates([first, second], [1, 1], [0, 0])
    assert got == [max(9, 6 + 4) * MiB, (2 + 5) * MiB]


def test_gradients_handed_to_an_earlier_graph_are_its_tangents_counted_once() -> None:
    # graph 1 (a loss on graph 0's 4 MiB of logits) hands their gradient to graph 0's
    # backward, whose peak counts it as its tangents: counted once, not as graph 1's too
    model = Share(held=5 * MiB, forward=5 * MiB, backward=8 * MiB, grads=2 * MiB, tangents=4 * MiB)
    loss = Share(held=4 * MiB, forward=4 * MiB, backward=12 * MiB, grads=4 * MiB, input_grads=4 * MiB)
    held, dropped = (
        step_estimates([model, loss], [1, 1], [0, 0]),
        step_estimates([model, loss], [1, 1], [0, 4 * MiB]),
    )
    assert held[0] == dropped[0] == 8 * MiB  # not 12: graph 1's 4 MiB are graph 0's tangents
    # the logits the loop dropped are gone from graph 1's backward, not from its forward
    assert held[1] == (5 + 12) * MiB
    assert dropped[1] == max(5 + 4, 5 - 4 + 12) * MiB


def test_a_graph_run_several_times_holds_its_other_runs() -> None:
    block = Share(held=2 * MiB, forward=3 * MiB, backward=4 * MiB, grads=1 * MiB)
    head = Share(held=1 * MiB, forward=1 * MiB, backward=2 * MiB, grads=1 * MiB)
    got = step_estimates([block, head], [3, 1], [0, 0])
    assert got == [(4 + 2 * 2 + 1) * MiB, (3 * 2 + 2) * MiB]


def test_output_watch_counts_the_watched_outputs_gone() -> None:
    logits, other = torch.zeros(1024), torch.zeros(256)
    watch = OutputWatch()
    watch.add([logits, other], {((1024,), torch.float32): 4096})  # `other` is not watched
    earlier = watch.snapshot()
    assert earlier.dropped() == 0
    del logits
    assert earlier.dropped() == 4096
    watch.add([torch.zeros(8)], {((1024,), torch.float32): 4096})  # no output of the size: nothing
    assert watch.loose == 4096
