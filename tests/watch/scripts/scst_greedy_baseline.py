# Self-critical sequence training for captioning: ruotianluo/self-critical.pytorch, captioning/modules/loss_wrapper.py
# (`LossWrapper.forward`, sc_flag: the greedy baseline decoded in eval mode under torch.no_grad(), then a sampled
# caption with its log-probs in train mode), captioning/models/AttModel.py (`_sample`: `seq[:, t] = it` and
# `seqLogprobs[:, t] = logprobs` written into tensors made before the decoding loop, finished rows masked),
# captioning/models/CaptionModel.py (`sample_next_word`: greedy from `logprobs.data`, sampling by multinomial),
# captioning/utils/rewards.py (`get_self_critical_reward`: scores of numpy copies, sample minus greedy),
# captioning/modules/losses.py (`RewardCriterion`), tools/train.py (zero_grad, `model_out['loss'].mean()`, backward,
# clip_grad_value_, step, `loss.item()`). CIDEr-D is replaced by the share of words equal to a reference's; tiny
# GRU-cell captioner over random features.
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
np.random.seed(0)
BATCH, FEAT, HIDDEN, VOCAB, SEQ_LENGTH, ITERS = 3, 5, 8, 6, 4, 6


class Captioner(nn.Module):
    def __init__(self):
        super().__init__()
        self.vocab_size, self.seq_length, self.bos_idx, self.eos_idx, self.pad_idx = VOCAB, SEQ_LENGTH, 0, 0, 0
        self.init_h = nn.Linear(FEAT, HIDDEN)
        self.embed = nn.Embedding(VOCAB + 1, HIDDEN)
        self.core = nn.GRUCell(HIDDEN, HIDDEN)
        self.dropout = nn.Dropout(0.5)
        self.logit = nn.Linear(HIDDEN, VOCAB + 1)

    def get_logprobs_state(self, it, state):
        state = self.core(self.embed(it), state)
        return F.log_softmax(self.logit(self.dropout(state)), dim=1), state

    def sample_next_word(self, logprobs, sample_method):
        if sample_method == 'greedy':
            sampleLogprobs, it = torch.max(logprobs.data, 1)
            it = it.view(-1).long()
        else:
            prob_prev = torch.exp(logprobs.data)
            it = torch.multinomial(prob_prev, 1)
            sampleLogprobs = logprobs.gather(1, it)
            it = it.view(-1).long()
        return it, sampleLogprobs

    def forward(self, fc_feats, sample_method):
        batch_size = fc_feats.size(0)
        state = torch.tanh(self.init_h(fc_feats))
        seq = fc_feats.new_full((batch_size, self.seq_length), self.pad_idx, dtype=torch.long)
        seqLogprobs = fc_feats.new_zeros(batch_size, self.seq_length, self.vocab_size + 1)
        for t in range(self.seq_length + 1):
            if t == 0:
                it = fc_feats.new_full([batch_size], self.bos_idx, dtype=torch.long)
            logprobs, state = self.get_logprobs_state(it, state)
            if t == self.seq_length:
                break
            it, sampleLogprobs = self.sample_next_word(logprobs, sample_method)
            if t == 0:
                unfinished = it != self.eos_idx
            else:
                it[~unfinished] = self.pad_idx
                logprobs = logprobs * unfinished.unsqueeze(1).to(logprobs)
                unfinished = unfinished & (it != self.eos_idx)
            seq[:, t] = it
            seqLogprobs[:, t] = logprobs
            if unfinished.sum() == 0:
                break
        return seq, seqLogprobs


def scores(res, gts):
    return np.array([(r == g).mean() for r, g in zip(res, gts)])


def get_self_critical_reward(greedy_res, data_gts, gen_result):
    gen_result = gen_result.data.cpu().numpy()
    greedy_res = greedy_res.data.cpu().numpy()
    s = scores(gen_result, data_gts) - scores(greedy_res, data_gts)
    return np.repeat(s[:, np.newaxis], gen_result.shape[1], 1)


class RewardCriterion(nn.Module):
    def forward(self, input, seq, reward):
        input = input.gather(2, seq.unsqueeze(2)).squeeze(2)
        input = input.reshape(-1)
        reward = reward.reshape(-1)
        mask = (seq > 0).to(input)
        mask = torch.cat([mask.new(mask.size(0), 1).fill_(1), mask[:, :-1]], 1).reshape(-1)
        output = - input * reward * mask
        return torch.sum(output) / torch.sum(mask)


model = Captioner()
rl_crit = RewardCriterion()
optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
for iteration in range(ITERS):
    fc_feats = torch.randn(BATCH, FEAT)
    gts = np.random.randint(1, VOCAB + 1, size=(BATCH, SEQ_LENGTH))
    optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        greedy_res, _ = model(fc_feats, 'greedy')
    model.train()
    gen_result, sample_logprobs = model(fc_feats, 'sample')
    reward = get_self_critical_reward(greedy_res, gts, gen_result)
    reward = torch.from_numpy(reward).to(sample_logprobs)
    model_out = {'loss': rl_crit(sample_logprobs, gen_result.data, reward), 'reward': reward[:, 0].mean()}
    loss = model_out['loss'].mean()
    loss.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    optimizer.step()
    train_loss = loss.item()
    print(iteration, repr(train_loss), repr(model_out['reward'].mean().item()))
print("checksum", repr(sum(p.double().sum().item() for p in model.parameters())))
