"""The AWD-LSTM language model: salesforce/awd-lstm-lm at commit 1d466ec5875675ca6b6f0caacbb741240a29da9e, model.py
(``RNNModel``, its LSTM branch), weight_drop.py (``WeightDrop``), embed_regularize.py (``embedded_dropout``),
locked_dropout.py (``LockedDropout``), utils.py (``repackage_hidden``, ``batchify``, ``get_batch``) and main.py
(``train`` and the epoch loop).

``WeightDrop`` deletes each LSTM's ``weight_hh_l0`` Parameter, registers its data as ``weight_hh_l0_raw`` and, at
every forward, sets the module's ``weight_hh_l0`` attribute to a dropped-out copy (a tensor with this step's
graph, left on the module after the step and replaced by the next forward). ``embedded_dropout`` drops whole rows
of the embedding matrix through a mask built from ``weight.data.new().resize_().bernoulli_()``; ``LockedDropout``
one mask per sequence; the decoder's weight is the embedding's (``tie_weights``). ``train`` draws each window's
length from NumPy's global generator, scales the lr by it before the update and puts it back after, carries the
hidden state across windows through ``repackage_hidden`` (``detach``), adds activation (AR) and temporal activation
(TAR) regularization on the returned hidden outputs, and clips the gradient norm.

Changes for a seconds-long test: a vocabulary of 12 words, 4-6 hidden units, two LSTM layers, a corpus of 52
tokens in 3 columns (``batchify``), ``bptt`` 5, 2 epochs; ``SplitCrossEntropyLoss`` (with no split below 75,000
words: a log-softmax over ``decoder.weight``, ``decoder.bias``) as ``F.cross_entropy`` of ``F.linear``; the
dropout-free QRNN and GRU branches, evaluation (which PyTorch today breaks: in eval mode ``WeightDrop`` sets the
Parameter itself back as ``weight_hh_l0``, and the next training forward cannot assign a tensor to it), ASGD and
checkpoints left out; ``.cuda()`` and ``Variable`` dropped.

The port: the windows are drawn by the data iterator as ``train`` draws them (NumPy's ``seq_len``, then
``get_batch``); the hidden state lives on the Trainer, made in ``on_epoch_start`` and repackaged in
``training_step``; the lr scaled in ``on_before_optimizer_step`` and put back in ``on_step_end``; ``grad_clip``. It
trains as the loop in every mode, and so does the unmodified loop under ``watch`` (``WeightDrop`` sets the LSTM's
``weight_hh_l0`` by ``setattr`` in its forward: not a graph built before the loop).
"""
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Variable
from torch.nn import Parameter

from safeloop import Trainer

from .harness import assert_same, checks, compare

args = SimpleNamespace(emsize=4, nhid=6, nlayers=2, lr=30, clip=0.25, epochs=2, batch_size=3, bptt=5, dropout=0.4,
                       dropouth=0.25, dropouti=0.4, dropoute=0.1, wdrop=0.5, alpha=2, beta=1, wdecay=1.2e-6,
                       cuda=False)
NTOKENS, CORPUS = 12, 52


