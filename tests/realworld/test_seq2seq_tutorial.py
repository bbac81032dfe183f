"""PyTorch's sequence-to-sequence translation tutorial, one sentence pair a step: pytorch/tutorials at commit
05e7ce2c19e72d482475d91d458db210cdacec38, intermediate_source/seq2seq_translation_tutorial.py (``EncoderRNN``,
``AttnDecoderRNN``, ``train``, ``trainIters``).

Two modules and two SGD optimizers trained by one loss: the encoder run one word at a time, each output
copied in place into a preallocated ``encoder_outputs = torch.zeros(max_length, ...)`` (``encoder_outputs[ei] =
encoder_output[0, 0]``); the attention decoder run one word at a time over it, with dropout; ``loss = 0`` then
``loss += criterion(...)`` per target word; per pair, Python's ``random.random()`` chooses teacher forcing or
the decoder's own prediction (``topi.squeeze().detach()``), stopping early at a predicted EOS
(``decoder_input.item()``); one ``loss.backward()``, then ``encoder_optimizer.step()`` and
``decoder_optimizer.step()``. The training pairs are drawn up front with ``random.choice``.

Changes for a seconds-long test: random "sentences" of 1-4 words over vocabularies of 9 and 8 (the filtered
English-French pairs), ``MAX_LENGTH`` 5 (10), hidden size 8 (256), 6 iterations (75000); no timing, printing or
plotting.

The port is manual, over ``encoder`` and ``decoder`` optimizers: the same loss back-propagated into each (the
first with ``retain_graph``), as ``self.backward`` routes a loss to one optimizer's parameters, then both
steps. Its data are the pairs ``trainIters`` draws, drawn when the port is made.
"""
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import optim

from safeloop import Trainer

from .harness import checks, compare

SOS_token, EOS_token, MAX_LENGTH, HIDDEN, IN_WORDS, OUT_WORDS, N_ITERS = 0, 1, 5, 8, 9, 8, 6
device = torch.device("cpu")
teacher_forcing_ratio = 0.5


class EncoderRNN(nn.Module):
    def __init__(self, input_size, hidden_size):
        super(EncoderRNN, self).__init__()
        self.hidden_size = hidden_size

        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)

    def forward(self, input, hidden):
        embedded = self.embedding(input).view(1, 1, -1)
        output = embedded
        output, hidden = self.gru(output, hidden)
        return output, hidden

    def initHidden(self):
        return torch.zeros(1, 1, self.hidden_size, device=device)


class AttnDecoderRNN(nn.Module):
    def __init__(self, hidden_size, output_size, dropout_p=0.1, max_length=MAX_LENGTH):
        super(AttnDecoderRNN, self).__init__()
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.dropout_p = dropout_p
        self.max_length = max_length

        self.embedding = nn.Embedding(self.output_size, self.hidden_size)
        self.attn = nn.Linear(self.hidden_size * 2, self.max_length)
        self.attn_combine = nn.Linear(self.hidden_size * 2, self.hidden_size)
        self.dropout = nn.Dropout(self.dropout_p)
        self.gru = nn.GRU(self.hidden_size, self.hidden_size)
        self.out = nn.Linear(self.hidden_size, self.output_size)

    def forward(self, input, hidden, encoder_outputs):
        embedded = self.embedding(input).view(1, 1, -1)
        embedded = self.dropout(embedded)

        attn_weights = F.softmax(
            self.attn(torch.cat((embedded[0], hidden[0]), 1)), dim=1)
        attn_applied = torch.bmm(attn_weights.unsqueeze(0),
                                 encoder_outputs.unsqueeze(0))

        output = torch.cat((embedded[0], attn_applied[0]), 1)
        output = self.attn_combine(output).unsqueeze(0)

        output = F.relu(output)
        output, hidden = self.gru(output, hidden)

        output = F.log_softmax(self.out(output[0]), dim=1)
        return output, hidden, attn_weights

    def initHidden(self):
        return torch.zeros(1, 1, self.hidden_size, device=device)


