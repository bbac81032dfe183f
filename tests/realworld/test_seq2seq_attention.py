"""Sequence to sequence with attention and teacher forcing: bentrevett/pytorch-seq2seq at commit
7faa64a895fe4b76cb87409d66a0ba349a78298e, "3 - Neural Machine Translation by Jointly Learning to Align and
Translate.ipynb" (``Encoder``, ``Attention``, ``Decoder``, ``Seq2Seq``, ``init_weights``, ``train``, ``evaluate``).

A bidirectional GRU encoder whose last forward and backward states, through ``tanh(fc(...))``, start the
decoder; a decoder run one token at a time in a Python loop, each step attending over every encoder state
(``repeat``, ``permute``, ``bmm``), its prediction written in place into a preallocated zeros tensor
(``outputs[t] = output``: one ``CopySlices`` per target position on the same tensor), the next input the
target token or the argmax, chosen by Python's ``random.random()`` at every position (teacher forcing, drawn
in evaluation too, at ratio 0); ``assert (output == hidden).all()`` inside the forward; dropout on the
embeddings; ``model.apply(init_weights)`` through ``param.data``; cross-entropy ignoring the padding index on
``output[1:].view(-1, output_dim)``; ``clip_grad_norm_``; Adam; an evaluation pass after each epoch under
``no_grad`` in eval mode.

Changes for a seconds-long test: vocabularies of 11 and 9 (7853 and 5893), embeddings of 6 (256), hidden sizes of
8 (512), 2 epochs of 3 random batches of 4 sentences of 5 source and 4 target tokens, some padded (Multi30k
through torchtext's ``BucketIterator``); the timing and printing left out.

The port is automatic: ``training_step`` is the loop's body up to the loss, ``grad_clip``, ``on_epoch_start``
puts the model in train mode, ``on_epoch_end`` runs ``evaluate`` (after the last pass too: ``max_steps`` ends the run
right after its last batch, and the pass with it).
"""
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import Trainer

from .harness import checks, compare

INPUT_DIM, OUTPUT_DIM, EMB_DIM, HID_DIM, DROPOUT, TRG_PAD_IDX, CLIP = 11, 9, 6, 8, 0.5, 1, 1
EPOCHS, PER_EPOCH, BATCH, SRC_LEN, TRG_LEN = 2, 3, 4, 5, 4
device = torch.device('cpu')


class Encoder(nn.Module):
    def __init__(self, input_dim, emb_dim, enc_hid_dim, dec_hid_dim, dropout):
        super().__init__()

        self.embedding = nn.Embedding(input_dim, emb_dim)

        self.rnn = nn.GRU(emb_dim, enc_hid_dim, bidirectional = True)

        self.fc = nn.Linear(enc_hid_dim * 2, dec_hid_dim)

        self.dropout = nn.Dropout(dropout)

    def forward(self, src):
        embedded = self.dropout(self.embedding(src))
        outputs, hidden = self.rnn(embedded)
        hidden = torch.tanh(self.fc(torch.cat((hidden[-2,:,:], hidden[-1,:,:]), dim = 1)))
        return outputs, hidden


class Attention(nn.Module):
    def __init__(self, enc_hid_dim, dec_hid_dim):
        super().__init__()

        self.attn = nn.Linear((enc_hid_dim * 2) + dec_hid_dim, dec_hid_dim)
        self.v = nn.Linear(dec_hid_dim, 1, bias = False)

    def forward(self, hidden, encoder_outputs):
        batch_size = encoder_outputs.shape[1]
        src_len = encoder_outputs.shape[0]

        #repeat decoder hidden state src_len times
        hidden = hidden.unsqueeze(1).repeat(1, src_len, 1)

        encoder_outputs = encoder_outputs.permute(1, 0, 2)

        energy = torch.tanh(self.attn(torch.cat((hidden, encoder_outputs), dim = 2)))

        attention = self.v(energy).squeeze(2)

        return F.softmax(attention, dim=1)


class Decoder(nn.Module):
    def __init__(self, output_dim, emb_dim, enc_hid_dim, dec_hid_dim, dropout, attention):
        super().__init__()

        self.output_dim = output_dim
        self.attention = attention

        self.embedding = nn.Embedding(output_dim, emb_dim)

        self.rnn = nn.GRU((enc_hid_dim * 2) + emb_dim, dec_hid_dim)

        self.fc_out = nn.Linear((enc_hid_dim * 2) + dec_hid_dim + emb_dim, output_dim)

        self.dropout = nn.Dropout(dropout)

    def forward(self, input, hidden, encoder_outputs):
        input = input.unsqueeze(0)

        embedded = self.dropout(self.embedding(input))

        a = self.attention(hidden, encoder_outputs)

        a = a.unsqueeze(1)

        encoder_outputs = encoder_outputs.permute(1, 0, 2)

        weighted = torch.bmm(a, encoder_outputs)

        weighted = weighted.permute(1, 0, 2)

        rnn_input = torch.cat((embedded, weighted), dim = 2)

        output, hidden = self.rnn(rnn_input, hidden.unsqueeze(0))

        #this also means that output == hidden
        assert (output == hidden).all()

        embedded = embedded.squeeze(0)
        output = output.squeeze(0)
        weighted = weighted.squeeze(0)

        prediction = self.fc_out(torch.cat((output, weighted, embedded), dim = 1))

        return prediction, hidden.squeeze(0)