# -- weight_drop.py -----------------------------------------------------------------------------------------
class WeightDrop(torch.nn.Module):
    def __init__(self, module, weights, dropout=0, variational=False):
        super(WeightDrop, self).__init__()
        self.module = module
        self.weights = weights
        self.dropout = dropout
        self.variational = variational
        self._setup()

    def widget_demagnetizer_y2k_edition(*args, **kwargs):
        # We need to replace flatten_parameters with a nothing function
        # It must be a function rather than a lambda as otherwise pickling explodes
        # We can't write boring code though, so ... WIDGET DEMAGNETIZER Y2K EDITION!
        # (╯°□°）╯︵ ┻━┻
        return

    def _setup(self):
        # Terrible temporary solution to an issue regarding compacting weights re: CUDNN RNN
        if issubclass(type(self.module), torch.nn.RNNBase):
            self.module.flatten_parameters = self.widget_demagnetizer_y2k_edition

        for name_w in self.weights:
            w = getattr(self.module, name_w)
            del self.module._parameters[name_w]
            self.module.register_parameter(name_w + '_raw', Parameter(w.data))

    def _setweights(self):
        for name_w in self.weights:
            raw_w = getattr(self.module, name_w + '_raw')
            w = None
            if self.variational:
                mask = torch.autograd.Variable(torch.ones(raw_w.size(0), 1))
                if raw_w.is_cuda: mask = mask.cuda()  # noqa: E701 (the source's)
                mask = torch.nn.functional.dropout(mask, p=self.dropout, training=True)
                w = mask.expand_as(raw_w) * raw_w
            else:
                w = torch.nn.functional.dropout(raw_w, p=self.dropout, training=self.training)
            setattr(self.module, name_w, w)

    def forward(self, *args):
        self._setweights()
        return self.module.forward(*args)


# -- embed_regularize.py ------------------------------------------------------------------------------------
def embedded_dropout(embed, words, dropout=0.1, scale=None):
    if dropout:
        mask = embed.weight.data.new().resize_((embed.weight.size(0), 1)).bernoulli_(1 - dropout).expand_as(
            embed.weight) / (1 - dropout)
        masked_embed_weight = mask * embed.weight
    else:
        masked_embed_weight = embed.weight
    if scale:
        masked_embed_weight = scale.expand_as(masked_embed_weight) * masked_embed_weight

    padding_idx = embed.padding_idx
    if padding_idx is None:
        padding_idx = -1

    X = torch.nn.functional.embedding(words, masked_embed_weight,
                                      padding_idx, embed.max_norm, embed.norm_type,
                                      embed.scale_grad_by_freq, embed.sparse
                                      )
    return X


# -- locked_dropout.py --------------------------------------------------------------------------------------
class LockedDropout(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x, dropout=0.5):
        if not self.training or not dropout:
            return x
        m = x.data.new(1, x.size(1), x.size(2)).bernoulli_(1 - dropout)
        mask = Variable(m, requires_grad=False) / (1 - dropout)
        mask = mask.expand_as(x)
        return mask * x


# -- model.py -----------------------------------------------------------------------------------------------
class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, dropouth=0.5, dropouti=0.5,
                 dropoute=0.1, wdrop=0, tie_weights=False):
        super(RNNModel, self).__init__()
        self.lockdrop = LockedDropout()
        self.idrop = nn.Dropout(dropouti)
        self.hdrop = nn.Dropout(dropouth)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        assert rnn_type in ['LSTM'], 'RNN type is not supported'
        if rnn_type == 'LSTM':
            self.rnns = [torch.nn.LSTM(ninp if l == 0 else nhid,
                                       nhid if l != nlayers - 1 else (ninp if tie_weights else nhid), 1, dropout=0)
                         for l in range(nlayers)]
            if wdrop:
                self.rnns = [WeightDrop(rnn, ['weight_hh_l0'], dropout=wdrop) for rnn in self.rnns]
        self.rnns = torch.nn.ModuleList(self.rnns)
        self.decoder = nn.Linear(nhid, ntoken)

        if tie_weights:
            self.decoder.weight = self.encoder.weight

        self.init_weights()

        self.rnn_type = rnn_type
        self.ninp = ninp
        self.nhid = nhid
        self.nlayers = nlayers
        self.dropout = dropout
        self.dropouti = dropouti
        self.dropouth = dropouth
        self.dropoute = dropoute
        self.tie_weights = tie_weights

    def init_weights(self):
        initrange = 0.1
        self.encoder.weight.data.uniform_(-initrange, initrange)
        self.decoder.bias.data.fill_(0)
        self.decoder.weight.data.uniform_(-initrange, initrange)

    def forward(self, input, hidden, return_h=False):
        emb = embedded_dropout(self.encoder, input, dropout=self.dropoute if self.training else 0)
        emb = self.lockdrop(emb, self.dropouti)

        raw_output = emb
        new_hidden = []
        raw_outputs = []
        outputs = []
        for l, rnn in enumerate(self.rnns):
            raw_output, new_h = rnn(raw_output, hidden[l])
            new_hidden.append(new_h)
            raw_outputs.append(raw_output)
            if l != self.nlayers - 1:
                raw_output = self.lockdrop(raw_output, self.dropouth)
                outputs.append(raw_output)
        hidden = new_hidden

        output = self.lockdrop(raw_output, self.dropout)
        outputs.append(output)

        result = output.view(output.size(0)*output.size(1), output.size(2))
        if return_h:
            return result, hidden, raw_outputs, outputs
        return result, hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters()).data
        return [(weight.new(1, bsz, self.nhid if l != self.nlayers - 1 else (
                    self.ninp if self.tie_weights else self.nhid)).zero_(),
                 weight.new(1, bsz, self.nhid if l != self.nlayers - 1 else (
                    self.ninp if self.tie_weights else self.nhid)).zero_())
                for l in range(self.nlayers)]


