"""Graph pictures: bounded whatever the graph's size, and never holding up the error for long."""
import os
import re
import shutil
import sys
import time

import pytest
import torch

from safeloop import CarriedGraphError, Trainer
from safeloop.guard import render

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")


def recurrent_graph(steps: int):
    """An RNN-like chain: every step reads the shared weight; returns the loss and the node in the middle."""
    w = torch.randn(4, 4, requires_grad=True)
    h = torch.zeros(1, 4)
    middle = None
    for i in range(steps):
        h = torch.tanh(h @ w + 1)
        if i == steps // 2:
            middle = h.grad_fn
    return h.pow(2).mean(), middle


def all_nodes(root) -> set:
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
    return seen


def test_a_graph_of_thousands_of_nodes_draws_the_offending_part_and_counts_the_rest():
    loss, middle = recurrent_graph(2000)
    total = len(all_nodes(loss.grad_fn))
    assert total > 6000
    t0 = time.process_time()  # this process's CPU time (0.03 s here): a loaded machine's waits are not counted
    dot = render.dot_source(loss.grad_fn, [middle], holder="self.hidden")
    assert time.process_time() - t0 < 2
    drawn = re.findall(r'^  n\d+ \[label="([^"]+)"', dot, re.M)
    assert len(drawn) <= render.DRAWN
    assert re.search(r'label="TanhBackward0", style=filled, fillcolor="#ff9999"', dot)
    assert 'holder [label="held by self.hidden", shape=note]' in dot
    assert "MeanBackward0" in drawn  # the loss, and the path to the offending node
    counted = sum(int(n) for n in re.findall(r'label="(\d+) more nodes?', dot))
    assert len(drawn) + counted == total  # every node not drawn is counted once
    assert re.search(r'label="\d+ more nodes \(\d+ on the path\)"', dot)


@needs_dot
def test_real_dot_draws_a_thousands_node_graph_in_moments(tmp_path):
    loss, middle = recurrent_graph(2000)
    t0 = time.perf_counter()
    picture = render.render(loss.grad_fn, tmp_path / "step2_loss.dot", [middle], "self.hidden")
    assert picture == str(tmp_path / "step2_loss.svg")
    assert time.perf_counter() - t0 < render.DOT_TIMEOUT_S
    assert "TanhBackward0" in (tmp_path / "step2_loss.svg").read_text()


def test_a_dot_that_hangs_is_stopped_and_the_dot_file_is_kept(tmp_path, monkeypatch):
    slow = tmp_path / "bin" / "dot"
    slow.parent.mkdir()
    slow.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    slow.chmod(0o755)
    monkeypatch.setenv("PATH", f"{slow.parent}:{os.environ['PATH']}")
    loss, middle = recurrent_graph(50)
    t0 = time.perf_counter()
    picture = render.render(loss.grad_fn, tmp_path / "g" / "step1_loss.dot", [middle], timeout=1)
    assert time.perf_counter() - t0 < 10
    assert picture == str(tmp_path / "g" / "step1_loss.dot")
    assert "fillcolor" in (tmp_path / "g" / "step1_loss.dot").read_text()
    assert not (tmp_path / "g" / "step1_loss.svg").exists()


class CarriesLongHidden(Trainer):
    """Carries a hidden state made of 1,500 nodes per step: the classic missing detach, at RNN scale."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = torch.zeros(3, 4)

    def training_step(self, batch):
        for _ in range(500):
            self.hidden = torch.tanh(self.model(batch) + self.hidden)
        return self.hidden.pow(2).mean()


def test_a_carried_graph_of_thousands_of_nodes_is_reported_promptly_with_its_picture(tmp_path):
    trainer = CarriesLongHidden(model=torch.nn.Linear(4, 4), train_data=[torch.randn(3, 4)] * 4, max_steps=4,
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu", progress=False,
                                loggers=(), run_dir=tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(CarriedGraphError, match=r"step 2.*held by `self.hidden`") as info:
        trainer.fit()
    assert time.perf_counter() - t0 < 15
    picture = info.value.picture
    assert picture.endswith(".svg" if shutil.which("dot") else ".dot")
    dot = (tmp_path / "graphs" / "step2_loss.dot").read_text()
    assert len(re.findall(r"^  n\d+ \[label=", dot, re.M)) <= render.DRAWN
    assert 'held by self.hidden' in dot
