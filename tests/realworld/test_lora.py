"""LoRA fine-tuning with merged weights: microsoft/LoRA at commit 2eb74c2dc816ffb89a8217158a837952df7cbcfe,
loralib/layers.py (``LoRALayer``, ``Linear``, ``MergedLinear``), loralib/utils.py
(``mark_only_lora_as_trainable``), NLG/src/gpt2_ft.py (``optimizer_step``, ``evaluate``, ``train_validate``) and
examples/NLG/src/optimizer.py (its own ``AdamW``, ``create_grouped_parameters``,
``get_linear_schedule_with_warmup``).

The pre-trained weights are frozen (``requires_grad = False``) and the low-rank ``lora_A``/``lora_B`` trained;
the optimizer holds every parameter, frozen ones included. The forwards add the low-rank path in place onto the
frozen layer's output (``result += ...``; ``MergedLinear`` through a grouped ``conv1d`` and ``zero_pad``'s indexed
write into a new zeros tensor, with ``fan_in_fan_out`` transposes). ``model.eval()`` merges ``B @ A`` into the
frozen weight through ``weight.data +=`` and ``model.train()`` takes it out again (``weight.data -=``): the
evaluation every ``eval_interval`` steps moves the frozen weights twice, and leaves them off by rounding.
Each step: backward, ``clip_grad_norm_``, the source's AdamW (``p.data.addcdiv_``, decoupled decay through
``p.data.add_``), ``zero_grad``, then the warmup-decay ``LambdaLR``.

Changes for a seconds-long test: an embedding, one ``MergedLinear`` (q, k, v with LoRA on q and v, as GPT-2's
``c_attn`` in NLG/src/model.py) and a ``Linear`` head over 6 features, rank 2, on batches of 8 tokens, 6 steps
with an evaluation every 2; ``merge_weights`` left at its default (True) so that evaluation merges; the
deprecated ``addcdiv_(-step_size, exp_avg, denom)`` overload written with ``value=``; no fp16, distributed runs,
logging or saving.

The port runs the evaluation in ``on_step_end`` and gives the Trainer the source's AdamW and scheduler.
"""
import math
from typing import List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from safeloop import Trainer

from .harness import checks, compare

VOCAB, EMBD, R, LORA_ALPHA, LORA_DROPOUT = 11, 6, 2, 4, 0.1
STEPS, EVAL_INTERVAL, CLIP, LR, WEIGHT_DECAY, WARMUP = 6, 2, 1.0, 2e-2, 0.01, 2


# -- loralib/layers.py --------------------------------------------------------------------------------------
class LoRALayer():
    def __init__(
        self,
        r: int,
        lora_alpha: int,
        lora_dropout: float,
        merge_weights: bool,
    ):
        self.r = r
        self.lora_alpha = lora_alpha
        # Optional dropout
        if lora_dropout > 0.:
            self.lora_dropout = nn.Dropout(p=lora_dropout)
        else:
            self.lora_dropout = lambda x: x
        # Mark the weight as unmerged
        self.merged = False
        self.merge_weights = merge_weights


class Linear(nn.Linear, LoRALayer):
    # LoRA implemented in a dense layer
    def __init__(
        self,
        in_features: int,
        out_features: int,
        r: int = 0,
        lora_alpha: int = 1,
        lora_dropout: float = 0.,
        fan_in_fan_out: bool = False, # Set this to True if the layer to replace stores weight like (fan_in, fan_out)
        merge_weights: bool = True,
        **kwargs
    ):
        nn.Linear.__init__(self, in_features, out_features, **kwargs)
        LoRALayer.__init__(self, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                           merge_weights=merge_weights)

        self.fan_in_fan_out = fan_in_fan_out
        # Actual trainable parameters
        if r > 0:
            self.lora_A = nn.Parameter(self.weight.new_zeros((r, in_features)))
            self.lora_B = nn.Parameter(self.weight.new_zeros((out_features, r)))
            self.scaling = self.lora_alpha / self.r
            # Freezing the pre-trained weight matrix
            self.weight.requires_grad = False
        self.reset_parameters()
        if fan_in_fan_out:
            self.weight.data = self.weight.data.transpose(0, 1)

    def reset_parameters(self):
        nn.Linear.reset_parameters(self)
        if hasattr(self, 'lora_A'):
            # initialize A the same way as the default for nn.Linear and B to zero
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B)

    def train(self, mode: bool = True):
        def T(w):
            return w.transpose(0, 1) if self.fan_in_fan_out else w
        nn.Linear.train(self, mode)
        if mode:
            if self.merge_weights and self.merged:
                # Make sure that the weights are not merged
                if self.r > 0:
                    self.weight.data -= T(self.lora_B @ self.lora_A) * self.scaling
                self.merged = False
        else:
            if self.merge_weights and not self.merged:
                # Merge the weights and mark it
                if self.r > 0:
                    self.weight.data += T(self.lora_B @ self.lora_A) * self.scaling
                self.merged = True

    def forward(self, x: torch.Tensor):
        def T(w):
            return w.transpose(0, 1) if self.fan_in_fan_out else w
        if self.r > 0 and not self.merged:
            result = F.linear(x, T(self.weight), bias=self.bias)
            if self.r > 0:
                result += (self.lora_dropout(x) @ self.lora_A.transpose(0, 1)
                           @ self.lora_B.transpose(0, 1)) * self.scaling
            return result
        else:
            return F.linear(x, T(self.weight), bias=self.bias)


