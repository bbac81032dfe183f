"""cleanrl_ppo_lstm_state_with_graph.py with the carried LSTM state detached at the end of each step, the error's
second fix: the rollout's graph is let go at each update, and the update trains as cleanrl_ppo_lstm.py."""
import numpy as np
import torch
from torch import nn
from torch.distributions.categorical import Categorical

torch.manual_seed(0), np.random.seed(0)


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.network = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.lstm = nn.LSTM(8, 6)
        self.actor, self.critic = nn.Linear(6, 2), nn.Linear(6, 1)

    def get_states(self, x, lstm_state, done):
        hidden = self.network(x)
        batch_size = lstm_state[0].shape[1]
        hidden = hidden.reshape((-1, batch_size, self.lstm.input_size))
        done = done.reshape((-1, batch_size))
        new_hidden = []
        for h, d in zip(hidden, done):
            h, lstm_state = self.lstm(
                h.unsqueeze(0),
                ((1.0 - d).view(1, -1, 1) * lstm_state[0], (1.0 - d).view(1, -1, 1) * lstm_state[1]),
            )
            new_hidden += [h]
        return torch.flatten(torch.cat(new_hidden), 0, 1), lstm_state

    def get_value(self, x, lstm_state, done):
        hidden, _ = self.get_states(x, lstm_state, done)
        return self.critic(hidden)

    def get_action_and_value(self, x, lstm_state, done, action=None):
        hidden, lstm_state = self.get_states(x, lstm_state, done)
        probs = Categorical(logits=self.actor(hidden))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden), lstm_state


num_steps, num_envs, num_minibatches, gamma, gae_lambda, clip_coef = 5, 4, 2, 0.99, 0.95, 0.1
batch_size = num_steps * num_envs
agent = Agent()
optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
obs, actions = torch.zeros((num_steps, num_envs, 4)), torch.zeros((num_steps, num_envs))
logprobs, rewards = torch.zeros((num_steps, num_envs)), torch.zeros((num_steps, num_envs))
dones, values = torch.zeros((num_steps, num_envs)), torch.zeros((num_steps, num_envs))
next_obs, next_done = torch.randn(num_envs, 4), torch.zeros(num_envs)
next_lstm_state = (torch.zeros(agent.lstm.num_layers, num_envs, agent.lstm.hidden_size),
                   torch.zeros(agent.lstm.num_layers, num_envs, agent.lstm.hidden_size))
for iteration in range(1, 4):
    initial_lstm_state = (next_lstm_state[0].clone(), next_lstm_state[1].clone())
    for step in range(0, num_steps):
        obs[step] = next_obs
        dones[step] = next_done
        action, logprob, _, value, next_lstm_state = agent.get_action_and_value(next_obs, next_lstm_state, next_done)
        values[step] = value.flatten().detach()
        actions[step] = action
        logprobs[step] = logprob.detach()
        next_obs, next_done = torch.randn(num_envs, 4), (torch.rand(num_envs) < 0.2).float()
        rewards[step] = torch.randn(num_envs)
    with torch.no_grad():
        next_value = agent.get_value(next_obs, next_lstm_state, next_done).reshape(1, -1)
        advantages = torch.zeros_like(rewards)
        lastgaelam = 0
        for t in reversed(range(num_steps)):
            if t == num_steps - 1:
                nextnonterminal, nextvalues = 1.0 - next_done, next_value
            else:
                nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
            delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
            advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        returns = advantages + values
    b_obs, b_logprobs, b_actions = obs.reshape((-1, 4)), logprobs.reshape(-1), actions.reshape(-1)
    b_dones, b_advantages, b_returns = dones.reshape(-1), advantages.reshape(-1), returns.reshape(-1)
    envsperbatch = num_envs // num_minibatches
    envinds = np.arange(num_envs)
    flatinds = np.arange(batch_size).reshape(num_steps, num_envs)
    for epoch in range(2):
        np.random.shuffle(envinds)
        for start in range(0, num_envs, envsperbatch):
            mbenvinds = envinds[start:start + envsperbatch]
            mb_inds = flatinds[:, mbenvinds].ravel()
            _, newlogprob, entropy, newvalue, _ = agent.get_action_and_value(
                b_obs[mb_inds],
                (initial_lstm_state[0][:, mbenvinds], initial_lstm_state[1][:, mbenvinds]),
                b_dones[mb_inds],
                b_actions.long()[mb_inds],
            )
            logratio = newlogprob - b_logprobs[mb_inds]
            ratio = logratio.exp()
            mb_advantages = b_advantages[mb_inds]
            mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
            pg_loss = torch.max(-mb_advantages * ratio,
                                -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
            v_loss = 0.5 * ((newvalue.view(-1) - b_returns[mb_inds]) ** 2).mean()
            loss = pg_loss - 0.01 * entropy.mean() + v_loss * 0.5
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            optimizer.step()
            print(f"{iteration} {epoch} {loss.item()!r}")
            next_lstm_state = tuple(t.detach() for t in next_lstm_state)
print(repr(sum(p.double().sum().item() for p in agent.parameters())))
