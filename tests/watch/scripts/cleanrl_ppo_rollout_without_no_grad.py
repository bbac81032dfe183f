"""CleanRL's PPO update (vwxyzjn/cleanrl, cleanrl/ppo.py), as cleanrl_ppo_minibatches.py, with the rollout run
without torch.no_grad(): the stored old log-probabilities and values keep the graph of the rollout, which the
first minibatch's backward frees. They are targets the loss compares with: computed under no_grad."""
import numpy as np
import torch
from torch import nn
from torch.distributions.categorical import Categorical

torch.manual_seed(0), np.random.seed(0)


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic, self.actor = nn.Linear(4, 1), nn.Linear(4, 2)

    def get_action_and_value(self, x, action=None):
        probs = Categorical(logits=self.actor(x))
        action = probs.sample() if action is None else action
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


agent = Agent()
optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
num_steps, batch_size, minibatch_size, target_kl = 8, 8, 4, 0.02
for iteration in range(1, 4):
    obs, actions, logprobs, values = torch.randn(num_steps, 4), [], [], []
    for step in range(0, num_steps):
        action, logprob, _, value = agent.get_action_and_value(obs[step])
        actions.append(action), logprobs.append(logprob), values.append(value.flatten())
    b_actions, b_logprobs, b_values = torch.stack(actions), torch.stack(logprobs), torch.cat(values)
    b_returns = torch.randn(num_steps)
    b_advantages = b_returns - b_values
    b_inds = np.arange(batch_size)
    for epoch in range(4):
        np.random.shuffle(b_inds)
        for start in range(0, batch_size, minibatch_size):
            mb_inds = b_inds[start:start + minibatch_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs[mb_inds], b_actions[mb_inds])
            logratio = newlogprob - b_logprobs[mb_inds]
            ratio = logratio.exp()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - logratio).mean()
            pg_loss = torch.max(-b_advantages[mb_inds] * ratio,
                                -b_advantages[mb_inds] * torch.clamp(ratio, 0.8, 1.2)).mean()
            v_loss = 0.5 * ((newvalue.view(-1) - b_returns[mb_inds]) ** 2).mean()
            loss = pg_loss - 0.01 * entropy.mean() + v_loss * 0.5
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            optimizer.step()
        if target_kl is not None and approx_kl > target_kl:
            break
    print(f"iteration {iteration} epochs {epoch + 1} loss {loss.item()}")
for p in agent.parameters():
    print(p.sum().item())
