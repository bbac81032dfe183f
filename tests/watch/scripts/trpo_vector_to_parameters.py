# TRPO's natural-gradient step (ikostrikov/pytorch-trpo, trpo.py conjugate_gradients, linesearch, trpo_step; main.py
# get_loss, get_kl) with the flat parameters read and written by torch.nn.utils' parameters_to_vector and
# vector_to_parameters, as other TRPO ports do: no optimizer, Fisher-vector products as Hessian-vector products of
# the KL (torch.autograd.grad with create_graph=True, then again), a line search evaluating under torch.no_grad().
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

torch.manual_seed(0)
policy = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
params = list(policy.parameters())


def conjugate_gradients(Avp, b, nsteps, residual_tol=1e-10):
    x, r, p = torch.zeros(b.size()), b.clone(), b.clone()
    rdotr = torch.dot(r, r)
    for _ in range(nsteps):
        _Avp = Avp(p)
        alpha = rdotr / torch.dot(p, _Avp)
        x += alpha * p
        r -= alpha * _Avp
        new_rdotr = torch.dot(r, r)
        p = r + new_rdotr / rdotr * p
        rdotr = new_rdotr
        if rdotr < residual_tol:
            break
    return x


for update in range(4):
    states, actions, advantages = torch.randn(32, 3), torch.randint(0, 2, (32,)), torch.randn(32)
    fixed_log_prob = torch.log_softmax(policy(states), 1).gather(1, actions[:, None]).squeeze(1).detach()

    def get_loss(volatile=False):
        with torch.set_grad_enabled(not volatile):
            log_prob = torch.log_softmax(policy(states), 1).gather(1, actions[:, None]).squeeze(1)
            return (-advantages * torch.exp(log_prob - fixed_log_prob)).mean()

    def Fvp(v):
        logp1 = torch.log_softmax(policy(states), 1)
        kl = (logp1.detach().exp() * (logp1.detach() - logp1)).sum(1).mean()
        grads = torch.autograd.grad(kl, params, create_graph=True)
        kl_v = (torch.cat([g.view(-1) for g in grads]) * v).sum()
        return torch.cat([g.contiguous().view(-1) for g in torch.autograd.grad(kl_v, params)]).data + v * 0.1

    loss = get_loss()
    loss_grad = torch.cat([g.view(-1) for g in torch.autograd.grad(loss, params)]).data
    stepdir = conjugate_gradients(Fvp, -loss_grad, 10)
    shs = 0.5 * (stepdir * Fvp(stepdir)).sum(0, keepdim=True)
    fullstep = stepdir / torch.sqrt(shs / 0.01)[0]
    prev_params, fval = parameters_to_vector(params).detach(), get_loss(True).data
    for stepfrac in 0.5 ** torch.arange(10.):
        vector_to_parameters(prev_params + stepfrac * fullstep, params)
        if (fval - get_loss(True).data).item() > 0:
            break
    else:
        vector_to_parameters(prev_params, params)
    print(update, f"{loss.item():.6f} {get_loss(True).item():.6f}")
