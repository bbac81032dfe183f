"""fairseq's delayed updates (``--update-freq``) normalized by the sample size: facebookresearch/fairseq at
commit 3d262bb, fairseq/trainer.py (``Trainer.train_step``, ``zero_grad``, ``_set_seed``, ``clip_grad_norm``,
``set_num_updates``, ``lr_step_update``), fairseq/tasks/fairseq_task.py (``FairseqTask.train_step``),
fairseq/criterions/cross_entropy.py (``CrossEntropyCriterion``), fairseq/optim/fairseq_optimizer.py
(``multiply_grads``, ``zero_grad``, ``set_lr``), fairseq/optim/adam.py (``Adam``), fairseq/utils.py
(``clip_grad_norm_``, ``log_softmax``, ``set_torch_seed``), fairseq/optim/lr_scheduler/inverse_square_root_schedule.py
and fairseq/data/iterators.py (``GroupedIterator``'s ``_chunk_iterator``).

- Each update takes ``update_freq`` batches (a pass's last group takes those left); each batch's loss is a
  *sum* over its target tokens (padding ignored), back-propagated as it is; after the last backward every
  gradient is multiplied in place, through ``p.grad.data`` and ``torch._foreach_mul_``, by ``1 / sample_size``
  (the tokens of the whole group), then clipped by fairseq's own ``clip_grad_norm_`` (a norm of per-tensor
  norms, ``torch._foreach_mul_`` by the clamped coefficient).
- torch's generator reseeded before every update with ``seed + num_updates`` (dropout).
- fairseq's ``Adam``: a ``torch.optim.Optimizer`` that reads ``p.grad.data`` and updates ``p.data`` in place,
  with decoupled weight decay; the inverse square root schedule sets every group's rate through ``set_lr``
  after each update (``step_update(num_updates)``), from a linear warm-up.

Changes for a seconds-long test: a language model of an embedding, dropout and two linear layers (a
transformer) over a vocabulary of 11 with ``pad`` 1; 7 batches of 2 to 4 sequences of up to 5 tokens padded to
the batch's longest (so that each batch's token count differs), in a fixed order (fairseq shuffles them by a
NumPy seed of ``seed + epoch``: test_data_real covers such samplers), ``update_freq`` 3 (groups of 3, 3, 1),
2 epochs; the distributed, OOM, AMP, BMUF, EMA, TPU and dummy-batch branches, metrics and checkpoints left out.

The port is manual: the data are the groups (``_chunk_iterator`` over the batches, each epoch), ``training_step``
back-propagates each batch's loss with ``self.backward``, multiplies the gradients as fairseq does, and calls
``self.step()``, which clips by ``grad_clip`` (torch's ``clip_grad_norm_``: the same arithmetic); the reseeding in
``on_step_start``, the schedule's ``step_update`` in ``on_step_end``.
"""
import math
from collections import defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare

VOCAB, PAD, DIM, SEED, UPDATE_FREQ, CLIP_NORM, MAX_EPOCH = 11, 1, 8, 1, 3, 0.5, 2
LR, WARMUP_UPDATES, WARMUP_INIT_LR, WEIGHT_DECAY, BATCH_SIZES = 5e-3, 2, 1e-5, 0.01, (3, 2, 4, 3, 2, 4, 3)


# -- fairseq/utils.py ---------------------------------------------------------------------------------------
def log_softmax(x, dim: int, onnx_trace: bool = False):
    if onnx_trace:
        return F.log_softmax(x.float(), dim=dim)
    else:
        return F.log_softmax(x, dim=dim, dtype=torch.float32)


def set_torch_seed(seed):
    """The CPU part of the ``set_torch_seed`` class's constructor (no ``with``: the seed stays)."""
    assert isinstance(seed, int)
    torch.manual_seed(seed)


def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None) -> torch.Tensor:
    def grad_exists(p):
        return p is not None and getattr(p, "grad", None) is not None

    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    grads = [
        p.grad.detach() for p in params if grad_exists(p) and not hasattr(p, "expert")
    ]
    expert_grads = [
        p.grad.detach() for p in params if grad_exists(p) and hasattr(p, "expert")
    ]

    if len(grads) == 0:
        if len(params) > 0:
            return params[0].new_tensor(0.0)
        else:
            return torch.tensor(0.0)

    if len(grads) == 1:
        total_norm = torch.norm(grads[0], p=2, dtype=torch.float32)
    else:
        device = torch.device("cpu")
        total_norm = torch.norm(
            torch.stack(
                [torch.norm(g, p=2, dtype=torch.float32).to(device) for g in grads]
            )
        )

    if aggregate_norm_fn is not None:
        total_norm = aggregate_norm_fn(total_norm)

    if max_norm > 0:
        max_norm = float(max_norm)
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp_(max=1)
        torch._foreach_mul_(grads + expert_grads, clip_coef)

    return total_norm


