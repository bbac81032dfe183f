# PPO (nikhilbarhate99/PPO-PyTorch, PPO.py RolloutBuffer, ActorCritic.act/evaluate, PPO.select_action/update) with
# GAE in place of its Monte-Carlo returns: actions chosen by policy_old under torch.no_grad(), the rollout's tensors
# stacked and detached, advantages from the stored values, K epochs of the clipped loss over the whole rollout,
# then policy_old.load_state_dict(policy.state_dict()) and the buffer cleared (`del self.actions[:]`).
import torch
from torch import nn
from torch.distributions import Categorical

torch.manual_seed(0)


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2), nn.Softmax(dim=-1))
        self.critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def act(self, state):
        dist = Categorical(self.actor(state))
        action = dist.sample()
        return action.detach(), dist.log_prob(action).detach(), self.critic(state).detach()

    def evaluate(self, state, action):
        dist = Categorical(self.actor(state))
        return dist.log_prob(action), self.critic(state), dist.entropy()


policy, policy_old = ActorCritic(), ActorCritic()
policy_old.load_state_dict(policy.state_dict())
optimizer = torch.optim.Adam([{"params": policy.actor.parameters(), "lr": 3e-4},
                              {"params": policy.critic.parameters(), "lr": 1e-3}])
states, actions, logprobs, rewards, state_values, is_terminals = [], [], [], [], [], []
for episode in range(3):
    state = torch.randn(4)
    for t in range(12):
        with torch.no_grad():
            action, action_logprob, state_val = policy_old.act(state)
        states.append(state), actions.append(action), logprobs.append(action_logprob), state_values.append(state_val)
        state = state * 0.9 + (action.float() - 0.5)
        rewards.append(-state.pow(2).sum().item()), is_terminals.append(t == 11)
    values = torch.squeeze(torch.stack(state_values, dim=0)).detach()
    advantages, gae = torch.zeros(len(rewards)), 0.0
    for i in reversed(range(len(rewards))):
        next_value = 0.0 if is_terminals[i] else values[i + 1]
        gae = rewards[i] + 0.99 * next_value - values[i] + 0.99 * 0.95 * (not is_terminals[i]) * gae
        advantages[i] = gae
    returns = advantages + values
    old_states, old_actions = torch.stack(states).detach(), torch.stack(actions).detach()
    old_logprobs = torch.stack(logprobs).detach()
    for _ in range(4):
        logprobs_new, state_values_new, dist_entropy = policy.evaluate(old_states, old_actions)
        ratios = torch.exp(logprobs_new - old_logprobs.detach())
        surr1, surr2 = ratios * advantages, torch.clamp(ratios, 0.8, 1.2) * advantages
        loss = -torch.min(surr1, surr2) + 0.5 * nn.MSELoss()(state_values_new.squeeze(1), returns) - 0.01 * dist_entropy
        optimizer.zero_grad()
        loss.mean().backward()
        optimizer.step()
    policy_old.load_state_dict(policy.state_dict())
    del states[:], actions[:], logprobs[:], rewards[:], state_values[:], is_terminals[:]
    print(episode, f"{loss.mean().item():.6f}")
