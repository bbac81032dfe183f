# MADDPG as shariqiqbal2810/maddpg-pytorch trains it on discrete actions (algorithms/maddpg.py MADDPG.update and
# update_all_targets, utils/misc.py soft_update / onehot_from_logits / gumbel_softmax, utils/agents.py DDPGAgent,
# utils/networks.py MLPNetwork, main.py): each agent's centralized critic reads every agent's observation and action,
# its target from the target policies' one-hot actions, detached in the critic loss; the actor loss feeds the
# critic its own straight-through Gumbel-softmax action and the other agents' current greedy one-hot actions (no
# gradient: onehot_from_logits compares), and its backward also fills the critic's .grad (cleared by the next
# critic_optimizer.zero_grad()). Rollouts act without torch.no_grad(); targets soft-updated through .data.
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
np.random.seed(0)
nagents, obs_dim, n_actions, gamma, tau = 3, 4, 5, 0.95, 0.01


class MLPNetwork(nn.Module):
    def __init__(self, input_dim, out_dim, hidden_dim=16):
        super().__init__()
        self.in_fn = nn.BatchNorm1d(input_dim)
        self.in_fn.weight.data.fill_(1)
        self.in_fn.bias.data.fill_(0)
        self.fc1, self.fc2 = nn.Linear(input_dim, hidden_dim), nn.Linear(hidden_dim, hidden_dim)
        self.fc3 = nn.Linear(hidden_dim, out_dim)

    def forward(self, X):
        h1 = F.relu(self.fc1(self.in_fn(X)))
        return self.fc3(F.relu(self.fc2(h1)))


def soft_update(target, source, tau):
    for target_param, param in zip(target.parameters(), source.parameters()):
        target_param.data.copy_(target_param.data * (1.0 - tau) + param.data * tau)


def hard_update(target, source):
    for target_param, param in zip(target.parameters(), source.parameters()):
        target_param.data.copy_(param.data)


def onehot_from_logits(logits):
    return (logits == logits.max(1, keepdim=True)[0]).float()


def gumbel_softmax(logits, temperature=1.0, hard=False):
    U = torch.rand(logits.shape)
    y = F.softmax((logits - torch.log(-torch.log(U + 1e-20) + 1e-20)) / temperature, dim=1)
    if hard:
        y = (onehot_from_logits(y) - y).detach() + y
    return y


class DDPGAgent:
    def __init__(self):
        critic_in = nagents * (obs_dim + n_actions)
        self.policy, self.critic = MLPNetwork(obs_dim, n_actions), MLPNetwork(critic_in, 1)
        self.target_policy, self.target_critic = MLPNetwork(obs_dim, n_actions), MLPNetwork(critic_in, 1)
        hard_update(self.target_policy, self.policy)
        hard_update(self.target_critic, self.critic)
        self.policy_optimizer = torch.optim.Adam(self.policy.parameters(), lr=0.01)
        self.critic_optimizer = torch.optim.Adam(self.critic.parameters(), lr=0.01)


agents = [DDPGAgent() for _ in range(nagents)]
policies, target_policies = [a.policy for a in agents], [a.target_policy for a in agents]


def update(sample, agent_i):
    obs, acs, rews, next_obs, dones = sample
    curr_agent = agents[agent_i]
    curr_agent.critic_optimizer.zero_grad()
    all_trgt_acs = [onehot_from_logits(pi(nobs)) for pi, nobs in zip(target_policies, next_obs)]
    trgt_vf_in = torch.cat((*next_obs, *all_trgt_acs), dim=1)
    target_value = (rews[agent_i].view(-1, 1) + gamma * curr_agent.target_critic(trgt_vf_in)
                    * (1 - dones[agent_i].view(-1, 1)))
    vf_in = torch.cat((*obs, *acs), dim=1)
    actual_value = curr_agent.critic(vf_in)
    vf_loss = F.mse_loss(actual_value, target_value.detach())
    vf_loss.backward()
    torch.nn.utils.clip_grad_norm_(curr_agent.critic.parameters(), 0.5)
    curr_agent.critic_optimizer.step()

    curr_agent.policy_optimizer.zero_grad()
    curr_pol_out = curr_agent.policy(obs[agent_i])
    curr_pol_vf_in = gumbel_softmax(curr_pol_out, hard=True)
    all_pol_acs = []
    for i, pi, ob in zip(range(nagents), policies, obs):
        if i == agent_i:
            all_pol_acs.append(curr_pol_vf_in)
        else:
            all_pol_acs.append(onehot_from_logits(pi(ob)))
    vf_in = torch.cat((*obs, *all_pol_acs), dim=1)
    pol_loss = -curr_agent.critic(vf_in).mean()
    pol_loss += (curr_pol_out ** 2).mean() * 1e-3
    pol_loss.backward()
    torch.nn.utils.clip_grad_norm_(curr_agent.policy.parameters(), 0.5)
    curr_agent.policy_optimizer.step()
    return vf_loss, pol_loss


buffer = []
obs = [torch.randn(2, obs_dim) for _ in range(nagents)]
for t in range(8):
    for a in agents:
        a.policy.eval()
    torch_agent_actions = [gumbel_softmax(a.policy(o), hard=True) for a, o in zip(agents, obs)]
    agent_actions = [ac.data.numpy() for ac in torch_agent_actions]
    next_obs = [torch.randn(2, obs_dim) for _ in range(nagents)]
    for e in range(2):
        buffer.append(([o[e].numpy() for o in obs], [ac[e] for ac in agent_actions],
                       [float(np.random.randn()) for _ in range(nagents)], [o[e].numpy() for o in next_obs],
                       [float(t % 4 == 3)] * nagents))
    obs = next_obs
    if len(buffer) >= 6:
        for a in agents:
            a.policy.train(), a.critic.train(), a.target_policy.train(), a.target_critic.train()
        for a_i in range(nagents):
            inds = np.random.choice(len(buffer), size=6, replace=False)
            sample = [[torch.tensor(np.array([buffer[i][k][j] for i in inds]), dtype=torch.float32)
                       for j in range(nagents)] for k in range(5)]
            vf_loss, pol_loss = update(sample, a_i)
            print(t, a_i, f"{vf_loss.item():.17g} {pol_loss.item():.17g}")
        for a in agents:
            soft_update(a.target_critic, a.critic, tau)
            soft_update(a.target_policy, a.policy, tau)
print(repr(sum(p.double().sum().item() for a in agents for net in (a.policy, a.critic, a.target_policy)
               for p in net.parameters())))
