"""Pruning ``nn.MultiheadAttention``'s output projection: pytorch/pytorch issue #69353 ("Pruning
`torch.nn.MultiheadAttention` causes RuntimeError", open), its reproduction, and #78109 (the cause).

``prune.global_unstructured`` over ``att.in_proj_weight``, ``att.out_proj.weight`` and ``proj.weight`` puts a
forward pre-hook on each module that sets ``weight = weight_orig * weight_mask`` before its forward, and sets it once
at prune time. ``MultiheadAttention.forward`` reads ``self.out_proj.weight`` itself and never calls ``out_proj``, so
``out_proj``'s hook never runs: every step's loss reaches the one product made at prune time, before training. The
first backward frees its saved tensors and the second step fails with "Trying to backward through the graph a second
time" (with ``retain_graph=True`` it would run, training ``out_proj.weight_orig`` through a weight that never follows
it).

Changes for a seconds-long test: ``embed_dim=8`` (100 in the issue), 3 classes (10), batches of 2 sequences of 5,
3 steps on the CPU; the issue's loop (``model(x)``, ``model.compute_loss``, Adam) is written out.

What the guard says: the Trainer stops step 1, before any ``.grad`` changes, naming
``self.model.att.out_proj.weight`` (``GraphReuseError``); ``watch`` stops step 2, before its backward, naming
``model.att.out_proj.weight``.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.utils.prune as prune

from safeloop import CarriedGraphError, GraphGuard, GraphReuseError, Trainer
from safeloop.watch import Watch

STEPS, CLASSES = 3, 3


# -- pytorch/pytorch#69353's reproduction ------------------------------------------------------------------------
class net(nn.Module):
    def __init__(self):
        super().__init__()

        self.att = nn.MultiheadAttention(
            embed_dim=8,
            num_heads=2,
            batch_first=True
        )
        self.proj = nn.Linear(8, CLASSES)
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x):
        attn_output, attn_weights = self.att(x, x, x)
        logits = self.proj(attn_output)
        return logits

    def compute_loss(self, logits, target):
        loss = self.criterion(logits, target)
        return loss


def pruned():
    torch.manual_seed(0)
    model = net()
    # prune here
    params_to_prune = [
        (model.att, "in_proj_weight"),
        (model.att.out_proj, "weight"),
        (model.proj, "weight"),
    ]
    prune.global_unstructured(params_to_prune, pruning_method=prune.L1Unstructured, amount=0.2)
    return model


def batches():
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(2, 5, 8, generator=gen), torch.randint(CLASSES, (2, 5), generator=gen))
            for _ in range(STEPS)]


def issue_hand(model, data):
    optimizer = torch.optim.Adam(model.parameters())
    for x, target in data:
        optimizer.zero_grad()
        logits = model(x)
        loss = model.compute_loss(logits.view(-1, CLASSES), target.view(-1))
        loss.backward()
        optimizer.step()


class IssueTrainer(Trainer):
    def training_step(self, batch):
        x, target = batch
        return self.model.compute_loss(self.model(x).view(-1, CLASSES), target.view(-1))


def test_the_issue_fails_in_pytorch_at_the_second_step():
    model = pruned()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        issue_hand(model, batches())


@pytest.mark.parametrize("check", ("auto", "always", "off"))
def test_watch_names_the_projection_weight_kept_since_pruning(check, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the graph picture the error writes
    with Watch(GraphGuard(check=check), issue_hand.__code__.co_filename):
        with pytest.raises(CarriedGraphError, match=r"step 2.*held by `model\.att\.out_proj\.weight`"):
            issue_hand(pruned(), batches())


@pytest.mark.parametrize("check", ("auto", "always"))
def test_the_trainer_stops_the_first_step_naming_the_projection_weight(check):
    model = pruned()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = IssueTrainer(model=model, train_data=batches(), optimizer=torch.optim.Adam(model.parameters()),
                           max_steps=STEPS, device="cpu", progress=False, loggers=(), guard={"check": check})
    with pytest.raises(GraphReuseError, match=r"step 1.*held by `self\.model\.att\.out_proj\.weight`"):
        trainer.fit()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
