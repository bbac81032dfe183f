# A sparse autoencoder trained as saprmarks/dictionary_learning's StandardTrainer writes it (trainers/standard.py,
# trainers/trainer.py, dictionary.py): ConstrainedAdam removes the decoder gradient's component parallel to each
# column in place before Adam's step and renormalizes the columns after it, under no_grad; a LambdaLR warm-up; every
# few steps the dead features are resampled under no_grad (encoder rows, decoder columns and encoder biases written
# by index) and their Adam moments zeroed in place through `optimizer.state_dict()['state']`, which shares the
# optimizer's own tensors. Five features start with a very negative bias, so the resampling runs. Correct.
import torch as t
from torch import nn


class ConstrainedAdam(t.optim.Adam):
    def __init__(self, params, constrained_params, lr, betas=(0.9, 0.999)):
        super().__init__(params, lr=lr, betas=betas)
        self.constrained_params = list(constrained_params)

    def step(self, closure=None):
        with t.no_grad():
            for p in self.constrained_params:
                normed_p = p / p.norm(dim=0, keepdim=True)
                # project away the parallel component of the gradient
                p.grad -= (p.grad * normed_p).sum(dim=0, keepdim=True) * normed_p
        super().step(closure=closure)
        with t.no_grad():
            for p in self.constrained_params:
                # renormalize the constrained parameters
                p /= p.norm(dim=0, keepdim=True)


class AutoEncoder(nn.Module):
    def __init__(self, activation_dim, dict_size):
        super().__init__()
        self.activation_dim = activation_dim
        self.dict_size = dict_size
        self.bias = nn.Parameter(t.zeros(activation_dim))
        self.encoder = nn.Linear(activation_dim, dict_size, bias=True)
        self.decoder = nn.Linear(dict_size, activation_dim, bias=False)
        w = t.randn(activation_dim, dict_size)
        w = w / w.norm(dim=0, keepdim=True) * 0.1
        self.encoder.weight = nn.Parameter(w.clone().T)
        self.decoder.weight = nn.Parameter(w.clone())

    def encode(self, x):
        return nn.ReLU()(self.encoder(x - self.bias))

    def decode(self, f):
        return self.decoder(f) + self.bias

    def forward(self, x, output_features=False):
        f = self.encode(x)
        x_hat = self.decode(f)
        return (x_hat, f) if output_features else x_hat


class StandardTrainer:
    def __init__(self, activation_dim, dict_size, lr=1e-2, l1_penalty=0.5, warmup_steps=3, resample_steps=3):
        self.ae = AutoEncoder(activation_dim, dict_size)
        with t.no_grad():
            self.ae.encoder.bias[:5] = -20.
        self.l1_penalty = l1_penalty
        self.resample_steps = resample_steps
        self.steps_since_active = t.zeros(self.ae.dict_size, dtype=int)
        self.optimizer = ConstrainedAdam(self.ae.parameters(), self.ae.decoder.parameters(), lr=lr)
        self.scheduler = t.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda=lambda s: min(1.0, (s + 1) / warmup_steps))

    def resample_neurons(self, deads, activations):
        with t.no_grad():
            if deads.sum() == 0:
                return
            print(f"resampling {deads.sum().item()} neurons")
            losses = (activations - self.ae(activations)).norm(dim=-1)
            n_resample = min([deads.sum(), losses.shape[0]])
            indices = t.multinomial(losses, num_samples=n_resample, replacement=False)
            sampled_vecs = activations[indices]
            alive_norm = self.ae.encoder.weight[~deads].norm(dim=-1).mean()
            deads[deads.nonzero()[n_resample:]] = False
            self.ae.encoder.weight[deads] = sampled_vecs * alive_norm * 0.2
            self.ae.decoder.weight[:, deads] = (sampled_vecs / sampled_vecs.norm(dim=-1, keepdim=True)).T
            self.ae.encoder.bias[deads] = 0.
            # reset Adam parameters for dead neurons
            state_dict = self.optimizer.state_dict()['state']
            state_dict[1]['exp_avg'][deads] = 0.
            state_dict[1]['exp_avg_sq'][deads] = 0.
            state_dict[2]['exp_avg'][deads] = 0.
            state_dict[2]['exp_avg_sq'][deads] = 0.
            state_dict[3]['exp_avg'][:, deads] = 0.
            state_dict[3]['exp_avg_sq'][:, deads] = 0.

    def loss(self, x):
        x_hat, f = self.ae(x, output_features=True)
        recon_loss = (x - x_hat).pow(2).sum(dim=-1).mean()
        l1_loss = f.norm(p=1, dim=-1).mean()
        deads = (f == 0).all(dim=0)
        self.steps_since_active[deads] += 1
        self.steps_since_active[~deads] = 0
        return recon_loss + self.l1_penalty * l1_loss

    def update(self, step, activations):
        self.optimizer.zero_grad()
        loss = self.loss(activations)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        if self.resample_steps is not None and step % self.resample_steps == 0:
            self.resample_neurons(self.steps_since_active > self.resample_steps / 2, activations)
        return loss


t.manual_seed(0)
trainer = StandardTrainer(6, 12)
for step in range(8):
    activations = t.randn(16, 6) * 2
    loss = trainer.update(step, activations)
    print(f"step {step} loss {loss.item()!r}")
print(repr(sum(p.detach().double().pow(2).sum().item() for p in trainer.ae.parameters())))
print(repr(sum(s['exp_avg_sq'].double().sum().item() for s in trainer.optimizer.state.values())))
