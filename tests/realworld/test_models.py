"""Training loops around particular models: an LSTM carrying its hidden state (TBPTT), a VAE, a mean
teacher (EMA), distillation from a frozen teacher, a checkpointed DenseNet with BatchNorm, a compiled
GPT with gradient accumulation, an ensemble run in TorchScript's forked threads."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

from safeloop import Trainer

from .harness import batches, bn_classifier, checks, compare, fixed, labelled


# -- TBPTT: pytorch/examples, word_language_model/main.py (train) and model.py (RNNModel, LSTM) ------------
NTOKEN, BSZ, BPTT, LR, CLIP = 10, 4, 5, 20.0, 0.25


class RNNModel(nn.Module):
    def __init__(self, ninp=6, nhid=6, nlayers=2, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(NTOKEN, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, NTOKEN)
        self.nlayers, self.nhid = nlayers, nhid
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, NTOKEN)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def corpus(steps):
    """batchify(train_data, BSZ) cut by get_batch into (data, targets) chunks of BPTT tokens."""
    source = torch.randint(NTOKEN, (steps * BPTT + 1, BSZ), generator=torch.Generator().manual_seed(9))
    return [(source[i:i + BPTT], source[i + 1:i + 1 + BPTT].reshape(-1)) for i in range(0, steps * BPTT, BPTT)]


def tbptt_hand(model, data):
    criterion = nn.NLLLoss()
    model.train()
    hidden = model.init_hidden(BSZ)
    for data_chunk, targets in data:
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data_chunk, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)


class TBPTT(Trainer):
    """The hidden state is detached where the source detaches it: at the start of the next step."""

    hidden = None

    def training_step(self, batch):
        data_chunk, targets = batch
        self.hidden = repackage_hidden(self.hidden if self.hidden is not None else self.model.init_hidden(BSZ))
        output, self.hidden = self.model(data_chunk, self.hidden)
        return nn.NLLLoss()(output, targets)


@pytest.mark.parametrize("check", checks())
def test_tbptt_language_model(check):
    compare(RNNModel, tbptt_hand, TBPTT, fixed(corpus(5)), check, steps=5, optimizer=partial(torch.optim.SGD, lr=LR),
            grad_clip=CLIP)


# -- VAE: pytorch/examples, vae/main.py -----------------------------------------------------------------
class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(12, 8), nn.Linear(8, 2), nn.Linear(8, 2)
        self.fc3, self.fc4 = nn.Linear(2, 8), nn.Linear(8, 12)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 12))
        return self.decode(self.reparameterize(mu, logvar)), mu, logvar


def vae_terms(recon_x, x, mu, logvar):
    """loss_function's two terms: reconstruction + KL divergence."""
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 12), reduction="sum")
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE, KLD


def vae_hand(model, data):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for x in data:
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(x)
        BCE, KLD = vae_terms(recon_batch, x, mu, logvar)
        loss = BCE + KLD
        loss.backward()
        optimizer.step()


class VAETrainer(Trainer):
    def training_step(self, x):
        recon_batch, mu, logvar = self.model(x)
        BCE, KLD = vae_terms(recon_batch, x, mu, logvar)
        return {"BCE": BCE, "KLD": KLD}  # logged apart; multi_loss=sum back-propagates BCE + KLD


@pytest.mark.parametrize("check", checks())
def test_vae(check):
    data = [x.sigmoid() for x in batches(5, (8, 12))]
    compare(VAE, vae_hand, VAETrainer, fixed(data), check, steps=5, optimizer=partial(torch.optim.Adam, lr=1e-3),
            multi_loss="sum")


# -- mean teacher: CuriousAI/mean-teacher, pytorch/main.py (train, update_ema_variables) and
#    pytorch/mean_teacher/losses.py (softmax_mse_loss) ----------------------------------------------------
NO_LABEL, EMA_DECAY, CONSISTENCY = -1, 0.99, 0.5


def student_and_teacher():
    model = nn.Module()
    model.student, model.teacher = bn_classifier(), bn_classifier()
    for param in model.teacher.parameters():  # create_model(ema=True)
        param.detach_()
    return model


def softmax_mse_loss(input_logits, target_logits):
    num_classes = input_logits.size()[1]
    return F.mse_loss(F.softmax(input_logits, dim=1), F.softmax(target_logits, dim=1), reduction="sum") / num_classes


def update_ema_variables(model, ema_model, alpha, global_step):
    alpha = min(1 - 1 / (global_step + 1), alpha)  # the true average until the exponential one is more correct
    for ema_param, param in zip(ema_model.parameters(), model.parameters()):
        ema_param.data.mul_(alpha).add_(param.data, alpha=1 - alpha)


