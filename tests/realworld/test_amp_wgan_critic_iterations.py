"""WGAN with several critic updates per batch, under autocast: prakanth97/GANs at commit
61610c54c7490ea870b4975401d22c882cb8c4d6, WGAN/train.py (``CRITIC_ITERATIONS`` critic updates per batch, each on
fresh noise, ``loss_critic.backward(retain_graph=True)`` through the undetached ``fake``, RMSprop, the critic's
weights clamped in place to ``WEIGHT_CLIP`` after each update; then the generator's loss through the updated critic
on the last ``fake``), with autocast added as pytorch/pytorch's docs/source/notes/amp_examples.rst (commit
af616bb641d3825cc8216e583f2918912cc77103) says: each forward under ``autocast``; under float16 each backward as
``scaler.scale(loss).backward()`` and each update as ``scaler.step`` then ``scaler.update()`` (a GradScaler steps
an optimizer at most once between updates).

Changes for a seconds-long test: MLPs on 2-D points for the DCGAN-style ``Critic`` and ``Genarator`` (conv nets on
64x64 MNIST), ``Z_DIM`` 4, 4 batches of 8 random points, ``LEARNING_RATE`` 5e-3 (5e-5); no logging or images; the
CPU: ``torch.autocast("cpu", dtype=...)`` and ``torch.amp.GradScaler("cpu")``.

The port: manual mode, ``self.step("critic")`` five times in ``training_step``. Under ``bf16-mixed`` it matches, in
every guard mode, and the loop itself stays quiet under ``safeloop.watch``: ``gen_fake`` still holds the last
batch's generator graph while the next batch's critic steps run, a graph made in one step and back-propagated
through in the next, which piles nothing up.
Under ``16-mixed`` the second ``self.step("critic")`` is refused, saying why: the Trainer updates the scaler once per
step (docs/trainer.md), which allows each optimizer one update per step; the step's first update is undone.
"""
import pytest
import torch
import torch.nn as nn

from safeloop import StepError, Trainer

from .harness import assert_same, checks, compare

LEARNING_RATE, Z_DIM, CRITIC_ITERATIONS, WEIGHT_CLIP, BATCHES = 5e-3, 4, 5, 0.01, 4


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.gen = nn.Sequential(nn.Linear(Z_DIM, 16), nn.ReLU(), nn.Linear(16, 2))


class Loader(list):
    def __init__(self):
        gen = torch.Generator().manual_seed(29)
        super().__init__((torch.randn(8, 2, generator=gen), torch.zeros(8)) for _ in range(BATCHES))


def wgan_hand(gan, loader, dtype=torch.bfloat16):
    critic, gen = gan.critic, gan.gen
    opt_gen = torch.optim.RMSprop(gen.parameters(), lr=LEARNING_RATE)
    opt_critic = torch.optim.RMSprop(critic.parameters(), lr=LEARNING_RATE)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    for batch_idx, (data, _) in enumerate(loader):
        cur_batch_size = data.shape[0]
        for _ in range(CRITIC_ITERATIONS):
            noise = torch.randn(cur_batch_size, Z_DIM)
            with torch.autocast("cpu", dtype=dtype):
                fake = gen(noise)
                critic_real = critic(data).reshape(-1)
                critic_fake = critic(fake).reshape(-1)
                loss_critic = -(torch.mean(critic_real) - torch.mean(critic_fake))
            critic.zero_grad()
            scaler.scale(loss_critic).backward(retain_graph=True)
            scaler.step(opt_critic)
            scaler.update()
            # clip critic weights between -0.01, 0.01
            for p in critic.parameters():
                p.data.clamp_(-WEIGHT_CLIP, WEIGHT_CLIP)
        # Training generator
        with torch.autocast("cpu", dtype=dtype):
            gen_fake = critic(fake).reshape(-1)
            loss_gen = -torch.mean(gen_fake)
        gen.zero_grad()
        scaler.scale(loss_gen).backward()
        scaler.step(opt_gen)
        scaler.update()


class WGAN(Trainer):
    automatic = False

    def configure_optimizers(self):
        return {"critic": torch.optim.RMSprop(self.model.critic.parameters(), lr=LEARNING_RATE),
                "gen": torch.optim.RMSprop(self.model.gen.parameters(), lr=LEARNING_RATE)}

    def training_step(self, batch):
        critic, gen = self.model.critic, self.model.gen
        data, _ = batch
        cur_batch_size = data.shape[0]
        for _ in range(CRITIC_ITERATIONS):
            noise = torch.randn(cur_batch_size, Z_DIM)
            fake = gen(noise)
            critic_real = critic(data).reshape(-1)
            critic_fake = critic(fake).reshape(-1)
            loss_critic = -(torch.mean(critic_real) - torch.mean(critic_fake))
            self.backward(loss_critic, optimizer="critic", retain_graph=True)
            self.step("critic")
            for p in critic.parameters():
                p.data.clamp_(-WEIGHT_CLIP, WEIGHT_CLIP)
        gen_fake = critic(fake).reshape(-1)
        loss_gen = -torch.mean(gen_fake)
        self.backward(loss_gen, optimizer="gen")
        self.step("gen")
        return {"critic": loss_critic, "gen": loss_gen}


@pytest.mark.parametrize("check", checks())
def test_wgan_critic_iterations_under_bf16(check):
    compare(GAN, wgan_hand, WGAN, lambda model: Loader(), check, steps=BATCHES, precision="bf16-mixed")


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("check", ["auto", "always"])
def test_wgan_critic_iterations_port_under_bf16(check):
    torch.manual_seed(0)
    ref = GAN()
    ours = GAN()
    ours.load_state_dict(ref.state_dict())
    torch.manual_seed(1)
    wgan_hand(ref, Loader())
    torch.manual_seed(1)
    WGAN(model=ours, train_data=Loader(), max_steps=BATCHES, device="cpu", progress=False, loggers=(),
         guard={"check": check}, precision="bf16-mixed").fit()
    assert_same(ours, ref)


def test_wgan_critic_iterations_under_16_mixed():
    torch.manual_seed(0)
    gan = GAN()
    before = {k: v.clone() for k, v in gan.state_dict().items()}
    trainer = WGAN(model=gan, train_data=Loader(), max_steps=BATCHES, device="cpu", progress=False, loggers=(),
                   precision="16-mixed")
    with pytest.raises(StepError, match=r"step 1: self.step\('critic'\) a second time in one step under "
                                        r"precision=16: the GradScaler is updated once per step.*make each update a "
                                        r"step of its own, or use precision=bf16"):
        trainer.fit()
    assert all(torch.equal(v, before[k]) for k, v in gan.state_dict().items())  # the first update undone
