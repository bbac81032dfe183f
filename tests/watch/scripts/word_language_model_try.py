"""pytorch/examples word_language_model/main.py (https://github.com/pytorch/examples/blob/main/word_language_model/
main.py): train() with no optimizer (p.data.add_(p.grad, alpha=-lr)), the LSTM state repackaged each batch
(`hidden = repackage_hidden(hidden)`), `output, hidden = model(data, hidden)`, and the epochs inside
`try: ... except KeyboardInterrupt:`. A one-layer LSTM on random tokens, 2 epochs of 3 batches."""
import torch
import torch.nn as nn

torch.manual_seed(0)
ntokens, bptt, lr = 10, 4, 0.5
emb, rnn, dec = nn.Embedding(ntokens, 8), nn.LSTM(8, 8), nn.Linear(8, ntokens)
model = nn.ModuleList([emb, rnn, dec])
criterion = nn.NLLLoss()
train_data = torch.randint(ntokens, (13, 2))


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    else:
        return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)


def train():
    model.train()
    hidden = (torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
        data, targets = get_batch(train_data, i)
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        out, hidden = rnn(emb(data), hidden)
        output = torch.log_softmax(dec(out), dim=-1).view(-1, ntokens)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        print(f"batch {batch} loss {loss.item()}")


try:
    for epoch in range(1, 3):
        train()
except KeyboardInterrupt:
    print('-' * 89)
    print('Exiting from training early')
for p in model.parameters():
    print(p.sum().item())