class Seq2Seq(nn.Module):
    def __init__(self, encoder, decoder, device):
        super().__init__()

        self.encoder = encoder
        self.decoder = decoder
        self.device = device

    def forward(self, src, trg, teacher_forcing_ratio = 0.5):
        batch_size = src.shape[1]
        trg_len = trg.shape[0]
        trg_vocab_size = self.decoder.output_dim

        #tensor to store decoder outputs
        outputs = torch.zeros(trg_len, batch_size, trg_vocab_size).to(self.device)

        encoder_outputs, hidden = self.encoder(src)

        #first input to the decoder is the <sos> tokens
        input = trg[0,:]

        for t in range(1, trg_len):
            output, hidden = self.decoder(input, hidden, encoder_outputs)

            #place predictions in a tensor holding predictions for each token
            outputs[t] = output

            #decide if we are going to use teacher forcing or not
            teacher_force = random.random() < teacher_forcing_ratio

            #get the highest predicted token from our predictions
            top1 = output.argmax(1)

            #if teacher forcing, use actual next token as next input
            #if not, use predicted token
            input = trg[t] if teacher_force else top1

        return outputs


def init_weights(m):
    for name, param in m.named_parameters():
        if 'weight' in name:
            nn.init.normal_(param.data, mean=0, std=0.01)
        else:
            nn.init.constant_(param.data, 0)


def make_model():
    attn = Attention(HID_DIM, HID_DIM)
    enc = Encoder(INPUT_DIM, EMB_DIM, HID_DIM, HID_DIM, DROPOUT)
    dec = Decoder(OUTPUT_DIM, EMB_DIM, HID_DIM, HID_DIM, DROPOUT, attn)
    model = Seq2Seq(enc, dec, device).to(device)
    model.apply(init_weights)
    return model


def train(model, iterator, optimizer, criterion, clip):
    model.train()
    epoch_loss = 0
    for i, batch in enumerate(iterator):
        src = batch.src
        trg = batch.trg

        optimizer.zero_grad()

        output = model(src, trg)

        output_dim = output.shape[-1]

        output = output[1:].view(-1, output_dim)
        trg = trg[1:].view(-1)

        loss = criterion(output, trg)

        loss.backward()

        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

        optimizer.step()

        epoch_loss += loss.item()

    return epoch_loss / len(iterator)


def evaluate(model, iterator, criterion):
    model.eval()
    epoch_loss = 0
    with torch.no_grad():
        for i, batch in enumerate(iterator):
            src = batch.src
            trg = batch.trg

            output = model(src, trg, 0) #turn off teacher forcing

            output_dim = output.shape[-1]

            output = output[1:].view(-1, output_dim)
            trg = trg[1:].view(-1)

            loss = criterion(output, trg)

            epoch_loss += loss.item()

    return epoch_loss / len(iterator)


def seq2seq_hand(model, data):
    optimizer = torch.optim.Adam(model.parameters())
    criterion = nn.CrossEntropyLoss(ignore_index = TRG_PAD_IDX)
    for epoch in range(EPOCHS):
        train_loss = train(model, data, optimizer, criterion, CLIP)
        valid_loss = evaluate(model, data.valid, criterion)
        data.losses.append((train_loss, valid_loss))


class Seq2SeqTrainer(Trainer):
    def configure_optimizers(self):
        self.criterion = nn.CrossEntropyLoss(ignore_index = TRG_PAD_IDX)
        return torch.optim.Adam(self.model.parameters())

    def on_epoch_start(self):
        self.model.train()

    def training_step(self, batch):
        output = self.model(batch.src, batch.trg)
        output_dim = output.shape[-1]
        return self.criterion(output[1:].view(-1, output_dim), batch.trg[1:].view(-1))

    def on_epoch_end(self):
        self.train_data.losses.append((None, evaluate(self.model, self.train_data.valid, self.criterion)))


class Batch:
    def __init__(self, src, trg):
        self.src, self.trg = src, trg


class Multi30k(list):
    """Fresh for each run: Python's ``random`` (teacher forcing) seeded with it."""

    def __init__(self):
        random.seed(1234)
        gen = torch.Generator().manual_seed(7)

        def batch():
            src = torch.randint(2, INPUT_DIM, (SRC_LEN, BATCH), generator=gen)
            trg = torch.randint(2, OUTPUT_DIM, (TRG_LEN, BATCH), generator=gen)
            trg[-1, :2] = TRG_PAD_IDX  # two shorter sentences
            return Batch(src, trg)
        super().__init__(batch() for _ in range(PER_EPOCH))
        self.valid, self.losses = [batch()], []


@pytest.mark.parametrize("check", checks())
def test_seq2seq_with_attention_and_random_teacher_forcing(check):
    runs = []

    def data(model):
        runs.append(Multi30k())
        return runs[-1]
    compare(make_model, seq2seq_hand, Seq2SeqTrainer, data, check, steps=EPOCHS * PER_EPOCH, max_epochs=EPOCHS,
            grad_clip=CLIP)
    hand, watched, port = ([v for _, v in run.losses] for run in runs)
    assert watched == hand and port == hand  # the last pass's evaluation too: the run's end ends the pass
