# pymarl_qmix_episode_batch.py's QMIX with double Q's argmax taken on `mac_out` masked in place, as RLlib's port
# did (ray-project/ray, rllib/agents/qmix/qmix_policy.py QMixLoss, before `mac_out = mac_out.clone()  # issue 4742`):
# gather saved the slice `mac_out[:, :-1]` for the chosen actions' Q-values, and the mask writes into it before the
# backward. The error names `mac_out`, not `target_mac_out` (as large as the slice, masked before gather saved it).
import copy

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
n_agents, n_actions, obs_dim, state_dim, hidden, embed = 3, 4, 5, 6, 8, 8


class RNNAgent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + n_agents, hidden)
        self.rnn = nn.GRUCell(hidden, hidden)
        self.fc2 = nn.Linear(hidden, n_actions)

    def init_hidden(self):
        return self.fc1.weight.new(1, hidden).zero_()

    def forward(self, inputs, hidden_state):
        x = F.relu(self.fc1(inputs))
        h = self.rnn(x, hidden_state.reshape(-1, hidden))
        return self.fc2(h), h


class BasicMAC:
    def __init__(self):
        self.agent, self.hidden_states = RNNAgent(), None

    def forward(self, batch, t):
        bs = batch["obs"].shape[0]
        ids = torch.eye(n_agents).unsqueeze(0).expand(bs, -1, -1)
        inputs = torch.cat([batch["obs"][:, t].reshape(bs * n_agents, -1), ids.reshape(bs * n_agents, -1)], dim=1)
        agent_outs, self.hidden_states = self.agent(inputs, self.hidden_states)
        return agent_outs.view(bs, n_agents, -1)

    def init_hidden(self, batch_size):
        self.hidden_states = self.agent.init_hidden().unsqueeze(0).expand(batch_size, n_agents, -1)

    def parameters(self):
        return self.agent.parameters()

    def load_state(self, other_mac):
        self.agent.load_state_dict(other_mac.agent.state_dict())


class QMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.hyper_w_1 = nn.Sequential(nn.Linear(state_dim, 16), nn.ReLU(), nn.Linear(16, embed * n_agents))
        self.hyper_w_final = nn.Sequential(nn.Linear(state_dim, 16), nn.ReLU(), nn.Linear(16, embed))
        self.hyper_b_1 = nn.Linear(state_dim, embed)
        self.V = nn.Sequential(nn.Linear(state_dim, embed), nn.ReLU(), nn.Linear(embed, 1))

    def forward(self, agent_qs, states):
        bs = agent_qs.size(0)
        states = states.reshape(-1, state_dim)
        agent_qs = agent_qs.view(-1, 1, n_agents)
        w1 = torch.abs(self.hyper_w_1(states)).view(-1, n_agents, embed)
        b1 = self.hyper_b_1(states).view(-1, 1, embed)
        hidden_layer = F.elu(torch.bmm(agent_qs, w1) + b1)
        w_final = torch.abs(self.hyper_w_final(states)).view(-1, embed, 1)
        y = torch.bmm(hidden_layer, w_final) + self.V(states).view(-1, 1, 1)
        return y.view(bs, -1, 1)


def rollout(mac, steps=5):
    """episode_runner.run: one episode, actions chosen epsilon-greedily from the live MAC (no torch.no_grad())."""
    batch = {"obs": torch.randn(1, steps + 1, n_agents, obs_dim), "state": torch.randn(1, steps + 1, state_dim),
             "avail_actions": (torch.rand(1, steps + 1, n_agents, n_actions) < 0.8).long(),
             "actions": torch.zeros(1, steps + 1, n_agents, 1, dtype=torch.long),
             "reward": torch.randn(1, steps + 1, 1), "terminated": torch.zeros(1, steps + 1, 1),
             "filled": torch.ones(1, steps + 1, 1)}
    batch["avail_actions"][..., 0] = 1
    batch["terminated"][0, steps - 1] = 1
    mac.init_hidden(batch_size=1)
    for t in range(steps + 1):
        agent_outs = mac.forward(batch, t)
        masked_q_values = agent_outs.clone()
        masked_q_values[batch["avail_actions"][:, t] == 0] = -float("inf")
        greedy = masked_q_values.max(dim=2)[1]
        random_actions = torch.distributions.Categorical(batch["avail_actions"][:, t].float()).sample().long()
        pick_random = (torch.rand_like(agent_outs[:, :, 0]) < 0.3).long()
        batch["actions"][:, t] = (pick_random * random_actions + (1 - pick_random) * greedy).unsqueeze(-1)
    return batch


mac, mixer = BasicMAC(), QMixer()
params = list(mac.parameters()) + list(mixer.parameters())
target_mac, target_mixer = copy.deepcopy(mac), copy.deepcopy(mixer)
optimiser = torch.optim.RMSprop(params=params, lr=5e-4, alpha=0.99, eps=1e-5)
episodes = []
for episode in range(8):
    episodes.append(rollout(mac))
    if len(episodes) < 2:
        continue
    picked = torch.randint(0, len(episodes), (2,)).tolist()
    batch = {k: torch.cat([episodes[i][k] for i in picked]) for k in episodes[0]}
    rewards, actions = batch["reward"][:, :-1], batch["actions"][:, :-1]
    terminated, mask = batch["terminated"][:, :-1].float(), batch["filled"][:, :-1].float()
    mask[:, 1:] = mask[:, 1:] * (1 - terminated[:, :-1])
    avail_actions = batch["avail_actions"]
    mac_out = []
    mac.init_hidden(2)
    for t in range(batch["obs"].shape[1]):
        mac_out.append(mac.forward(batch, t=t))
    mac_out = torch.stack(mac_out, dim=1)
    chosen_action_qvals = torch.gather(mac_out[:, :-1], dim=3, index=actions).squeeze(3)
    target_mac_out = []
    target_mac.init_hidden(2)
    for t in range(batch["obs"].shape[1]):
        target_mac_out.append(target_mac.forward(batch, t=t))
    target_mac_out = torch.stack(target_mac_out[1:], dim=1)
    target_mac_out[avail_actions[:, 1:] == 0] = -9999999
    mac_out[avail_actions == 0] = -9999999
    cur_max_actions = mac_out[:, 1:].max(dim=3, keepdim=True)[1]
    target_max_qvals = torch.gather(target_mac_out, 3, cur_max_actions).squeeze(3)
    chosen_action_qvals = mixer(chosen_action_qvals, batch["state"][:, :-1])
    target_max_qvals = target_mixer(target_max_qvals, batch["state"][:, 1:])
    targets = rewards + 0.99 * (1 - terminated) * target_max_qvals
    td_error = chosen_action_qvals - targets.detach()
    mask = mask.expand_as(td_error)
    masked_td_error = td_error * mask
    loss = (masked_td_error ** 2).sum() / mask.sum()
    optimiser.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 10)
    optimiser.step()
    if episode % 3 == 0:
        target_mac.load_state(mac)
        target_mixer.load_state_dict(mixer.state_dict())
    print(episode, f"{loss.item():.17g} {grad_norm.item():.17g}")
print(repr(sum(p.double().sum().item() for p in params)))
