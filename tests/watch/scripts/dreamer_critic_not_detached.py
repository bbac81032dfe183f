# Dreamer by hand (NM512/dreamerv3-torch models.py: WorldModel._train, ImagBehavior._train; tools.Optimizer and
# tools.RequiresGrad): a world model, an actor trained through imagined rollouts of the world model (its parameters'
# requires_grad off), a critic, three optimizers stepped by one helper whose backward every loss goes through. The
# critic's loss reads the imagined features without `.detach()`: its backward reaches the actor's graph, which the
# actor's backward freed (meant: `value(imag_feat[:-1].detach())`).
import torch
from torch import nn


class RequiresGrad:
    def __init__(self, model):
        self._model = model

    def __enter__(self):
        self._model.requires_grad_(requires_grad=True)

    def __exit__(self, *args):
        self._model.requires_grad_(requires_grad=False)


class Optimizer:
    def __init__(self, params, lr):
        self._opt = torch.optim.Adam(params, lr=lr, eps=1e-8)

    def __call__(self, loss, params, retain_graph=True):
        self._opt.zero_grad()
        loss.backward(retain_graph=retain_graph)
        torch.nn.utils.clip_grad_norm_(params, 100.0)
        self._opt.step()
        self._opt.zero_grad()
        return loss.item()


torch.manual_seed(0)
wm = nn.ModuleDict({"encoder": nn.Linear(4, 8), "img": nn.GRUCell(2, 8), "obs": nn.Linear(8, 4),
                   "rew": nn.Linear(8, 1)})
actor = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
value, slow_value = nn.Linear(8, 1), nn.Linear(8, 1)
slow_value.load_state_dict(value.state_dict())
agent = nn.ModuleDict({"wm": wm, "actor": actor, "value": value})
agent.requires_grad_(False)
model_opt, actor_opt, value_opt = Optimizer(wm.parameters(), 6e-4), Optimizer(actor.parameters(), 8e-5), \
    Optimizer(value.parameters(), 8e-5)
for step in range(4):
    obs, act = torch.randn(3, 5, 4), torch.randn(3, 5, 2)
    with RequiresGrad(wm):
        h, posts = torch.zeros(3, 8), []
        for t in range(5):
            h = wm["img"](act[:, t], h) + wm["encoder"](obs[:, t])
            posts.append(h)
        post = torch.stack(posts, 1)
        model_loss = ((wm["obs"](post) - obs) ** 2).mean() + wm["rew"](post).pow(2).mean()
        model_opt(model_loss, wm.parameters())
    with RequiresGrad(actor):
        feat = post.detach().reshape(-1, 8)
        feats = [feat]
        for _ in range(3):
            feat = wm["img"](torch.tanh(actor(feat)), feat)
            feats.append(feat)
        imag_feat = torch.stack(feats)
        target = wm["rew"](imag_feat[:-1]) + 0.99 * slow_value(imag_feat[1:])
        actor_loss = -target.mean()
    with RequiresGrad(value):
        v = value(imag_feat[:-1])
        value_loss = ((v - target.detach()) ** 2).mean()
    with RequiresGrad(agent):
        actor_opt(actor_loss, actor.parameters(), retain_graph=False)
        value_opt(value_loss, value.parameters(), retain_graph=False)
    for s, d in zip(value.parameters(), slow_value.parameters()):
        d.data = 0.02 * s.data + 0.98 * d.data
    print(f"step {step}: model {model_loss.item():.6f} actor {actor_loss.item():.6f} value {value_loss.item():.6f}")
print("weights", repr(torch.cat([p.flatten() for p in agent.parameters()]).double().sum().item()))