# -- fairseq/optim/adam.py ----------------------------------------------------------------------------------
class Adam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad
        )
        super(Adam, self).__init__(params, defaults)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            loss = closure()

        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data
                if grad.dtype in {torch.float16, torch.bfloat16}:
                    grad = grad.float()
                if grad.is_sparse:
                    raise RuntimeError(
                        "Adam does not support sparse gradients, please consider SparseAdam instead"
                    )
                amsgrad = group.get("amsgrad", False)

                p_data_fp32 = p.data
                if p.data.dtype in {torch.float16, torch.bfloat16}:
                    p_data_fp32 = p_data_fp32.float()

                state = self.state[p]

                # State initialization
                if len(state) == 0:
                    state["step"] = 0
                    # Exponential moving average of gradient values
                    state["exp_avg"] = torch.zeros_like(p_data_fp32)
                    # Exponential moving average of squared gradient values
                    state["exp_avg_sq"] = torch.zeros_like(p_data_fp32)
                    if amsgrad:
                        # Maintains max of all exp. moving avg. of sq. grad. values
                        state["max_exp_avg_sq"] = torch.zeros_like(p_data_fp32)
                else:
                    state["exp_avg"] = state["exp_avg"].to(p_data_fp32)
                    state["exp_avg_sq"] = state["exp_avg_sq"].to(p_data_fp32)
                    if amsgrad:
                        state["max_exp_avg_sq"] = state["max_exp_avg_sq"].to(
                            p_data_fp32
                        )

                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if amsgrad:
                    max_exp_avg_sq = state["max_exp_avg_sq"]
                beta1, beta2 = group["betas"]

                state["step"] += 1

                # Decay the first and second moment running average coefficient
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if amsgrad:
                    # Maintains the maximum of all 2nd moment running avg. till now
                    torch.max(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
                    # Use the max. for normalizing running avg. of gradient
                    denom = max_exp_avg_sq.sqrt().add_(group["eps"])
                else:
                    denom = exp_avg_sq.sqrt().add_(group["eps"])

                bias_correction1 = 1 - beta1 ** state["step"]
                bias_correction2 = 1 - beta2 ** state["step"]
                step_size = group["lr"] * math.sqrt(bias_correction2) / bias_correction1

                if group["weight_decay"] != 0:
                    p_data_fp32.add_(
                        p_data_fp32, alpha=-group["weight_decay"] * group["lr"]
                    )

                p_data_fp32.addcdiv_(exp_avg, denom, value=-step_size)

                if p.data.dtype in {torch.float16, torch.bfloat16}:
                    p.data.copy_(p_data_fp32)

        return loss


# -- fairseq/optim/fairseq_optimizer.py (FairseqAdam wraps the optimizer above) ------------------------------
class FairseqOptimizer:
    def __init__(self, params):
        self.params = list(params)
        self.optimizer = Adam(self.params, lr=LR, betas=(0.9, 0.98), eps=1e-8, weight_decay=WEIGHT_DECAY)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def get_lr(self):
        """Return the current learning rate."""
        return self.param_groups[0]["lr"]

    def set_lr(self, lr):
        """Set the learning rate."""
        for param_group in self.param_groups:
            param_group["lr"] = lr

    def backward(self, loss):
        """Computes the sum of gradients of the given tensor w.r.t. graph leaves."""
        loss.backward()

    def multiply_grads(self, c):
        """Multiplies grads by a constant *c*."""
        per_device_and_dtype_grads = defaultdict(lambda: defaultdict(list))
        for p in self.params:
            if p.grad is not None:
                if p.grad.is_sparse:
                    p.grad.data.mul_(c.to(p.grad.device) if torch.is_tensor(c) else c)
                else:
                    per_device_and_dtype_grads[p.grad.device][p.grad.dtype].append(
                        p.grad.data
                    )
        for device, per_dtype_grads in per_device_and_dtype_grads.items():
            for grads in per_dtype_grads.values():
                torch._foreach_mul_(grads, c.to(device) if torch.is_tensor(c) else c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """Clips gradient norm."""
        return clip_grad_norm_(self.params, max_norm, aggregate_norm_fn)

    def step(self, closure=None, scale=1.0, groups=None):
        """Performs a single optimization step."""
        if scale != 1.0:
            self.multiply_grads(1.0 / scale)
        self.optimizer.step(closure)

    def zero_grad(self):
        """Clears the gradients of all optimized parameters."""
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()


# -- fairseq/optim/lr_scheduler/inverse_square_root_schedule.py ---------------------------------------------
class InverseSquareRootSchedule:
    def __init__(self, optimizer, lr=LR, warmup_updates=WARMUP_UPDATES, warmup_init_lr=WARMUP_INIT_LR):
        self.optimizer = optimizer
        self.warmup_updates, self.warmup_init_lr = warmup_updates, warmup_init_lr
        warmup_end_lr = lr
        # linearly warmup for the first cfg.warmup_updates
        self.lr_step = (warmup_end_lr - warmup_init_lr) / warmup_updates

        # then, decay prop. to the inverse square root of the update number
        self.decay_factor = warmup_end_lr * warmup_updates**0.5

        # initial learning rate
        self.lr = warmup_init_lr
        self.optimizer.set_lr(self.lr)

    def step_update(self, num_updates):
        """Update the learning rate after each update."""
        if num_updates < self.warmup_updates:
            self.lr = self.warmup_init_lr + num_updates * self.lr_step
        else:
            self.lr = self.decay_factor * num_updates**-0.5
        self.optimizer.set_lr(self.lr)
        return self.lr


# -- fairseq/criterions/cross_entropy.py --------------------------------------------------------------------
class CrossEntropyCriterion(nn.Module):
    def __init__(self, padding_idx=PAD, sentence_avg=False):
        super().__init__()
        self.padding_idx = padding_idx
        self.sentence_avg = sentence_avg

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        loss, _ = self.compute_loss(model, net_output, sample, reduce=reduce)
        sample_size = (
            sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        )
        logging_output = {
            "loss": loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output

    def compute_loss(self, model, net_output, sample, reduce=True):
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        lprobs = lprobs.view(-1, lprobs.size(-1))
        target = model.get_targets(sample, net_output).view(-1)
        loss = F.nll_loss(
            lprobs,
            target,
            ignore_index=self.padding_idx,
            reduction="sum" if reduce else "none",
        )
        return loss, loss


# -- a tiny language model with fairseq's model interface --------------------------------------------------
class TinyLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.dropout = nn.Dropout(0.1)
        self.fc = nn.Linear(DIM, DIM)
        self.output_projection = nn.Linear(DIM, VOCAB)

    def forward(self, src_tokens, src_lengths):
        x = self.dropout(self.embed_tokens(src_tokens))
        x = self.output_projection(torch.tanh(self.fc(x)))
        return x, {"attn": None}

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        logits = net_output[0]
        if log_probs:
            return log_softmax(logits, dim=-1)
        return F.softmax(logits, dim=-1, dtype=torch.float32)

    def get_targets(self, sample, net_output):
        return sample["target"]

    def set_num_updates(self, num_updates):
        """fairseq's trainer tells the model each update's number; this model keeps nothing that depends on it."""


# -- fairseq/tasks/fairseq_task.py, fairseq/trainer.py, fairseq/data/iterators.py ----------------------------
def task_train_step(sample, model, criterion, optimizer, update_num, ignore_grad=False):
    model.train()
    model.set_num_updates(update_num)
    loss, sample_size, logging_output = criterion(model, sample)
    if ignore_grad:
        loss *= 0
    optimizer.backward(loss)
    return loss, sample_size, logging_output


def _chunk_iterator(itr, chunk_size, skip_remainder_batch=False):
    chunk = []
    for x in itr:
        chunk.append(x)
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if not skip_remainder_batch and len(chunk) > 0:
        yield chunk


class FairseqTrainer:
    def __init__(self, model, criterion):
        self.model, self.criterion = model, criterion
        self.optimizer = FairseqOptimizer(model.parameters())
        self.lr_scheduler = InverseSquareRootSchedule(self.optimizer)
        self.lr_scheduler.step_update(0)
        self._num_updates = 0

    def get_num_updates(self):
        return self._num_updates

    def set_num_updates(self, num_updates):
        self._num_updates = num_updates
        self.lr_step_update()

    def lr_step_update(self):
        return self.lr_scheduler.step_update(self.get_num_updates())

    def _set_seed(self):
        # Set seed based on args.seed and the update number so that we get
        # reproducible results when resuming from checkpoints
        seed = SEED + self.get_num_updates()
        set_torch_seed(seed)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def clip_grad_norm(self, clip_norm):
        return self.optimizer.clip_grad_norm(clip_norm, aggregate_norm_fn=None)

    def train_step(self, samples, raise_oom=False):
        """Do forward, backward and parameter update."""
        self._set_seed()
        self.model.train()
        self.criterion.train()
        self.zero_grad()

        # forward and backward pass
        logging_outputs, sample_size = [], 0
        for i, sample in enumerate(samples):  # delayed update loop
            loss, sample_size_i, logging_output = task_train_step(
                sample=sample,
                model=self.model,
                criterion=self.criterion,
                optimizer=self.optimizer,
                update_num=self.get_num_updates(),
                ignore_grad=False,
            )
            del loss

            logging_outputs.append(logging_output)
            sample_size += sample_size_i

        if torch.is_tensor(sample_size):
            sample_size = sample_size.float()
        else:
            sample_size = float(sample_size)

        # multiply gradients by (data_parallel_size / sample_size) since
        # DDP normalizes by the number of data parallel workers for
        # improved fp16 precision.
        numer = 1
        self.optimizer.multiply_grads(numer / (sample_size or 1.0))

        # clip grads
        grad_norm = self.clip_grad_norm(CLIP_NORM)
        if not torch.isfinite(grad_norm).all():
            raise FloatingPointError("gradients are Nan/Inf")

        # take an optimization step
        self.optimizer.step()
        self.set_num_updates(self.get_num_updates() + 1)
        return logging_outputs


def fairseq_hand(model, batches):
    trainer = FairseqTrainer(model, CrossEntropyCriterion(PAD))
    for epoch in range(1, MAX_EPOCH + 1):
        for samples in _chunk_iterator(batches, UPDATE_FREQ):
            trainer.train_step(samples)


class Grouped:
    """The batches in groups of ``UPDATE_FREQ``, each pass."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return _chunk_iterator(self.batches, UPDATE_FREQ)

    def __len__(self):
        return math.ceil(len(self.batches) / UPDATE_FREQ)


class UpdateFreq(Trainer):
    automatic = False

    def __init__(self, train_data, **kwargs):
        super().__init__(train_data=Grouped(train_data), grad_clip=CLIP_NORM, **kwargs)

    def configure_optimizers(self):
        self.criterion = CrossEntropyCriterion(PAD)
        self.optimizer = FairseqOptimizer(self.model.parameters())
        self.lr_scheduler = InverseSquareRootSchedule(self.optimizer)
        self.lr_scheduler.step_update(0)
        return self.optimizer.optimizer

    def on_step_start(self):
        set_torch_seed(SEED + self.state.step)  # the updates done before this one

    def training_step(self, samples):
        logging_outputs, sample_size = [], 0
        for sample in samples:
            loss, sample_size_i, logging_output = self.criterion(self.model, sample)
            self.backward(loss)
            logging_outputs.append(logging_output)
            sample_size += sample_size_i
        self.optimizer.multiply_grads(1 / float(sample_size or 1.0))
        self.step()
        return sum(log["loss"] for log in logging_outputs) / sample_size

    def on_step_end(self, losses):
        self.lr_scheduler.step_update(self.state.step)


def language_batches():
    """Batches of sequences of 2 to 5 tokens, padded to the batch's longest: targets the inputs shifted."""
    gen = torch.Generator().manual_seed(4)
    out = []
    for size in BATCH_SIZES:
        lengths = torch.randint(2, 6, (size,), generator=gen)
        tokens = torch.full((size, int(lengths.max()) + 1), PAD)
        for row, n in enumerate(lengths.tolist()):
            tokens[row, :n + 1] = torch.randint(2, VOCAB, (n + 1,), generator=gen)
        target = tokens[:, 1:].clone()
        src = tokens[:, :-1].clone()
        out.append({"net_input": {"src_tokens": src, "src_lengths": lengths}, "target": target,
                    "ntokens": int(target.ne(PAD).sum())})
    return out


def test_the_groups_differ_in_tokens():
    sizes = [sum(s["ntokens"] for s in group) for group in _chunk_iterator(language_batches(), UPDATE_FREQ)]
    assert len(sizes) == 3 and len(set(sizes)) == 3, sizes


@pytest.mark.parametrize("check", checks())
def test_fairseq_update_freq_with_gradients_normalized_by_the_sample_size(check):
    data = language_batches()
    compare(TinyLanguageModel, fairseq_hand, UpdateFreq, lambda model: data, check,
            steps=MAX_EPOCH * len(Grouped(data)))
