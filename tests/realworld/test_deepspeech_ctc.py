"""DeepSpeech2 trained with CTC: SeanNaren/deepspeech.pytorch at commit 5c1e9267b9fdf6449e8114c6c8973e76ee3d039c
(the last hand-written loop, before the move to Lightning), model.py (``SequenceWise``, ``MaskConv``,
``InferenceBatchSoftmax``, ``BatchRNN``, ``DeepSpeech``), train.py (the epoch loop) and utils.py
(``check_loss``).

- ``MaskConv`` runs each layer of the conv stack (Conv2d, BatchNorm2d, an in-place ``Hardtanh(0, 20)``) and
  zeroes every frame past each utterance's length with ``masked_fill`` after each, from a ``BoolTensor`` mask
  filled through ``narrow(...).fill_(1)``; the lengths go through the convolutions' arithmetic
  (``get_seq_lens``);
- bidirectional GRUs over packed sequences (``pack_padded_sequence``/``pad_packed_sequence``), their two
  directions summed, ``SequenceWise`` BatchNorm1d over (T*N, H) views before all but the first;
- the batch's ``input_percentages`` turned into lengths in place (``mul_``) by the loop;
- the CTC loss of the whole batch, divided by the batch size; ``check_loss`` skips the update when the loss
  is infinite, NaN or negative (the forward, and its BatchNorm statistics, happened), else ``zero_grad``,
  ``backward``, ``clip_grad_norm_`` at ``max_norm`` and Nesterov SGD with weight decay;
- the learning rate divided by ``learning_anneal`` after every epoch.

Changes for a seconds-long test: 9 frequency bins (a sample rate of 800: the source's 16 kHz gives 161),
GRUs of 8 (800) in 2 layers (5), 4 labels, 2 epochs of 3 batches of 4 utterances of at most 16 frames; one
target in the second batch is longer than its utterance's output, so that CTC gives it an infinite loss and
the step is skipped. warp-ctc's ``CTCLoss`` (not installed here; it sums over the batch and takes
activations) is ``nn.CTCLoss(reduction='sum')`` on their ``log_softmax``; apex's ``amp`` is left out (no
mixed precision: ``scaled_loss`` is the loss, ``amp.master_params(optimizer)`` the model's parameters); the
data sets, their loaders and sorting are fixed lists of batches sorted by length as the source's
``_collate_fn`` sorts them; validation (``evaluate`` with a decoder), checkpoints, loggers and prints are
left out.

The port: ``training_step`` returns the loss; ``on_nonfinite="skip"`` skips the step (its forward's
BatchNorm statistics kept, as the source's); ``grad_clip`` clips; ``on_epoch_start`` calls ``model.train()``
and ``on_epoch_end`` anneals. A skipped step counts as a step (``max_steps``), as the batch it consumed.
"""
import math
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare

args = SimpleNamespace(sample_rate=800, window_size=.02, hidden_size=8, hidden_layers=2, rnn_type='gru', epochs=2,
                       lr=3e-4, momentum=0.9, max_norm=400, learning_anneal=1.1, bidirectional=True)
LABELS = "_abc"  # the blank first, as labels.json has it
BATCH, PER_EPOCH, FRAMES = 4, 3, 16
supported_rnns = {'lstm': nn.LSTM, 'rnn': nn.RNN, 'gru': nn.GRU}


# -- model.py ---------------------------------------------------------------------------------------------
class SequenceWise(nn.Module):
    def __init__(self, module):
        super(SequenceWise, self).__init__()
        self.module = module

    def forward(self, x):
        t, n = x.size(0), x.size(1)
        x = x.view(t * n, -1)
        x = self.module(x)
        x = x.view(t, n, -1)
        return x


class MaskConv(nn.Module):
    def __init__(self, seq_module):
        super(MaskConv, self).__init__()
        self.seq_module = seq_module

    def forward(self, x, lengths):
        for module in self.seq_module:
            x = module(x)
            mask = torch.BoolTensor(x.size()).fill_(0)
            if x.is_cuda:
                mask = mask.cuda()
            for i, length in enumerate(lengths):
                length = length.item()
                if (mask[i].size(2) - length) > 0:
                    mask[i].narrow(2, length, mask[i].size(2) - length).fill_(1)
            x = x.masked_fill(mask, 0)
        return x, lengths


class InferenceBatchSoftmax(nn.Module):
    def forward(self, input_):
        if not self.training:
            return F.softmax(input_, dim=-1)
        else:
            return input_


