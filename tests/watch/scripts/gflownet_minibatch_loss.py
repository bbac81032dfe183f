# GFlowNet trajectory balance as Emmanuel Bengio's GFlowNet tutorial writes it (colab 1fUMwgu2OhYpQagpzU5mhe9_Esib3Q2VR,
# the smiley faces): each episode's loss added to `minibatch_loss`, which one backward and one update take every
# `update_freq` episodes before the sum starts again; logZ a Parameter in a param group of its own, with a larger
# learning rate (GFNOrg/torchgfn tutorials/examples/train_hypergrid_simple.py).
import torch
from torch import nn
from torch.distributions.categorical import Categorical

sorted_keys = ["a", "b", "c", "d", "e", "f"]


def face_to_tensor(face):
    return torch.tensor([i in face for i in sorted_keys]).float()


def face_reward(face):
    return 1.0 + 2.0 * ("a" in face) + ("b" in face and "c" in face)


class TBModel(nn.Module):
    def __init__(self, num_hid):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(6, num_hid), nn.LeakyReLU(), nn.Linear(num_hid, 12))
        self.logZ = nn.Parameter(torch.ones(1))

    def forward(self, x):
        logits = self.mlp(x)
        P_F = logits[..., :6] * (1 - x) + x * -100
        P_B = logits[..., 6:] * x + (1 - x) * -100
        return P_F, P_B


torch.manual_seed(0)
model = TBModel(16)
opt = torch.optim.Adam([{"params": model.mlp.parameters(), "lr": 3e-4}, {"params": [model.logZ], "lr": 0.1}])
update_freq = 4
minibatch_loss = 0
for episode in range(9):
    state = []
    P_F_s, P_B_s = model(face_to_tensor(state))
    total_P_F = 0
    total_P_B = 0
    for t in range(3):
        cat = Categorical(logits=P_F_s)
        action = cat.sample()
        new_state = state + [sorted_keys[action]]
        total_P_F += cat.log_prob(action)
        if t == 2:
            reward = torch.tensor(face_reward(new_state)).float()
        P_F_s, P_B_s = model(face_to_tensor(new_state))
        total_P_B += Categorical(logits=P_B_s).log_prob(action)
        state = new_state
    loss = (model.logZ + total_P_F - torch.log(reward).clip(-20) - total_P_B).pow(2)
    minibatch_loss += loss
    if episode % update_freq == 0:
        print(episode, f"{minibatch_loss.item():.6f}")
        minibatch_loss.backward()
        opt.step()
        opt.zero_grad()
        minibatch_loss = 0
print(f"{model.logZ.item():.6f}")