def mean_teacher_losses(model, batch):
    (input, ema_input), target = batch
    minibatch_size = len(target)
    with torch.no_grad():  # volatile=True in the source
        ema_logit = model.teacher(ema_input)
    class_logit = cons_logit = model.student(input)
    ema_logit = ema_logit.detach()
    class_loss = nn.CrossEntropyLoss(reduction="sum", ignore_index=NO_LABEL)(class_logit, target) / minibatch_size
    consistency_loss = CONSISTENCY * softmax_mse_loss(cons_logit, ema_logit) / minibatch_size
    return class_loss, consistency_loss


def mean_teacher_opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True)


def mean_teacher_hand(model, data):
    optimizer = mean_teacher_opt(model.student.parameters())
    model.student.train()
    model.teacher.train()
    for global_step, batch in enumerate(data, 1):
        class_loss, consistency_loss = mean_teacher_losses(model, batch)
        res_loss = 0  # logit_distance_cost < 0: no residual term
        loss = class_loss + consistency_loss + res_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        update_ema_variables(model.student, model.teacher, EMA_DECAY, global_step)


class MeanTeacher(Trainer):
    """Each term returned by name; the residual term, off in this configuration, is a constant zero."""

    def configure_optimizers(self):
        return mean_teacher_opt(self.model.student.parameters())

    def training_step(self, batch):
        class_loss, consistency_loss = mean_teacher_losses(self.model, batch)
        return {"class": class_loss, "consistency": consistency_loss, "res": torch.zeros(())}

    def on_step_end(self, losses):
        update_ema_variables(self.model.student, self.model.teacher, EMA_DECAY, self.state.step)


def semi_supervised(n):
    gen = torch.Generator().manual_seed(10)
    out = []
    for _ in range(n):
        x = torch.randn(8, 4, generator=gen)
        target = torch.randint(3, (8,), generator=gen)
        target[::2] = NO_LABEL  # half of each batch unlabelled
        out.append(((x + 0.1 * torch.randn(8, 4, generator=gen), x + 0.1 * torch.randn(8, 4, generator=gen)), target))
    return out


@pytest.mark.parametrize("check", checks())
def test_mean_teacher(check):
    compare(student_and_teacher, mean_teacher_hand, MeanTeacher, fixed(semi_supervised(5)), check, steps=5,
            multi_loss="sum")


# -- distillation: peterliht/knowledge-distillation-pytorch, train.py (train_kd) and model/net.py
#    (loss_fn_kd) -----------------------------------------------------------------------------------------
KD_ALPHA, KD_T = 0.9, 4.0


def student_and_frozen_teacher():
    model = nn.Module()
    model.student, model.teacher = bn_classifier(), bn_classifier()
    model.teacher.eval()
    return model


def loss_fn_kd(outputs, labels, teacher_outputs):
    return nn.KLDivLoss()(F.log_softmax(outputs / KD_T, dim=1), F.softmax(teacher_outputs / KD_T, dim=1)) \
        * (KD_ALPHA * KD_T * KD_T) + F.cross_entropy(outputs, labels) * (1. - KD_ALPHA)


def kd_loss(model, batch):
    train_batch, labels_batch = batch
    output_batch = model.student(train_batch)
    with torch.no_grad():
        output_teacher_batch = model.teacher(train_batch)
    return loss_fn_kd(output_batch, labels_batch, output_teacher_batch)


def kd_hand(model, data):
    optimizer = torch.optim.Adam(model.student.parameters(), lr=1e-2)
    model.student.train()
    model.teacher.eval()
    for batch in data:
        loss = kd_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


class Distillation(Trainer):
    def configure_optimizers(self):
        return torch.optim.Adam(self.model.student.parameters(), lr=1e-2)

    def training_step(self, batch):
        return kd_loss(self.model, batch)


@pytest.mark.parametrize("check", checks())
def test_knowledge_distillation(check):
    compare(student_and_frozen_teacher, kd_hand, Distillation, fixed(labelled(5)), check, steps=5)


