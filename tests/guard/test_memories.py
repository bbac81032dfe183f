"""States and queues kept across steps: a Neural Turing Machine's state carried whole (loudinthecloud/pytorch-ntm,
ntm/ntm.py: ``(reads, (h, c), head_weights)``, a tuple holding lists and a tuple), its memory written by every
forward (ntm/memory.py: ``self.prev_mem = self.memory``, then ``self.memory = self.prev_mem * (1 - erase) + add``),
and SwAV's queue of past embeddings (facebookresearch/swav, main_swav.py) written outside ``torch.no_grad()``."""
import re
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


class Memory(nn.Module):
    """pytorch-ntm's NTMMemory, reduced: one read and one write per forward."""

    def __init__(self):
        super().__init__()
        self.memory = self.prev_mem = torch.zeros(2, 6, 5)

    def write(self, w, erase, add):
        self.prev_mem = self.memory
        self.memory = self.prev_mem * (1 - w.unsqueeze(-1) * erase.unsqueeze(1)) + w.unsqueeze(-1) * add.unsqueeze(1)


class NTM(nn.Module):
    """An LSTM controller reading and writing ``memory``, its state ``([read], (h, c))`` kept on the module."""

    def __init__(self):
        super().__init__()
        self.memory, self.controller, self.head = Memory(), nn.LSTMCell(4 + 5, 8), nn.Linear(8, 6 + 5 + 5)
        self.previous_state = ([torch.zeros(2, 5)], (torch.zeros(2, 8), torch.zeros(2, 8)))

    def forward(self, x):
        reads, state = self.previous_state
        h, c = self.controller(torch.cat([x, *reads], 1), state)
        w, erase, add = self.head(h).split([6, 5, 5], 1)
        w = w.softmax(1)
        read = (w.unsqueeze(1) @ self.memory.memory).squeeze(1)
        self.memory.write(w, erase.sigmoid(), add)
        self.previous_state = ([read], (h, c))
        return read


def train_ntm(fixes: int, time_steps: int = 3) -> None:
    """Three batches of ``time_steps`` time steps, the memory and the state carried from batch to batch
    (``init_sequence`` called once, before the loop); ``fixes``: how many of the guard's first fixes are applied, in
    its order."""
    torch.manual_seed(0)
    net = NTM()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    guard = GraphGuard(net, opt)
    for _ in range(3):
        with guard.step():
            for x in torch.randn(time_steps, 2, 4):
                out = net(x)
            guard.backward(out.square().mean())
            opt.step()
            opt.zero_grad()
            if fixes >= 1:
                net.memory.memory = net.memory.memory.detach()
            if fixes >= 2:
                net.previous_state = ([t.detach() for t in net.previous_state[0]],
                                      tuple(t.detach() for t in net.previous_state[1]))


@pytest.mark.parametrize("time_steps", [3, 1])
def test_a_memory_written_by_every_forward_is_named_by_its_latest_value_then_the_state_beside_it(time_steps):
    """Each forward sets ``prev_mem`` to the last ``memory`` and writes ``memory`` again: what carries the last batch's
    graph to the next is ``memory``, whose fix applied as written leaves the controller's state, named next, with its
    own fix; both applied, the loop trains quiet. The model is named as the loop's variable holding it (``net``).
    With one time step a batch, ``prev_mem`` holds the last batch's ``memory`` itself: detaching it would not help
    (the next write sets it again), and ``memory`` is still the one named."""
    detach = re.escape("(`net.memory.memory = net.memory.memory.detach()`)")
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\).*held by `net.memory.memory`.*" + detach):
        train_ntm(fixes=0, time_steps=time_steps)
    with pytest.raises(CarriedGraphError, match=r"held by `net.previous_state\[0\]\[0\]`.*" + re.escape(
            "(`net.previous_state = ([t.detach() for t in net.previous_state[0]], tuple(t.detach() for t in "
            "net.previous_state[1]))`)")):
        train_ntm(fixes=1, time_steps=time_steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_ntm(fixes=2, time_steps=time_steps)


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


class Codebook(nn.Module):
    """VQ-VAE-2's EMA codebook (rosinality/vq-vae-2-pytorch, vqvae.py ``Quantize``), its buffers written in the training
    forward from the batch's encodings; ``no_grad``: the writes under ``torch.no_grad()`` (as the fix says)."""

    def __init__(self, no_grad: bool):
        super().__init__()
        self.no_grad = no_grad
        self.register_buffer("embed", torch.randn(2, 4))
        self.register_buffer("embed_avg", self.embed.clone())

    def forward(self, flatten):
        index = (flatten @ self.embed).argmax(1)
        quantize = self.embed.T[index]
        with torch.no_grad() if self.no_grad else torch.enable_grad():
            self.embed_avg.mul_(0.9).add_(flatten.T @ nn.functional.one_hot(index, 4).float(), alpha=0.1)
            self.embed.copy_(self.embed_avg)
        return flatten + (quantize - flatten).detach()  # the codes reach the loss detached only


@pytest.mark.parametrize("no_grad", [False, True])
def test_a_buffer_written_with_graphs_in_forward_is_told_to_write_it_without_a_graph(no_grad):
    """No loss reaches the codebook's graphs, which pile up: the warning names the buffer and the other one holding a
    graph, and the writes to make without a graph, not a loss to store as ``.item()``; applied, nothing is said."""
    torch.manual_seed(0)
    enc, book = nn.Linear(3, 2), Codebook(no_grad)
    model = nn.ModuleDict({"enc": enc, "book": book})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, check="always")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            with guard.step():
                guard.backward(book(enc(torch.randn(5, 3))).square().mean())
                opt.step()
                opt.zero_grad()
    said = [str(w.message) for w in caught if issubclass(w.category, GraphLeakWarning)]
    if no_grad:
        assert said == []
    else:
        assert len(said) == 1 and re.search(r"held by `model.book.embed`.*a buffer of a module .*written with values "
                                            r"that have a graph \(and so are `model.book.embed_avg`\).*To fix: write "
                                            r"it and the other buffers named under `torch.no_grad\(\)`", said[0]), said
        assert "loss.item()" not in said[0]


