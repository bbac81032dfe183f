# ikostrikov/pytorch-a3c (main.py, train.py): a model and an Adam in shared memory; a worker process (`mp.Process`,
# forked on Linux) copies the shared weights into its own model, back-propagates an actor-critic loss there and
# hands the gradients over by hand (`shared_param._grad = param.grad`) before the shared optimizer steps.
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.actor, self.critic = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 1)

    def forward(self, x):
        h = F.relu(self.body(x))
        return self.critic(h), self.actor(h)


def ensure_shared_grads(model, shared_model):
    for param, shared_param in zip(model.parameters(), shared_model.parameters()):
        if shared_param.grad is not None:
            return
        shared_param._grad = param.grad


def train(rank, shared_model, optimizer):
    torch.manual_seed(1 + rank)
    model = ActorCritic()
    for episode in range(4):
        model.load_state_dict(shared_model.state_dict())
        values, log_probs, rewards = [], [], []
        for _ in range(3):
            value, logit = model(torch.randn(1, 4))
            action = F.softmax(logit, -1).multinomial(num_samples=1).detach()
            values.append(value)
            log_probs.append(F.log_softmax(logit, -1).gather(1, action))
            rewards.append(float(action.item()))
        R, policy_loss, value_loss = torch.zeros(1, 1), 0, 0
        for i in reversed(range(len(rewards))):
            R = 0.99 * R + rewards[i]
            advantage = R - values[i]
            value_loss = value_loss + 0.5 * advantage.pow(2)
            policy_loss = policy_loss - log_probs[i] * advantage.detach()
        optimizer.zero_grad()
        (policy_loss + 0.5 * value_loss).backward()
        ensure_shared_grads(model, shared_model)
        optimizer.step()
        print(f"episode {episode}: loss {(policy_loss + 0.5 * value_loss).item():.6f}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    shared_model = ActorCritic()
    shared_model.share_memory()
    optimizer = torch.optim.Adam(shared_model.parameters(), lr=0.01)
    worker = mp.Process(target=train, args=(0, shared_model, optimizer))
    worker.start()
    worker.join()
    print(f"exit code {worker.exitcode}, actor weight sum {shared_model.actor.weight.sum().item():.6f}")