# -- memory-efficient DenseNet (non-reentrant checkpoint around BatchNorm): pytorch/vision,
#    torchvision/models/densenet.py (_DenseLayer), trained as pytorch/examples imagenet/main.py trains ------
class DenseLayer(nn.Module):
    def __init__(self, num_input_features, growth_rate=4, bn_size=2):
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm1d(num_input_features), nn.ReLU(inplace=True)
        self.conv1 = nn.Linear(num_input_features, bn_size * growth_rate, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm1d(bn_size * growth_rate), nn.ReLU(inplace=True)
        self.conv2 = nn.Linear(bn_size * growth_rate, growth_rate, bias=False)

    def bn_function(self, inputs):
        return self.conv1(self.relu1(self.norm1(torch.cat(inputs, 1))))

    def forward(self, input):
        prev_features = [input] if isinstance(input, torch.Tensor) else input
        if any(t.requires_grad for t in prev_features):  # memory_efficient=True
            bottleneck_output = cp.checkpoint(lambda *inputs: self.bn_function(inputs), *prev_features,
                                              use_reentrant=False)
        else:
            bottleneck_output = self.bn_function(prev_features)
        return self.conv2(self.relu2(self.norm2(bottleneck_output)))


class DenseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0 = nn.Linear(4, 4)
        self.layers = nn.ModuleList([DenseLayer(4), DenseLayer(8)])
        self.norm5, self.classifier = nn.BatchNorm1d(12), nn.Linear(12, 3)

    def forward(self, x):
        features = [self.conv0(x)]
        for layer in self.layers:
            features.append(layer(features))
        return self.classifier(F.relu(self.norm5(torch.cat(features, 1))))


def densenet_opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


def densenet_hand(model, data):
    criterion, optimizer = nn.CrossEntropyLoss(), densenet_opt(model.parameters())
    model.train()
    for images, target in data:
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("check", checks())
def test_checkpointed_densenet_with_batchnorm(check):
    compare(DenseNet, densenet_hand, Trainer, fixed(labelled(5)), check, steps=5, optimizer=densenet_opt,
            loss_fn=nn.CrossEntropyLoss())


# -- a compiled GPT with gradient accumulation and clipping: karpathy/nanoGPT, train.py and model.py
#    (GPT.configure_optimizers, tied embedding) ---------------------------------------------------------
VOCAB, BLOCK, ACCUM = 11, 6, 2


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, 8), nn.Embedding(BLOCK, 8)
        self.ln_f, self.mlp = nn.LayerNorm(8), nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.lm_head = nn.Linear(8, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        logits = self.lm_head(self.ln_f(x + self.mlp(x)))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-1)

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        optim_groups = [{"params": [p for p in param_dict.values() if p.dim() >= 2], "weight_decay": weight_decay},
                        {"params": [p for p in param_dict.values() if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


def compiled(model):
    return torch.compile(model, backend="aot_eager")  # the source's default backend (inductor) builds C++


def gpt_batches(n):
    gen = torch.Generator().manual_seed(11)
    return [(torch.randint(VOCAB, (4, BLOCK), generator=gen), torch.randint(VOCAB, (4, BLOCK), generator=gen))
            for _ in range(n)]


def gpt_hand(raw_model, data):
    optimizer = raw_model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    model = compiled(raw_model)
    batches_ = iter(data)
    X, Y = next(batches_)
    for _ in range(len(data) // ACCUM):
        for micro_step in range(ACCUM):
            logits, loss = model(X, Y)
            loss = loss / ACCUM  # scale the loss to account for gradient accumulation
            X, Y = next(batches_, (None, None))  # prefetch the next batch while the model runs
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class CompiledGPT(Trainer):
    def __init__(self, model, **kwargs):
        super().__init__(model=compiled(model), **kwargs)

    def configure_optimizers(self):
        return self.model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))

    def training_step(self, batch):
        X, Y = batch
        logits, loss = self.model(X, Y)
        return loss


@pytest.mark.parametrize("check", checks())
def test_compiled_gpt_with_gradient_accumulation(check):
    compare(GPT, gpt_hand, CompiledGPT, fixed(gpt_batches(6)), check, steps=6 // ACCUM, grad_accum=ACCUM,
            grad_clip=1.0)


# -- an ensemble whose members run in TorchScript's forked tasks: pytorch/tutorials,
#    advanced_source/torch-script-parallelism.rst (LSTMEnsemble), trained by a plain loop ------------------
class BidirectionalRecurrentLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell_f, self.cell_b = nn.LSTM(input_size=3, hidden_size=4), nn.LSTM(input_size=3, hidden_size=4)

    def forward(self, x):
        future_f = torch.jit.fork(self.cell_f, x)  # forward direction in parallel
        output_b, _ = self.cell_b(torch.flip(x, dims=[0]))
        output_b_rev = torch.flip(output_b, dims=[0])
        output_f, _ = torch.jit.wait(future_f)
        return torch.cat((output_f, output_b_rev), dim=2)


class LSTMEnsemble(nn.Module):
    def __init__(self, n_models=2):
        super().__init__()
        self.models = nn.ModuleList([BidirectionalRecurrentLSTM() for _ in range(n_models)])

    def forward(self, x):
        futures = [torch.jit.fork(model, x) for model in self.models]
        results = [torch.jit.wait(fut) for fut in futures]
        return torch.stack(results).sum(dim=0)


def ensemble_hand(model, data):
    scripted, optimizer = torch.jit.script(model), torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        loss = F.mse_loss(scripted(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


class Ensemble(Trainer):
    def __init__(self, model, **kwargs):
        super().__init__(model=model, **kwargs)
        self.scripted = torch.jit.script(model)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.scripted(x), y)


@pytest.mark.parametrize("check", checks())
def test_scripted_ensemble_with_forked_members(check):
    compare(LSTMEnsemble, ensemble_hand, Ensemble, fixed(batches(4, (5, 2, 3), (5, 2, 8))), check, steps=4,
            optimizer=partial(torch.optim.SGD, lr=0.1))