def test_a_running_mean_copied_over_with_its_graph_is_named_and_told_to_detach_what_is_copied():
    """StyleGAN2-ADA's path-length mean (NVlabs/stylegan2-ada-pytorch, training/loss.py) written back with
    `pl_mean.copy_(new)` without `.detach()`: the next penalty goes back through the last one's freed graph. Named as
    the running mean, which the copy wrote over, not as the value lerped from it in this step."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model)
    pl_mean = torch.zeros([])
    with pytest.raises(CarriedGraphError, match=r"held by `local pl_mean`.*To fix: detach what is copied into "
                                                r"`pl_mean` where it is written \(`pl_mean.copy_\(x.detach\(\)\)`\)"):
        for _ in range(3):
            with guard.step():
                lengths = model(torch.randn(4, 3)).square().sum(1).sqrt()
                new = pl_mean.lerp(lengths.mean(), 0.01)
                pl_mean.copy_(new)
                guard.backward((lengths - new).square().mean())
                opt.step()
                opt.zero_grad()


@pytest.mark.parametrize("no_grad", [False, True])
def test_shadow_copies_in_a_list_written_outside_no_grad_warn_once_naming_them(no_grad):
    """diffusers' EMAModel (src/diffusers/training_utils.py) keeps detached clones of the parameters in a plain list;
    its step() without @torch.no_grad() writes them in place from the parameters, and their graph grows by every step,
    made by no loss: warned once, naming the list's tensors and the write to make under torch.no_grad()."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, check="always")
    shadow = [p.clone().detach() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            with guard.step():
                guard.backward(model(torch.randn(4, 3)).square().mean())
                opt.step()
                opt.zero_grad()
                with torch.no_grad() if no_grad else torch.enable_grad():
                    for s, p in zip(shadow, model.parameters()):
                        s.sub_(0.1 * (s - p))
    said = [str(w.message) for w in caught if issubclass(w.category, GraphLeakWarning)]
    if no_grad:
        assert said == []
    else:
        assert len(said) == 1 and re.search(r"the tensors `local shadow\[0\]`, `local shadow\[1\]` hold an autograd "
                                            r"graph: written in place outside torch.no_grad\(\).*To fix: make that "
                                            r"write under `torch.no_grad\(\)`", said[0]), said
class KeyValueCache:
    """transformers' DynamicCache (src/transformers/cache_utils.py): a list of keys and one of values per layer, which
    each forward extends (here: a window of the last 4 positions)."""

    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def update(self, key, value, layer):
        if len(self.key_cache) <= layer:
            self.key_cache.append(key)
            self.value_cache.append(value)
        else:
            self.key_cache[layer] = torch.cat([self.key_cache[layer], key], dim=-2)[..., -4:, :]
            self.value_cache[layer] = torch.cat([self.value_cache[layer], value], dim=-2)[..., -4:, :]
        return self.key_cache[layer], self.value_cache[layer]


def train_with_cache(fixed: bool) -> None:
    """Three segments of attention over a key/value cache carried across steps; ``fixed``: the fix applied."""
    torch.manual_seed(0)
    q, k, v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    opt = torch.optim.SGD([*q.parameters(), *k.parameters(), *v.parameters()], lr=0.1)
    guard = GraphGuard(q)
    cache = KeyValueCache()
    for _ in range(3):
        with guard.step():
            x = torch.randn(2, 3, 8)
            keys, values = cache.update(k(x), v(x), 0)
            out = torch.softmax(q(x) @ keys.transpose(-1, -2), -1) @ values  # the shape of this segment's k(x)
            guard.backward((out - x).square().mean())
            opt.step()
            opt.zero_grad()
            if fixed:  # the fix
                cache.value_cache = [t.detach() for t in cache.value_cache]
                cache.key_cache = [t.detach() for t in cache.key_cache]


def test_a_cache_object_carried_is_named_by_its_lists_not_by_the_output_made_from_them():
    """The output this step made from the cache has the shape of the node the last segment made; the cache's entry,
    extended by this step, does not. The cache's list is named, and both lists are detached: the fix of one alone
    would stop the next run at the other."""
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\).*held by `cache.value_cache\[0\]`.*"
                       + re.escape("(`cache.value_cache = [t.detach() for t in cache.value_cache]; cache.key_cache = "
                                   "[t.detach() for t in cache.key_cache]`)")):
        train_with_cache(fixed=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_with_cache(fixed=True)
