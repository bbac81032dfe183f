"""Deep equilibrium models: locuslab/deq at commit 1fb7059d6d89bb26d16da80ab9489dcc73fc5472,
MDEQ-Vision/lib/models/mdeq_core.py (``MDEQNet._forward``), lib/solvers.py (``anderson``), lib/jacobian.py
(``jac_loss_estimate``), MDEQ-Vision/lib/core/cls_function.py (``train``) and README.md (the ``Layer`` of step 1).

The forward runs the layer to its fixed point under ``no_grad`` with Anderson acceleration (``.item()``
residuals, the best iterate kept as ``clone().detach()``), then applies the layer once more to the fixed point
made to require grad (``z1.requires_grad_()``). A tensor hook on that output replaces its gradient by the
solution of the backward fixed point ``y = y J + grad``, found by the same solver whose function calls
``autograd.grad(new_z1, z1, y, retain_graph=True)`` inside the backward; the hook removes itself through the
handle it was stored in (``self.hook.remove()``). For its first ``pretrain_steps`` (read from the scheduler's
``_step_count``) the model is unrolled instead. A Jacobian penalty, a Hutchinson estimate by
``autograd.grad(create_graph=True)`` on ``randn`` vectors, is drawn with probability ``JAC_LOSS_FREQ``
(``torch.rand([]).item()``), with the forward threshold jittered by ``torch.randint``, and its weight scheduled
from ``train_global_steps``, which the source moves once per epoch. ``clip_grad_norm_``, a per-step cosine
schedule.

Changes for a seconds-long test: a ``tanh(W z + U x)`` layer on 8x2 states (MDEQ's multiscale residual
blocks), 2 epochs of 3 batches of 8; ``torch.solve`` (removed from torch) as ``torch.linalg.solve``;
``torch.cuda.synchronize()`` left out (CPU); the logging and accuracy left out.

The port is automatic: the step's settings drawn in ``training_step`` as the source draws them, ``loss +
factor * jac_loss`` returned, ``grad_clip``, the scheduler stepped per step (``interval: step``).
"""
import numpy as np
import pytest
import torch
import torch.nn as nn
from torch import autograd

from safeloop import Trainer

from .harness import checks, compare, fixed, labelled

PER_EPOCH, EPOCHS, D, L, CLASSES = 3, 2, 8, 2, 3
PRETRAIN_STEPS, F_THRES, B_THRES, RAND_F_THRES_DELTA, CLIP = 2, 8, 8, 2, 1.0
PRETRAIN_JAC_LOSS_WEIGHT, JAC_LOSS_WEIGHT, JAC_LOSS_FREQ, JAC_INCREMENTAL, JAC_STOP_EPOCH = 0.5, 0.4, 0.5, 2, 10