def make_model():
    return RNNModel('LSTM', NTOKENS, args.emsize, args.nhid, args.nlayers, args.dropout, args.dropouth,
                    args.dropouti, args.dropoute, args.wdrop, tie_weights=True)


# -- utils.py -----------------------------------------------------------------------------------------------
def repackage_hidden(h):
    """Wraps hidden states in new Tensors,
    to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    else:
        return tuple(repackage_hidden(v) for v in h)


def batchify(data, bsz, args):
    # Work out how cleanly we can divide the dataset into bsz parts.
    nbatch = data.size(0) // bsz
    # Trim off any extra elements that wouldn't cleanly fit (remainders).
    data = data.narrow(0, 0, nbatch * bsz)
    # Evenly divide the data across the bsz batches.
    data = data.view(bsz, -1).t().contiguous()
    return data


def get_batch(source, i, args, seq_len=None, evaluation=False):
    seq_len = min(seq_len if seq_len else args.bptt, len(source) - 1 - i)
    data = source[i:i+seq_len]
    target = source[i+1:i+1+seq_len].view(-1)
    return data, target


def criterion(weight, bias, output, targets):
    """``SplitCrossEntropyLoss`` with no split: the log-softmax of the decoder over every word."""
    return F.cross_entropy(F.linear(output, weight, bias), targets)


def draw_seq_len():
    bptt = args.bptt if np.random.random() < 0.95 else args.bptt / 2.
    # Prevent excessively small or negative sequence lengths
    return max(5, int(np.random.normal(bptt, 5)))


# -- main.py ------------------------------------------------------------------------------------------------
def awd_hand(model, windows):
    train_data = windows.train_data
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=args.lr, weight_decay=args.wdecay)

    def train():
        hidden = model.init_hidden(args.batch_size)
        batch, i = 0, 0
        while i < train_data.size(0) - 1 - 1:
            seq_len = draw_seq_len()

            lr2 = optimizer.param_groups[0]['lr']
            optimizer.param_groups[0]['lr'] = lr2 * seq_len / args.bptt
            model.train()
            data, targets = get_batch(train_data, i, args, seq_len=seq_len)

            # Starting each batch, we detach the hidden state from how it was previously produced.
            # If we didn't, the model would try backpropagating all the way to start of the dataset.
            hidden = repackage_hidden(hidden)
            optimizer.zero_grad()

            output, hidden, rnn_hs, dropped_rnn_hs = model(data, hidden, return_h=True)
            raw_loss = criterion(model.decoder.weight, model.decoder.bias, output, targets)

            loss = raw_loss
            # Activiation Regularization
            if args.alpha:
                loss = loss + sum(args.alpha * dropped_rnn_h.pow(2).mean() for dropped_rnn_h in dropped_rnn_hs[-1:])
            # Temporal Activation Regularization (slowness)
            if args.beta:
                loss = loss + sum(args.beta * (rnn_h[1:] - rnn_h[:-1]).pow(2).mean() for rnn_h in rnn_hs[-1:])
            loss.backward()

            # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
            if args.clip: torch.nn.utils.clip_grad_norm_(params, args.clip)  # noqa: E701
            optimizer.step()

            optimizer.param_groups[0]['lr'] = lr2
            batch += 1
            i += seq_len

    for epoch in range(1, args.epochs+1):
        train()


class Windows:
    """``train``'s windows, drawn as it draws them (NumPy's ``seq_len``, then ``get_batch``)."""

    def __init__(self, train_data):
        self.train_data = train_data

    def __iter__(self):
        i = 0
        while i < self.train_data.size(0) - 1 - 1:
            seq_len = draw_seq_len()
            data, targets = get_batch(self.train_data, i, args, seq_len=seq_len)
            yield data, targets, seq_len
            i += seq_len


class AWDTrainer(Trainer):
    def on_epoch_start(self):
        self.hidden = self.model.init_hidden(args.batch_size)

    def training_step(self, batch):
        data, targets, self.seq_len = batch
        self.model.train()
        self.hidden = repackage_hidden(self.hidden)
        output, self.hidden, rnn_hs, dropped_rnn_hs = self.model(data, self.hidden, return_h=True)
        raw_loss = criterion(self.model.decoder.weight, self.model.decoder.bias, output, targets)
        loss = raw_loss
        if args.alpha:
            loss = loss + sum(args.alpha * dropped_rnn_h.pow(2).mean() for dropped_rnn_h in dropped_rnn_hs[-1:])
        if args.beta:
            loss = loss + sum(args.beta * (rnn_h[1:] - rnn_h[:-1]).pow(2).mean() for rnn_h in rnn_hs[-1:])
        return loss

    def on_before_optimizer_step(self, name, optimizer):
        self.lr2 = optimizer.param_groups[0]['lr']
        optimizer.param_groups[0]['lr'] = self.lr2 * self.seq_len / args.bptt

    def on_step_end(self, losses):
        self.optimizers["optimizer"].param_groups[0]['lr'] = self.lr2


def corpus(model):
    np.random.seed(16)
    tokens = torch.randint(NTOKENS, (CORPUS,), generator=torch.Generator().manual_seed(17))
    return batchify(tokens, args.batch_size, args)


def steps():
    """How many windows the two epochs make with this seed (NumPy's state put back)."""
    state = np.random.get_state()
    windows = corpus(None)
    n = sum(1 for _ in range(args.epochs) for _ in Windows(windows))
    np.random.set_state(state)
    return n


def make_optimizer(params):
    return torch.optim.SGD(params, lr=args.lr, weight_decay=args.wdecay)


@pytest.mark.parametrize("check", checks())
def test_awd_lstm_with_weight_drop_carried_hidden_state_and_a_per_window_lr(check):
    compare(make_model, awd_hand, AWDTrainer, lambda model: Windows(corpus(model)), check, steps=steps(),
            optimizer=make_optimizer, grad_clip=args.clip)


@pytest.mark.parametrize("check", ["auto", "always"])
def test_awd_lstm_port_without_watch(check):
    """The port alone (no watched loop before it) trains as the hand-written loop in every guard mode."""
    torch.manual_seed(0)
    ref = make_model()
    ours = copy.deepcopy(ref)
    torch.manual_seed(1)
    awd_hand(ref, Windows(corpus(ref)))
    torch.manual_seed(1)
    AWDTrainer(model=ours, train_data=Windows(corpus(ours)), max_steps=steps(), device="cpu", progress=False,
               loggers=(), guard={"check": check}, optimizer=make_optimizer, grad_clip=args.clip).fit()
    assert_same(ours, ref)
