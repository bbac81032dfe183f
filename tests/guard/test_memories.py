"""States and queues kept across steps: a Neural Turing Machine's state carried whole (loudinthecloud/pytorch-ntm,
ntm/ntm.py: ``(reads, (h, c), head_weights)``, a tuple holding lists and a tuple) and SwAV's queue of past
embeddings (facebookresearch/swav, main_swav.py) written outside ``torch.no_grad()``."""
import warnings

import pytest
import torch
from torch import nn

from safeloop import CarriedGraphError, GraphGuard, GraphLeakWarning


def train_ntm_like(fixed: bool) -> None:
    """Three steps of an LSTM cell whose state is ``([read], (h, c))``, carried whole; ``fixed``: the fix applied."""
    torch.manual_seed(0)
    cell, head = nn.LSTMCell(3, 4), nn.Linear(4, 2)
    opt = torch.optim.SGD([*cell.parameters(), *head.parameters()], lr=0.1)
    guard = GraphGuard(cell)
    state = ([torch.zeros(2, 2)], (torch.zeros(2, 4), torch.zeros(2, 4)))
    for _ in range(3):
        with guard.step():
            h, c = cell(torch.randn(2, 3), state[1])
            state = ([head(h)], (h, c))
            guard.backward(state[0][0].square().mean())
            opt.step()
            opt.zero_grad()
            if fixed:
                state = ([t.detach() for t in state[0]], tuple(t.detach() for t in state[1]))  # the fix


def test_a_state_nested_in_a_tuple_is_detached_by_rebuilding_the_outer_tuple():
    """``state[1] = tuple(...)`` on a tuple raises TypeError: the fix rebuilds ``state`` as a whole, and applied as
    written it trains quiet."""
    with pytest.raises(CarriedGraphError) as caught:
        train_ntm_like(fixed=False)
    fix = caught.value.fixes[0]
    assert "`state = ([t.detach() for t in state[0]], tuple(t.detach() for t in state[1]))`" in fix, fix
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_ntm_like(fixed=True)


def test_a_queue_written_with_graphs_is_told_to_detach_what_is_written():
    """SwAV's queue shifted and filled outside ``torch.no_grad()``, read under it: no loss reaches its graphs, which
    pile up; the warning names the queue and the write to detach, not a loss to store as ``.item()``."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, check="always")
    queue = torch.zeros(8, 2)
    with pytest.warns(GraphLeakWarning, match=r"held by `local queue`.*detach what is written into `queue` where it "
                                              r"is written .*or write it under `torch.no_grad\(\)`"):
        for _ in range(5):
            with guard.step():
                emb = model(torch.randn(2, 3))
                with torch.no_grad():
                    target = (emb @ queue.T).softmax(1) @ queue
                queue[2:] = queue[:-2].clone()
                queue[:2] = emb
                guard.backward((emb - target).square().mean())
                opt.step()
                opt.zero_grad()