# -- lib/solvers.py -----------------------------------------------------------------------------------------
def anderson(f, x0, m=6, lam=1e-4, threshold=50, eps=1e-3, stop_mode='rel', beta=1.0, **kwargs):
    """ Anderson acceleration for fixed point iteration. """
    bsz, d, L = x0.shape
    alternative_mode = 'rel' if stop_mode == 'abs' else 'abs'
    X = torch.zeros(bsz, m, d*L, dtype=x0.dtype, device=x0.device)
    F = torch.zeros(bsz, m, d*L, dtype=x0.dtype, device=x0.device)
    X[:,0], F[:,0] = x0.reshape(bsz, -1), f(x0).reshape(bsz, -1)
    X[:,1], F[:,1] = F[:,0], f(F[:,0].reshape_as(x0)).reshape(bsz, -1)

    H = torch.zeros(bsz, m+1, m+1, dtype=x0.dtype, device=x0.device)
    H[:,0,1:] = H[:,1:,0] = 1
    y = torch.zeros(bsz, m+1, 1, dtype=x0.dtype, device=x0.device)
    y[:,0] = 1

    trace_dict = {'abs': [],
                  'rel': []}
    lowest_dict = {'abs': 1e8,
                   'rel': 1e8}
    lowest_step_dict = {'abs': 0,
                        'rel': 0}

    for k in range(2, threshold):
        n = min(k, m)
        G = F[:,:n]-X[:,:n]
        H[:,1:n+1,1:n+1] = torch.bmm(G,G.transpose(1,2)) + lam*torch.eye(n, dtype=x0.dtype,device=x0.device)[None]
        alpha = torch.linalg.solve(H[:,:n+1,:n+1], y[:,:n+1])[:, 1:n+1, 0]   # (bsz x n)

        X[:,k%m] = beta * (alpha[:,None] @ F[:,:n])[:,0] + (1-beta)*(alpha[:,None] @ X[:,:n])[:,0]
        F[:,k%m] = f(X[:,k%m].reshape_as(x0)).reshape(bsz, -1)
        gx = (F[:,k%m] - X[:,k%m]).view_as(x0)
        abs_diff = gx.norm().item()
        rel_diff = abs_diff / (1e-5 + F[:,k%m].norm().item())
        diff_dict = {'abs': abs_diff,
                     'rel': rel_diff}
        trace_dict['abs'].append(abs_diff)
        trace_dict['rel'].append(rel_diff)

        for mode in ['rel', 'abs']:
            if diff_dict[mode] < lowest_dict[mode]:
                if mode == stop_mode:
                    lowest_xest, lowest_gx =  X[:,k%m].view_as(x0).clone().detach(), gx.clone().detach()
                lowest_dict[mode] = diff_dict[mode]
                lowest_step_dict[mode] = k

        if trace_dict[stop_mode][-1] < eps:
            for _ in range(threshold-1-k):
                trace_dict[stop_mode].append(lowest_dict[stop_mode])
                trace_dict[alternative_mode].append(lowest_dict[alternative_mode])
            break

    out = {"result": lowest_xest,
           "lowest": lowest_dict[stop_mode],
           "nstep": lowest_step_dict[stop_mode],
           "prot_break": False,
           "abs_trace": trace_dict['abs'],
           "rel_trace": trace_dict['rel'],
           "eps": eps,
           "threshold": threshold}
    X = F = None
    return out


# -- lib/jacobian.py ----------------------------------------------------------------------------------------
def jac_loss_estimate(f0, z0, vecs=2, create_graph=True):
    """Estimating tr(J^TJ)=tr(JJ^T) via Hutchinson estimator"""
    vecs = vecs
    result = 0
    for i in range(vecs):
        v = torch.randn(*z0.shape).to(z0)
        vJ = torch.autograd.grad(f0, z0, v, retain_graph=True, create_graph=create_graph)[0]
        result += vJ.norm()**2
    return result / vecs / np.prod(z0.shape)


# -- README.md (step 1) and MDEQ-Vision/lib/models/mdeq_core.py ---------------------------------------------
class Layer(nn.Module):
    def __init__(self, d, inp):
        super().__init__()
        self.w = nn.Linear(d, d, bias=False)
        self.u = nn.Linear(inp, d)
        with torch.no_grad():
            self.w.weight.mul_(0.5)

    def forward(self, z, x):
        return torch.tanh(self.w(z.transpose(1, 2)) + self.u(x)[:, None]).transpose(1, 2)


class DEQNet(nn.Module):
    def __init__(self, inp=4):
        super().__init__()
        self.fullstage = Layer(D, inp)
        self.head = nn.Linear(D * L, CLASSES)
        self.f_solver = self.b_solver = anderson
        self.stop_mode = 'rel'
        self.pretrain_steps = PRETRAIN_STEPS
        self.num_layers = 3
        self.hook = None

    def _forward(self, x, train_step=-1, compute_jac_loss=True, spectral_radius_mode=False, **kwargs):
        f_thres = kwargs.get('f_thres', F_THRES)
        b_thres = kwargs.get('b_thres', B_THRES)
        bsz = x.shape[0]
        z1 = torch.zeros(bsz, D, L).to(x)
        func = lambda z: self.fullstage(z, x)

        jac_loss = torch.tensor(0.0).to(x)
        sradius = torch.zeros(bsz, 1).to(x)
        deq_mode = (train_step < 0) or (train_step >= self.pretrain_steps)

        # Multiscale Deep Equilibrium!
        if not deq_mode:
            for layer_ind in range(self.num_layers):
                z1 = func(z1)
            new_z1 = z1

            if self.training:
                if compute_jac_loss:
                    z2 = z1.clone().detach().requires_grad_()
                    new_z2 = func(z2)
                    jac_loss = jac_loss_estimate(new_z2, z2)
        else:
            with torch.no_grad():
                result = self.f_solver(func, z1, threshold=f_thres, stop_mode=self.stop_mode, name="forward")
                z1 = result['result']
            new_z1 = z1

            if self.training:
                new_z1 = func(z1.requires_grad_())
                if compute_jac_loss:
                    jac_loss = jac_loss_estimate(new_z1, z1)

                def backward_hook(grad):
                    if self.hook is not None:
                        self.hook.remove()
                    result = self.b_solver(lambda y: autograd.grad(new_z1, z1, y, retain_graph=True)[0] + grad,
                                           torch.zeros_like(grad), threshold=b_thres, stop_mode=self.stop_mode,
                                           name="backward")
                    return result['result']
                self.hook = new_z1.register_hook(backward_hook)

        return new_z1, jac_loss.view(1,-1), sradius.view(-1,1)

    def forward(self, x, train_step=-1, **kwargs):
        y, jac_loss, sradius = self._forward(x, train_step, **kwargs)
        return self.head(y.flatten(1)), jac_loss, sradius