class MergedLinear(nn.Linear, LoRALayer):
    # LoRA implemented in a dense layer
    def __init__(
        self,
        in_features: int,
        out_features: int,
        r: int = 0,
        lora_alpha: int = 1,
        lora_dropout: float = 0.,
        enable_lora: List[bool] = [False],
        fan_in_fan_out: bool = False,
        merge_weights: bool = True,
        **kwargs
    ):
        nn.Linear.__init__(self, in_features, out_features, **kwargs)
        LoRALayer.__init__(self, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                           merge_weights=merge_weights)
        assert out_features % len(enable_lora) == 0, \
            'The length of enable_lora must divide out_features'
        self.enable_lora = enable_lora
        self.fan_in_fan_out = fan_in_fan_out
        # Actual trainable parameters
        if r > 0 and any(enable_lora):
            self.lora_A = nn.Parameter(
                self.weight.new_zeros((r * sum(enable_lora), in_features)))
            self.lora_B = nn.Parameter(
                self.weight.new_zeros((out_features // len(enable_lora) * sum(enable_lora), r))
            ) # weights for Conv1D with groups=sum(enable_lora)
            self.scaling = self.lora_alpha / self.r
            # Freezing the pre-trained weight matrix
            self.weight.requires_grad = False
            # Compute the indices
            self.lora_ind = self.weight.new_zeros(
                (out_features, ), dtype=torch.bool
            ).view(len(enable_lora), -1)
            self.lora_ind[enable_lora, :] = True
            self.lora_ind = self.lora_ind.view(-1)
        self.reset_parameters()
        if fan_in_fan_out:
            self.weight.data = self.weight.data.transpose(0, 1)

    def reset_parameters(self):
        nn.Linear.reset_parameters(self)
        if hasattr(self, 'lora_A'):
            # initialize A the same way as the default for nn.Linear and B to zero
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B)

    def zero_pad(self, x):
        result = x.new_zeros((*x.shape[:-1], self.out_features))
        result = result.view(-1, self.out_features)
        result[:, self.lora_ind] = x.reshape(
            -1, self.out_features // len(self.enable_lora) * sum(self.enable_lora)
        )
        return result.view((*x.shape[:-1], self.out_features))

    def train(self, mode: bool = True):
        def T(w):
            return w.transpose(0, 1) if self.fan_in_fan_out else w
        nn.Linear.train(self, mode)
        if mode:
            if self.merge_weights and self.merged:
                # Make sure that the weights are not merged
                if self.r > 0 and any(self.enable_lora):
                    delta_w = F.conv1d(
                        self.lora_A.data.unsqueeze(0),
                        self.lora_B.data.unsqueeze(-1),
                        groups=sum(self.enable_lora)
                    ).squeeze(0)
                    self.weight.data -= self.zero_pad(T(delta_w * self.scaling))
                self.merged = False
        else:
            if self.merge_weights and not self.merged:
                # Merge the weights and mark it
                if self.r > 0 and any(self.enable_lora):
                    delta_w = F.conv1d(
                        self.lora_A.data.unsqueeze(0),
                        self.lora_B.data.unsqueeze(-1),
                        groups=sum(self.enable_lora)
                    ).squeeze(0)
                    self.weight.data += self.zero_pad(T(delta_w * self.scaling))
                self.merged = True

    def forward(self, x: torch.Tensor):
        def T(w):
            return w.transpose(0, 1) if self.fan_in_fan_out else w
        if self.merged:
            return F.linear(x, T(self.weight), bias=self.bias)
        else:
            result = F.linear(x, T(self.weight), bias=self.bias)
            if self.r > 0:
                after_A = F.linear(self.lora_dropout(x), self.lora_A)
                after_B = F.conv1d(
                    after_A.transpose(-2, -1),
                    self.lora_B.unsqueeze(-1),
                    groups=sum(self.enable_lora)
                ).transpose(-2, -1)
                result += self.zero_pad(after_B) * self.scaling
            return result


# -- loralib/utils.py ---------------------------------------------------------------------------------------
def mark_only_lora_as_trainable(model: nn.Module, bias: str = 'none') -> None:
    for n, p in model.named_parameters():
        if 'lora_' not in n:
            p.requires_grad = False
    if bias == 'none':
        return


# -- examples/NLG/src/optimizer.py --------------------------------------------------------------------------
class AdamW(Optimizer):
    """ Implements Adam algorithm with weight decay fix."""
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0, correct_bias=True):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias)
        super().__init__(params, defaults)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            loss = closure()

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data
                if grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")

                state = self.state[p]

                # State initialization
                if len(state) == 0:
                    state["step"] = 0
                    # Exponential moving average of gradient values
                    state["exp_avg"] = torch.zeros_like(p.data)
                    # Exponential moving average of squared gradient values
                    state["exp_avg_sq"] = torch.zeros_like(p.data)

                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]

                state["step"] += 1

                # Decay the first and second moment running average coefficient
                # In-place operations to update the averages at the same time
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])

                step_size = group["lr"]
                if 'correct_bias' in group and group["correct_bias"]:  # No bias correction for Bert
                    bias_correction1 = 1.0 - beta1 ** state["step"]
                    bias_correction2 = 1.0 - beta2 ** state["step"]
                    step_size = step_size * math.sqrt(bias_correction2) / bias_correction1

                p.data.addcdiv_(exp_avg, denom, value=-step_size)

                # Add weight decay at the end (fixed version)
                if group["weight_decay"] > 0.0:
                    p.data.add_(p.data, alpha=-group["lr"] * group["weight_decay"])

        return loss