class BatchRNN(nn.Module):
    def __init__(self, input_size, hidden_size, rnn_type=nn.LSTM, bidirectional=False, batch_norm=True):
        super(BatchRNN, self).__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bidirectional = bidirectional
        self.batch_norm = SequenceWise(nn.BatchNorm1d(input_size)) if batch_norm else None
        self.rnn = rnn_type(input_size=input_size, hidden_size=hidden_size,
                            bidirectional=bidirectional, bias=True)
        self.num_directions = 2 if bidirectional else 1

    def forward(self, x, output_lengths):
        if self.batch_norm is not None:
            x = self.batch_norm(x)
        x = nn.utils.rnn.pack_padded_sequence(x, output_lengths)
        x, h = self.rnn(x)
        x, _ = nn.utils.rnn.pad_packed_sequence(x)
        if self.bidirectional:
            x = x.view(x.size(0), x.size(1), 2, -1).sum(2).view(x.size(0), x.size(1), -1)  # (TxNxH*2) -> (TxNxH) by sum
        return x


class DeepSpeech(nn.Module):
    """The source's; its ``Lookahead`` (unidirectional only) left out: the default is bidirectional."""

    def __init__(self, rnn_type=nn.LSTM, labels="abc", rnn_hidden_size=768, nb_layers=5, audio_conf=None,
                 bidirectional=True, context=20):
        super(DeepSpeech, self).__init__()
        assert bidirectional
        if audio_conf is None:
            audio_conf = {}
        self.version = '0.0.1'
        self.hidden_size = rnn_hidden_size
        self.hidden_layers = nb_layers
        self.rnn_type = rnn_type
        self.audio_conf = audio_conf or {}
        self.labels = labels
        self.bidirectional = bidirectional

        sample_rate = self.audio_conf.get("sample_rate", 16000)
        window_size = self.audio_conf.get("window_size", 0.02)
        num_classes = len(self.labels)

        self.conv = MaskConv(nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=(41, 11), stride=(2, 2), padding=(20, 5)),
            nn.BatchNorm2d(32),
            nn.Hardtanh(0, 20, inplace=True),
            nn.Conv2d(32, 32, kernel_size=(21, 11), stride=(2, 1), padding=(10, 5)),
            nn.BatchNorm2d(32),
            nn.Hardtanh(0, 20, inplace=True)
        ))
        # Based on above convolutions and spectrogram size using conv formula (W - F + 2P)/ S+1
        rnn_input_size = int(math.floor((sample_rate * window_size) / 2) + 1)
        rnn_input_size = int(math.floor(rnn_input_size + 2 * 20 - 41) / 2 + 1)
        rnn_input_size = int(math.floor(rnn_input_size + 2 * 10 - 21) / 2 + 1)
        rnn_input_size *= 32

        rnns = []
        rnn = BatchRNN(input_size=rnn_input_size, hidden_size=rnn_hidden_size, rnn_type=rnn_type,
                       bidirectional=bidirectional, batch_norm=False)
        rnns.append(('0', rnn))
        for x in range(nb_layers - 1):
            rnn = BatchRNN(input_size=rnn_hidden_size, hidden_size=rnn_hidden_size, rnn_type=rnn_type,
                           bidirectional=bidirectional)
            rnns.append(('%d' % (x + 1), rnn))
        self.rnns = nn.Sequential(OrderedDict(rnns))
        self.lookahead = None

        fully_connected = nn.Sequential(
            nn.BatchNorm1d(rnn_hidden_size),
            nn.Linear(rnn_hidden_size, num_classes, bias=False)
        )
        self.fc = nn.Sequential(
            SequenceWise(fully_connected),
        )
        self.inference_softmax = InferenceBatchSoftmax()

    def forward(self, x, lengths):
        lengths = lengths.cpu().int()
        output_lengths = self.get_seq_lens(lengths)
        x, _ = self.conv(x, output_lengths)

        sizes = x.size()
        x = x.view(sizes[0], sizes[1] * sizes[2], sizes[3])  # Collapse feature dimension
        x = x.transpose(1, 2).transpose(0, 1).contiguous()  # TxNxH

        for rnn in self.rnns:
            x = rnn(x, output_lengths)

        x = self.fc(x)
        x = x.transpose(0, 1)
        # identity in training mode, softmax in eval mode
        x = self.inference_softmax(x)
        return x, output_lengths

    def get_seq_lens(self, input_length):
        seq_len = input_length
        for m in self.conv.modules():
            if type(m) == nn.modules.conv.Conv2d:
                seq_len = ((seq_len + 2 * m.padding[1] - m.dilation[1] * (m.kernel_size[1] - 1) - 1) / m.stride[1] + 1)
        return seq_len.int()


# -- utils.py ---------------------------------------------------------------------------------------------
def check_loss(loss, loss_value):
    loss_valid = True
    error = ''
    if loss_value == float("inf") or loss_value == float("-inf"):
        loss_valid = False
        error = "WARNING: received an inf loss"
    elif torch.isnan(loss).sum() > 0:
        loss_valid = False
        error = 'WARNING: received a nan loss, setting loss value to 0'
    elif loss_value < 0:
        loss_valid = False
        error = "WARNING: received a negative loss"
    return loss_valid, error