# -- MDEQ-Vision/lib/core/cls_function.py -------------------------------------------------------------------
def make_optimizer(model):
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, EPOCHS * PER_EPOCH, eta_min=1e-4)
    return optimizer, lr_scheduler


def step_settings(global_steps, epoch):
    deq_steps = global_steps - PRETRAIN_STEPS
    if deq_steps < 0:
        factor = PRETRAIN_JAC_LOSS_WEIGHT
    elif epoch >= JAC_STOP_EPOCH:
        factor = 0
    else:
        factor = JAC_LOSS_WEIGHT + 0.1 * (deq_steps // JAC_INCREMENTAL)
    compute_jac_loss = (torch.rand([]).item() < JAC_LOSS_FREQ) and (factor > 0)
    delta_f_thres = (torch.randint(-RAND_F_THRES_DELTA,2,[]).item()
                     if (RAND_F_THRES_DELTA > 0 and compute_jac_loss) else 0)
    return factor, compute_jac_loss, F_THRES + delta_f_thres, B_THRES


def train(train_loader, model, criterion, optimizer, lr_scheduler, epoch, writer_dict):
    global_steps = writer_dict['train_global_steps']
    model.train()
    for i, (input, target) in enumerate(train_loader):
        factor, compute_jac_loss, f_thres, b_thres = step_settings(global_steps, epoch)
        output, jac_loss, _ = model(input, train_step=(lr_scheduler._step_count-1),
                                    compute_jac_loss=compute_jac_loss,
                                    f_thres=f_thres, b_thres=b_thres)
        loss = criterion(output, target)
        jac_loss = jac_loss.mean()

        # compute gradient and do update step
        optimizer.zero_grad()
        if factor > 0:
            (loss + factor*jac_loss).backward()
        else:
            loss.backward()
        if CLIP > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        lr_scheduler.step()
        writer_dict['train_global_steps'] = global_steps + 1


def deq_hand(model, data):
    optimizer, lr_scheduler = make_optimizer(model)
    writer_dict = {'train_global_steps': 0}
    for epoch in range(EPOCHS):
        train(data, model, nn.CrossEntropyLoss(), optimizer, lr_scheduler, epoch, writer_dict)


class DEQTrainer(Trainer):
    def configure_optimizers(self):
        optimizer, self.lr_scheduler = make_optimizer(self.model)
        self.writer_dict = {'train_global_steps': 0}
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.lr_scheduler, "interval": "step"}}

    def on_epoch_start(self):
        self.global_steps = self.writer_dict['train_global_steps']

    def training_step(self, batch):
        input, target = batch
        factor, compute_jac_loss, f_thres, b_thres = step_settings(self.global_steps, self.state.epoch)
        output, jac_loss, _ = self.model(input, train_step=(self.lr_scheduler._step_count-1),
                                         compute_jac_loss=compute_jac_loss, f_thres=f_thres, b_thres=b_thres)
        loss = nn.functional.cross_entropy(output, target)
        jac_loss = jac_loss.mean()
        self.writer_dict['train_global_steps'] = self.global_steps + 1
        return loss + factor * jac_loss if factor > 0 else loss


@pytest.mark.parametrize("check", checks())
def test_deq_with_a_self_removing_implicit_backward_hook(check):
    compare(DEQNet, deq_hand, DEQTrainer, fixed(labelled(PER_EPOCH)), check, steps=EPOCHS * PER_EPOCH,
            max_epochs=EPOCHS, grad_clip=CLIP)
