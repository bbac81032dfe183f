# chatbot_loss_per_word_not_retained.py under mixed precision's GradScaler (the optimizers stepped through
# `scaler.step`, as the AMP recipe does): still one update's backwards, the fix still retain_graph=True.
import random

import torch
import torch.nn.functional as F
from torch import nn, optim

torch.manual_seed(0)
random.seed(0)
PAD_token, SOS_token, EOS_token, NUM_WORDS, HIDDEN, BATCH = 0, 1, 2, 10, 6, 3


class EncoderRNN(nn.Module):
    def __init__(self, hidden_size, embedding):
        super().__init__()
        self.hidden_size, self.embedding = hidden_size, embedding
        self.gru = nn.GRU(hidden_size, hidden_size, bidirectional=True)

    def forward(self, input_seq, input_lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.embedding(input_seq), input_lengths)
        outputs, hidden = self.gru(packed)
        outputs, _ = nn.utils.rnn.pad_packed_sequence(outputs)
        return outputs[:, :, :self.hidden_size] + outputs[:, :, self.hidden_size:], hidden


class LuongAttnDecoderRNN(nn.Module):
    def __init__(self, embedding, hidden_size, output_size):
        super().__init__()
        self.embedding, self.n_layers = embedding, 1
        self.gru = nn.GRU(hidden_size, hidden_size)
        self.concat = nn.Linear(hidden_size * 2, hidden_size)
        self.out = nn.Linear(hidden_size, output_size)

    def forward(self, input_step, last_hidden, encoder_outputs):
        rnn_output, hidden = self.gru(self.embedding(input_step), last_hidden)
        attn_weights = F.softmax(torch.sum(rnn_output * encoder_outputs, dim=2).t(), dim=1).unsqueeze(1)
        context = attn_weights.bmm(encoder_outputs.transpose(0, 1)).squeeze(1)
        concat_output = torch.tanh(self.concat(torch.cat((rnn_output.squeeze(0), context), 1)))
        return F.softmax(self.out(concat_output), dim=1), hidden


def maskNLLLoss(inp, target, mask):
    crossEntropy = -torch.log(torch.gather(inp, 1, target.view(-1, 1)).squeeze(1))
    return crossEntropy.masked_select(mask).mean(), mask.sum().item()


def batch2TrainData(pairs):
    pairs.sort(key=lambda x: len(x[0]), reverse=True)
    inputs, outputs = zip(*pairs)
    pad = lambda seqs: torch.LongTensor([s + [PAD_token] * (max(map(len, seqs)) - len(s)) for s in seqs]).t()
    out = pad(outputs)
    return pad(inputs), torch.tensor([len(s) for s in inputs]), out, out != PAD_token, out.size(0)


def train(input_variable, lengths, target_variable, mask, max_target_len, encoder, decoder, encoder_optimizer,
          decoder_optimizer):
    encoder_optimizer.zero_grad()
    decoder_optimizer.zero_grad()
    print_losses, n_totals = [], 0
    encoder_outputs, encoder_hidden = encoder(input_variable, lengths)
    decoder_input = torch.LongTensor([[SOS_token for _ in range(BATCH)]])
    decoder_hidden = encoder_hidden[:decoder.n_layers]
    use_teacher_forcing = random.random() < 0.5
    for t in range(max_target_len):
        decoder_output, decoder_hidden = decoder(decoder_input, decoder_hidden, encoder_outputs)
        if use_teacher_forcing:
            decoder_input = target_variable[t].view(1, -1)
        else:
            _, topi = decoder_output.topk(1)
            decoder_input = torch.LongTensor([[topi[i][0] for i in range(BATCH)]])
        mask_loss, nTotal = maskNLLLoss(decoder_output, target_variable[t], mask[t])
        scaler.scale(mask_loss).backward()
        print_losses.append(mask_loss.item() * nTotal)
        n_totals += nTotal
    scaler.unscale_(encoder_optimizer)
    scaler.unscale_(decoder_optimizer)
    nn.utils.clip_grad_norm_(encoder.parameters(), 50.0)
    nn.utils.clip_grad_norm_(decoder.parameters(), 50.0)
    scaler.step(encoder_optimizer)
    scaler.step(decoder_optimizer)
    scaler.update()
    return sum(print_losses) / n_totals


def sentence():
    return [random.randrange(3, NUM_WORDS) for _ in range(random.randint(1, 3))] + [EOS_token]


pairs = [(sentence(), sentence()) for _ in range(10)]
embedding = nn.Embedding(NUM_WORDS, HIDDEN)
encoder, decoder = EncoderRNN(HIDDEN, embedding), LuongAttnDecoderRNN(embedding, HIDDEN, NUM_WORDS)
encoder_optimizer = optim.Adam(encoder.parameters(), lr=0.01)
decoder_optimizer = optim.Adam(decoder.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
training_batches = [batch2TrainData([random.choice(pairs) for _ in range(BATCH)]) for _ in range(4)]
for iteration, training_batch in enumerate(training_batches, 1):
    loss = train(*training_batch, encoder, decoder, encoder_optimizer, decoder_optimizer)
    print(f"Iteration: {iteration}; Average loss: {loss:.6f}")
print(f"{embedding.weight.sum().item():.8f} {decoder.out.weight.sum().item():.8f}")