# -- train.py ---------------------------------------------------------------------------------------------
def deepspeech():
    audio_conf = dict(sample_rate=args.sample_rate, window_size=args.window_size)
    rnn_type = args.rnn_type.lower()
    return DeepSpeech(rnn_hidden_size=args.hidden_size, nb_layers=args.hidden_layers, labels=LABELS,
                      rnn_type=supported_rnns[rnn_type], audio_conf=audio_conf, bidirectional=args.bidirectional)


def make_optimizer(model):
    parameters = model.parameters()
    return torch.optim.SGD(parameters, lr=args.lr, momentum=args.momentum, nesterov=True, weight_decay=1e-5)


class CTCLoss:
    """warp-ctc's ``CTCLoss()`` call (activations, targets, activation lengths, target lengths), summed over
    the batch, through torch's CTC on log-probabilities."""

    def __init__(self):
        self.ctc = nn.CTCLoss(blank=0, reduction='sum')

    def __call__(self, acts, labels, act_lens, label_lens):
        return self.ctc(acts.log_softmax(-1), labels, act_lens, label_lens)


criterion = CTCLoss()


def batch_loss(model, data, device=torch.device('cpu')):
    """The loop's forward and loss, from the batch to ``loss / inputs.size(0)``."""
    inputs, targets, input_percentages, target_sizes = data
    input_sizes = input_percentages.mul_(int(inputs.size(3))).int()
    inputs = inputs.to(device)

    out, output_sizes = model(inputs, input_sizes)
    out = out.transpose(0, 1)  # TxNxH

    float_out = out.float()  # ensure float32 for loss
    loss = criterion(float_out, targets, output_sizes, target_sizes).to(device)
    loss = loss / inputs.size(0)  # average the loss by minibatch
    return loss


def deepspeech_hand(model, train_loader):
    optimizer = make_optimizer(model)
    skipped = 0
    for epoch in range(args.epochs):
        model.train()
        for i, (data) in enumerate(train_loader):
            loss = batch_loss(model, data)
            loss_value = loss.item()

            # Check to ensure valid loss was calculated
            valid_loss, error = check_loss(loss, loss_value)
            if valid_loss:
                optimizer.zero_grad()
                # compute gradient
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
                optimizer.step()
            else:
                skipped += 1
                loss_value = 0
            del loss

        # anneal lr
        for g in optimizer.param_groups:
            g['lr'] = g['lr'] / args.learning_anneal
    train_loader.skipped = skipped


class DeepSpeechTrainer(Trainer):
    def configure_optimizers(self):
        return make_optimizer(self.model)

    def on_epoch_start(self):
        self.model.train()

    def training_step(self, batch):
        return batch_loss(self.model, batch)

    def on_epoch_end(self):
        for g in self.optimizers["optimizer"].param_groups:
            g['lr'] = g['lr'] / args.learning_anneal

    def on_fit_end(self):
        self.train_data.skipped = self.state.skipped


class Speech:
    """Batches sorted by length, copied at each pass (the loop turns their percentages into lengths in place);
    the second batch's first target cannot be aligned (9 labels, 8 output frames)."""

    def __init__(self):
        gen = torch.Generator().manual_seed(14)
        freq = int(math.floor((args.sample_rate * args.window_size) / 2) + 1)
        self.batches = []
        for b in range(PER_EPOCH):
            lengths = sorted(torch.randint(FRAMES // 2, FRAMES + 1, (BATCH,), generator=gen).tolist(), reverse=True)
            lengths[0] = FRAMES
            inputs = torch.zeros(BATCH, 1, freq, FRAMES)
            for i, n in enumerate(lengths):
                inputs[i, 0, :, :n] = torch.randn(freq, n, generator=gen)
            sizes = [int(torch.randint(1, 1 + (n + 1) // 2 // 2, (1,), generator=gen)) for n in lengths]
            if b == 1:
                sizes[0] = FRAMES // 2 + 1
            targets = torch.randint(1, len(LABELS), (sum(sizes),), generator=gen).int()
            self.batches.append((inputs, targets, torch.tensor(lengths, dtype=torch.float) / FRAMES,
                                 torch.tensor(sizes, dtype=torch.int)))
        self.skipped = None

    def __iter__(self):
        """A copy of each batch per pass, as a DataLoader collates new tensors every epoch."""
        return iter([tuple(t.clone() for t in batch) for batch in self.batches])

    def __len__(self):
        return len(self.batches)


@pytest.mark.parametrize("check", checks())
def test_deepspeech_with_ctc_and_a_skipped_infinite_loss(check):
    runs = []

    def data(model):
        runs.append(Speech())
        return runs[-1]
    compare(deepspeech, deepspeech_hand, DeepSpeechTrainer, data, check, steps=args.epochs * PER_EPOCH,
            on_nonfinite="skip", grad_clip=args.max_norm)
    assert [run.skipped for run in runs] == [2, 2, 2]
