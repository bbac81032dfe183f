# gdtuo_hyperoptimized_adam.py (kach/gradient-descent-the-ultimate-optimizer's gdtuo.py and README loop) with Adam's
# step making the weights again from themselves with their graph (`param` for `param.detach()`): it trains the same,
# but each step's backward goes through every earlier step's graph, kept by create_graph=True, so memory and time grow
# with the steps. (torch's own warning about create_graph's reference cycle is filtered.)
import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F


class Optimizable:
    def __init__(self, parameters, optimizer):
        self.parameters = parameters  # a dict mapping names to tensors
        self.optimizer = optimizer   # which must itself be Optimizable!
        self.all_params_with_gradients = []

    def initialize(self):
        pass

    def begin(self):
        for param in self.all_params_with_gradients:
            param.grad = None
        self.all_params_with_gradients.clear()
        for name, param in self.parameters.items():
            param.requires_grad_()  # keep gradient information...
            param.retain_grad()    # even if not a leaf...
            self.all_params_with_gradients.append(param)
        self.optimizer.begin()

    def zero_grad(self):
        for param in self.all_params_with_gradients:
            param.grad = torch.zeros_like(param)
        self.optimizer.zero_grad()

    def step(self):
        pass


class NoOpOptimizer(Optimizable):
    def __init__(self):
        pass

    def initialize(self):
        pass

    def begin(self):
        pass

    def zero_grad(self):
        pass

    def step(self, params):
        pass


class SGD(Optimizable):
    def __init__(self, alpha=0.01, mu=0.0, optimizer=NoOpOptimizer()):
        self.mu = mu
        self.state = {}
        parameters = {
            'alpha': torch.tensor(alpha),
            'mu': torch.tensor(mu)
        }
        super().__init__(parameters, optimizer)

    def step(self, params):
        self.optimizer.step(self.parameters)
        for name, param in params.items():
            g = param.grad.detach()
            p = param.detach()
            if self.mu != 0.0:
                if name not in self.state:
                    buf = self.state[name] = g
                else:
                    buf = self.state[name].detach()
                    buf = buf * self.parameters['mu'] + g
                g = self.state[name] = buf
            params[name] = p - g * self.parameters['alpha']


class Adam(Optimizable):
    def clamp(x):
        return (x.tanh() + 1.) / 2.

    def unclamp(y):
        z = y * 2. - 1.
        return ((1. + z) / (1. - z)).log() / 2.

    def __init__(self, alpha=0.001, beta1=0.9, beta2=0.999, log_eps=-8., optimizer=NoOpOptimizer()):
        self.eps = 10. ** log_eps
        parameters = {
            'alpha': torch.tensor(alpha),
            'beta1': Adam.unclamp(torch.tensor(beta1)),
            'beta2': Adam.unclamp(torch.tensor(beta2)),
        }
        super().__init__(parameters, optimizer)
        self.num_stepments = 0
        self.cache = {}

    def step(self, params):
        self.num_stepments += 1
        self.optimizer.step(self.parameters)
        t = self.num_stepments
        beta1 = Adam.clamp(self.parameters['beta1'])
        beta2 = Adam.clamp(self.parameters['beta2'])
        for name, param in params.items():
            if name not in self.cache:
                self.cache[name] = {
                    'm': torch.zeros_like(param),
                    'v': torch.zeros_like(param) + self.eps
                }
            g = param.grad.detach()
            self.cache[name]['m'] = m = beta1 * self.cache[name]['m'].detach() + (1. - beta1) * g
            self.cache[name]['v'] = v = beta2 * self.cache[name]['v'].detach() + (1. - beta2) * g * g
            self.all_params_with_gradients.append(m)
            self.all_params_with_gradients.append(v)
            m_hat = m / (1. - beta1 ** float(t))
            v_hat = v / (1. - beta2 ** float(t))
            dparam = m_hat / (v_hat ** 0.5 + self.eps)
            params[name] = param - self.parameters['alpha'] * dparam


class ModuleWrapper(Optimizable):
    def __init__(self, module, optimizer=NoOpOptimizer()):
        self.module = module
        parameters = {k: v for k, v in module.named_parameters(recurse=True)}
        super().__init__(parameters, optimizer)

    def initialize(self):
        self.optimizer.initialize()

    def zero_grad(self):
        self.module.zero_grad()
        for param in self.all_params_with_gradients:
            param.grad = torch.zeros_like(param)
        self.optimizer.zero_grad()

    def forward(self, *xyz):
        return self.module(*xyz)

    def step(self):
        self.optimizer.step(self.parameters)

        def set_param(m, k, v):
            kk = k
            while '.' in k:
                sm = k[:k.index('.')]
                k = k[k.index('.') + 1:]
                m = m._modules[sm]
            m._parameters[k] = None
            m._parameters[k] = self.parameters[kk]

        for k, v in self.module.named_parameters(recurse=True):
            set_param(self.module, k, v)


class MNIST_FullyConnected(nn.Module):
    def __init__(self, num_inp, num_hid, num_out):
        super(MNIST_FullyConnected, self).__init__()
        self.layer1 = nn.Linear(num_inp, num_hid)
        self.layer2 = nn.Linear(num_hid, num_out)

    def initialize(self):
        nn.init.kaiming_uniform_(self.layer1.weight, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.layer2.weight, a=math.sqrt(5))

    def forward(self, x):
        x = self.layer1(x)
        x = torch.tanh(x)
        x = self.layer2(x)
        x = torch.tanh(x)
        x = F.log_softmax(x, dim=1)
        return x


warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
torch.manual_seed(0)
data = [(torch.randn(8, 4, 4), torch.randint(0, 3, (8,))) for _ in range(4)]
model = MNIST_FullyConnected(4 * 4, 8, 3)
optim = Adam(optimizer=SGD(1e-5))
mw = ModuleWrapper(model, optimizer=optim)
mw.initialize()
for i in range(1, 3):
    running_loss = 0.0
    for j, (features_, labels_) in enumerate(data):
        mw.begin()  # call this before each step, enables gradient tracking on desired params
        features, labels = torch.reshape(features_, (-1, 4 * 4)), labels_
        pred = mw.forward(features)
        loss = F.nll_loss(pred, labels)
        mw.zero_grad()
        loss.backward(create_graph=True)  # important! use create_graph=True
        mw.step()
        running_loss += loss.item() * features_.size(0)
    print(f"EPOCH: {i}, TRAIN LOSS: {running_loss / 32!r}, alpha {optim.parameters['alpha'].item()!r}")
print([p.detach().sum().item() for p in model.parameters()])