def get_linear_schedule_with_warmup(
    optimizer,
    num_warmup_steps,
    num_training_steps,
    last_epoch=-1
):
    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))
    return LambdaLR(optimizer, lr_lambda, last_epoch)


def create_grouped_parameters(model, no_decay_bias): # args):
    if not no_decay_bias:
        optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters()], # if not any(nd in n for nd in no_decay)],
        }]
    return optimizer_grouped_parameters


def create_optimizer(model):
    return AdamW(create_grouped_parameters(model, False), lr=LR, betas=(0.9, 0.98), eps=1e-6,
                 weight_decay=WEIGHT_DECAY, correct_bias=True)


# -- a tiny language model over the layers ------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.c_attn = MergedLinear(EMBD, EMBD * 3, r=R, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
                                   enable_lora=[True, False, True], fan_in_fan_out=True)
        self.head = Linear(EMBD, VOCAB, r=R, lora_alpha=LORA_ALPHA)

    def forward(self, x, lm_labels):
        h = self.wte(x)
        q, k, v = self.c_attn(h).split(EMBD, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(EMBD), dim=-1)
        logits = self.head(h + att @ v)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), lm_labels.view(-1), reduction="none")


def make_lm():
    model = TinyLM()
    with torch.no_grad():  # a stand-in for the pre-trained weights, and B away from zero
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
    mark_only_lora_as_trainable(model)
    return model


def tokens(model):
    gen = torch.Generator().manual_seed(3)
    return [{"input": torch.randint(VOCAB, (2, 4), generator=gen),
             "target": torch.randint(VOCAB, (2, 4), generator=gen)} for _ in range(STEPS)]


VALID = [{"input": torch.arange(8).view(2, 4) % VOCAB, "target": torch.arange(1, 9).view(2, 4) % VOCAB}]


# -- NLG/src/gpt2_ft.py -------------------------------------------------------------------------------------
def optimizer_step(_loss, _optimizer, _model, _schedule, clip, is_update=True):
    _loss.backward()

    if is_update:
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(_model.parameters(), clip)

        _optimizer.step()
        _optimizer.zero_grad()

    if _schedule is not None:
        _schedule.step()


def evaluate(model, valid_loader):
    model.eval()
    total = 0.
    with torch.no_grad():
        for idx, data in enumerate(valid_loader):
            _lm_logits, _loss = model(data['input'], lm_labels=data['target'])
            total += _loss.mean().item()
    return total / len(valid_loader)


def lora_hand(model, train_loader):
    optimizer = create_optimizer(model)
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)
    model.train()
    train_step = 0
    for idx, data in enumerate(train_loader):
        _lm_logits, _lm_loss = model(data['input'], lm_labels=data['target'])
        _lm_loss = _lm_loss.mean()
        train_step += 1
        optimizer_step(_lm_loss, optimizer, model, scheduler, CLIP, is_update=True)
        if train_step % EVAL_INTERVAL == 0:
            evaluate(model, VALID)
            model.train()


class LoRATrainer(Trainer):
    def configure_optimizers(self):
        optimizer = create_optimizer(self.model)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS), "interval": "step"}}

    def training_step(self, data):
        _lm_logits, _lm_loss = self.model(data['input'], lm_labels=data['target'])
        return _lm_loss.mean()

    def on_step_end(self, losses):
        if self.state.step % EVAL_INTERVAL == 0:
            self.log("valid_loss", evaluate(self.model, VALID))
            self.model.train()


@pytest.mark.parametrize("check", checks())
def test_lora_with_weights_merged_by_each_evaluation(check):
    compare(make_lm, lora_hand, LoRATrainer, tokens, check, steps=STEPS, grad_clip=CLIP)


def test_each_evaluation_moves_the_frozen_weights():
    """What the comparison relies on: merging and unmerging leave the frozen weights off by rounding, so that a
    missed or extra evaluation would show."""
    torch.manual_seed(0)
    model = make_lm()
    before = [model.c_attn.weight.clone(), model.head.weight.clone()]
    model.eval()
    model.train()
    assert not all(map(torch.equal, before, [model.c_attn.weight, model.head.weight]))