def forward_loss(input_tensor, target_tensor, encoder, decoder, criterion, max_length=MAX_LENGTH):
    """``train`` up to the loss."""
    encoder_hidden = encoder.initHidden()

    input_length = input_tensor.size(0)
    target_length = target_tensor.size(0)

    encoder_outputs = torch.zeros(max_length, encoder.hidden_size, device=device)

    loss = 0

    for ei in range(input_length):
        encoder_output, encoder_hidden = encoder(
            input_tensor[ei], encoder_hidden)
        encoder_outputs[ei] = encoder_output[0, 0]

    decoder_input = torch.tensor([[SOS_token]], device=device)

    decoder_hidden = encoder_hidden

    use_teacher_forcing = True if random.random() < teacher_forcing_ratio else False

    if use_teacher_forcing:
        # Teacher forcing: Feed the target as the next input
        for di in range(target_length):
            decoder_output, decoder_hidden, decoder_attention = decoder(
                decoder_input, decoder_hidden, encoder_outputs)
            loss += criterion(decoder_output, target_tensor[di])
            decoder_input = target_tensor[di]  # Teacher forcing

    else:
        # Without teacher forcing: use its own predictions as the next input
        for di in range(target_length):
            decoder_output, decoder_hidden, decoder_attention = decoder(
                decoder_input, decoder_hidden, encoder_outputs)
            topv, topi = decoder_output.topk(1)
            decoder_input = topi.squeeze().detach()  # detach from history as input

            loss += criterion(decoder_output, target_tensor[di])
            if decoder_input.item() == EOS_token:
                break
    return loss


def train(input_tensor, target_tensor, encoder, decoder, encoder_optimizer, decoder_optimizer, criterion,
          max_length=MAX_LENGTH):
    encoder_optimizer.zero_grad()
    decoder_optimizer.zero_grad()

    loss = forward_loss(input_tensor, target_tensor, encoder, decoder, criterion, max_length)

    loss.backward()

    encoder_optimizer.step()
    decoder_optimizer.step()

    return loss.item() / target_tensor.size(0)


def trainIters(encoder, decoder, n_iters, pairs, learning_rate=0.01):
    encoder_optimizer = optim.SGD(encoder.parameters(), lr=learning_rate)
    decoder_optimizer = optim.SGD(decoder.parameters(), lr=learning_rate)
    training_pairs = [random.choice(pairs) for i in range(n_iters)]  # tensorsFromPair(random.choice(pairs))
    criterion = nn.NLLLoss()

    for iter in range(1, n_iters + 1):
        training_pair = training_pairs[iter - 1]
        input_tensor = training_pair[0]
        target_tensor = training_pair[1]

        loss = train(input_tensor, target_tensor, encoder,
                     decoder, encoder_optimizer, decoder_optimizer, criterion)


def make_model():
    return nn.ModuleDict({"encoder": EncoderRNN(IN_WORDS, HIDDEN),
                          "decoder": AttnDecoderRNN(HIDDEN, OUT_WORDS, dropout_p=0.1).to(device)})


def tutorial_hand(model, pairs):
    trainIters(model["encoder"], model["decoder"], N_ITERS, pairs)


class Seq2SeqTrainer(Trainer):
    automatic = False

    def __init__(self, train_data, **kwargs):
        super().__init__(train_data=[random.choice(train_data) for i in range(N_ITERS)], **kwargs)

    def configure_optimizers(self):
        self.criterion = nn.NLLLoss()
        return {"encoder": optim.SGD(self.model["encoder"].parameters(), lr=0.01),
                "decoder": optim.SGD(self.model["decoder"].parameters(), lr=0.01)}

    def training_step(self, training_pair):
        input_tensor, target_tensor = training_pair
        loss = forward_loss(input_tensor, target_tensor, self.model["encoder"], self.model["decoder"],
                            self.criterion)
        self.backward(loss, optimizer="encoder", retain_graph=True)
        self.backward(loss, optimizer="decoder")
        self.step("encoder")
        self.step("decoder")
        return loss


class Pairs(list):
    """Word indices of random sentence pairs, each ending with EOS; Python's ``random`` seeded when made."""

    def __init__(self):
        random.seed(3)
        gen = torch.Generator().manual_seed(17)

        def sentence(words):
            n = int(torch.randint(1, MAX_LENGTH, (), generator=gen))
            return torch.cat([torch.randint(2, words, (n,), generator=gen), torch.tensor([EOS_token])]).view(-1, 1)
        super().__init__((sentence(IN_WORDS), sentence(OUT_WORDS)) for _ in range(4))


@pytest.mark.parametrize("check", checks())
def test_seq2seq_tutorial_with_one_loss_into_two_optimizers(check):
    compare(make_model, tutorial_hand, Seq2SeqTrainer, lambda model: Pairs(), check, steps=N_ITERS)
