"""Snapshot: what a failed step's undo puts back, also after the optimizer's tensors were replaced."""
import torch

from safeloop.step import Snapshot


def adam_after_one_step(model):
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return opt


def state_of(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for i, p in enumerate(model.parameters())}
    return params, state


def assert_same(before, after):
    (pa, sa), (pb, sb) = before, after
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        assert all(torch.equal(sa[i][k], sb[i][k]) if torch.is_tensor(sa[i][k]) else sa[i][k] == sb[i][k]
                   for k in sa[i])


def update(model, opt):
    model(torch.randn(5, 3)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def assert_undone(model, opt, snap):
    """take, one more update, restore: parameters and state are as before the update."""
    before = state_of(model, opt)
    snap.take()
    update(model, opt)
    snap.restore()
    assert_same(before, state_of(model, opt))


def test_restore_puts_back_parameters_and_state_after_several_takes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = adam_after_one_step(model)
    snap = Snapshot(opt)
    for _ in range(3):  # the buffers are reused step after step
        snap.take()
        update(model, opt)
    assert_undone(model, opt, snap)


def test_replaced_state_tensors_and_parameter_data_are_seen():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = adam_after_one_step(model)
    snap = Snapshot(opt)
    snap.take()
    update(model, opt)
    # between steps, code outside the optimizer swaps tensors (a state reset, p.data = ...) and adds a
    # value that is not a tensor where there were only tensors
    opt.state[model.weight]["exp_avg"] = torch.full_like(model.weight, 0.5)
    model.bias.data = torch.tensor([3.0, -3.0])
    opt.state[model.bias]["resets"] = 1
    assert_undone(model, opt, snap)


def test_state_made_for_a_parameter_after_a_take_is_seen():
    """The bias has no gradient in the first update, so no state; it gets some in the second."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snap = Snapshot(opt)
    snap.take()
    (model.weight.sum() ** 2).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert model.bias not in opt.state
    update(model, opt)  # the bias's momentum buffer is made here
    assert_undone(model, opt, snap)


def test_non_contiguous_and_mixed_dtype_tensors_are_kept():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3).t())  # not contiguous
    half = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    opt = torch.optim.SGD([weight, half], lr=0.1, momentum=0.9)

    def step():
        ((weight.sum(1) * half.float()).sum() ** 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    snap = Snapshot(opt)
    values = [weight.detach().clone(), half.detach().clone(),
              opt.state[weight]["momentum_buffer"].clone(), opt.state[half]["momentum_buffer"].clone()]
    snap.take()
    step()
    snap.restore()
    now = [weight, half, opt.state[weight]["momentum_buffer"], opt.state[half]["momentum_buffer"]]
    assert all(torch.equal(a, b) for a, b in zip(values, now))
