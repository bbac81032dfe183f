"""Knowledge distillation, logits and hints: pytorch/tutorials at commit 035c541fa706ab2b1eca57e0625b5bbdca5e04cb,
beginner_source/knowledge_distillation_tutorial.py (``DeepNN``, ``LightNN``, ``train``, ``test``,
``train_knowledge_distillation``, ``ModifiedDeepNNRegressor``, ``ModifiedLightNNRegressor``, ``train_mse_loss``,
``test_multiple_outputs``, and the order the tutorial runs them in).

A teacher is trained with cross-entropy and tested under ``no_grad``; two students are made from
``torch.manual_seed(42)`` at the point the tutorial makes them. One is distilled from the teacher's logits: the
teacher in eval mode under ``no_grad``, soft targets at temperature ``T`` against the student's ``log_softmax``,
``-sum(...) / batch * T**2`` weighted with the cross-entropy. For the hint-based one, a second teacher class is
loaded with ``load_state_dict(nn_deep.state_dict())`` and returns its last feature map, which a trainable
regressor on the student's features matches by MSE. Dropout in every classifier; Adam made inside each
training function.

Changes for a seconds-long test: 3x8x8 images, 3 classes, the networks at 2-8 channels and 8 hidden units
(the classifiers' inputs follow), 3 batches of 4 and one epoch per stage, 2 test batches; ``.to(device)`` kept
(the CPU), the printing left out; the cross-entropy student and the cosine-loss stage left out.

The port is one Trainer per stage, as a user would write it: the default ``training_step`` with
``loss_fn=nn.CrossEntropyLoss()`` for the teacher, then one subclass per student holding the teacher as an
attribute; the tests between stages are the tutorial's functions.
"""
import warnings
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.optim as optim

from safeloop import GraphGuard, Trainer
from safeloop.watch import Watch

from .harness import assert_same, checks, strict

CLASSES, EPOCHS, LR, T, SOFT_WEIGHT, CE_WEIGHT = 3, 1, 0.001, 2, 0.25, 0.75
device = torch.device("cpu")


# -- beginner_source/knowledge_distillation_tutorial.py (narrowed) -----------------------------------------------
class DeepNN(nn.Module):
    def __init__(self, num_classes=10):
        super(DeepNN, self).__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(8, 8, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 4, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16, 8),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(8, num_classes)
        )

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


class LightNN(nn.Module):
    def __init__(self, num_classes=10):
        super(LightNN, self).__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(4, 2, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(8, 8),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(8, num_classes)
        )

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


class ModifiedDeepNNRegressor(DeepNN):
    def forward(self, x):
        x = self.features(x)
        conv_feature_map = x
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x, conv_feature_map


class ModifiedLightNNRegressor(LightNN):
    def __init__(self, num_classes=10):
        super(ModifiedLightNNRegressor, self).__init__(num_classes)
        # Include an extra regressor (in our case linear)
        self.regressor = nn.Sequential(
            nn.Conv2d(2, 4, kernel_size=3, padding=1)
        )

    def forward(self, x):
        x = self.features(x)
        regressor_output = self.regressor(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x, regressor_output


def train(model, train_loader, epochs, learning_rate, device):
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(model.parameters(), lr=learning_rate)

    model.train()

    for epoch in range(epochs):
        running_loss = 0.0
        for inputs, labels in train_loader:
            # inputs: A collection of batch_size images
            # labels: A vector of dimensionality batch_size with integers denoting class of each image
            inputs, labels = inputs.to(device), labels.to(device)

            optimizer.zero_grad()
            outputs = model(inputs)

            # outputs: Output of the network for the collection of images. A tensor of dimensionality
            # batch_size x num_classes
            # labels: The actual labels of the images. Vector of dimensionality batch_size
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()

            running_loss += loss.item()


def test(model, test_loader, device, multiple_outputs=False):
    model.to(device)
    model.eval()

    correct = 0
    total = 0

    with torch.no_grad():
        for inputs, labels in test_loader:
            inputs, labels = inputs.to(device), labels.to(device)

            outputs = model(inputs)
            if multiple_outputs:  # test_multiple_outputs
                outputs, _ = outputs
            _, predicted = torch.max(outputs.data, 1)

            total += labels.size(0)
            correct += (predicted == labels).sum().item()

    accuracy = 100 * correct / total
    return accuracy


test.__test__ = False  # the tutorial's name, not a pytest test


def train_knowledge_distillation(teacher, student, train_loader, epochs, learning_rate, T, soft_target_loss_weight,
                                 ce_loss_weight, device):
    ce_loss = nn.CrossEntropyLoss()
    optimizer = optim.Adam(student.parameters(), lr=learning_rate)

    teacher.to(device)
    student.to(device)
    teacher.eval()  # Teacher set to evaluation mode
    student.train() # Student to train mode

    for epoch in range(epochs):
        running_loss = 0.0
        for inputs, labels in train_loader:
            inputs, labels = inputs.to(device), labels.to(device)

            optimizer.zero_grad()

            # Forward pass with the teacher model - do not save gradients here as we do not change the teacher's weights
            with torch.no_grad():
                teacher_logits = teacher(inputs)

            # Forward pass with the student model
            student_logits = student(inputs)

            #Soften the student logits by applying softmax first and log() second
            soft_targets = nn.functional.softmax(teacher_logits / T, dim=-1)
            soft_prob = nn.functional.log_softmax(student_logits / T, dim=-1)

            # Calculate the soft targets loss. Scaled by T**2 as suggested by the authors of the paper
            # "Distilling the knowledge in a neural network"
            soft_targets_loss = -torch.sum(soft_targets * soft_prob) / soft_prob.size()[0] * (T**2)

            # Calculate the true label loss
            label_loss = ce_loss(student_logits, labels)

            # Weighted sum of the two losses
            loss = soft_target_loss_weight * soft_targets_loss + ce_loss_weight * label_loss

            loss.backward()
            optimizer.step()

            running_loss += loss.item()


def train_mse_loss(teacher, student, train_loader, epochs, learning_rate, feature_map_weight, ce_loss_weight, device):
    ce_loss = nn.CrossEntropyLoss()
    mse_loss = nn.MSELoss()
    optimizer = optim.Adam(student.parameters(), lr=learning_rate)

    teacher.to(device)
    student.to(device)
    teacher.eval()  # Teacher set to evaluation mode
    student.train() # Student to train mode

    for epoch in range(epochs):
        running_loss = 0.0
        for inputs, labels in train_loader:
            inputs, labels = inputs.to(device), labels.to(device)

            optimizer.zero_grad()

            # Again ignore teacher logits
            with torch.no_grad():
                _, teacher_feature_map = teacher(inputs)

            # Forward pass with the student model
            student_logits, regressor_feature_map = student(inputs)

            # Calculate the loss
            hidden_rep_loss = mse_loss(regressor_feature_map, teacher_feature_map)

            # Calculate the true label loss
            label_loss = ce_loss(student_logits, labels)

            # Weighted sum of the two losses
            loss = feature_map_weight * hidden_rep_loss + ce_loss_weight * label_loss

            loss.backward()
            optimizer.step()

            running_loss += loss.item()


# -- the tutorial's order ------------------------------------------------------------------------------------------
def tutorial(train_loader, test_loader, train, train_knowledge_distillation, train_mse_loss):
    """The tutorial's script from the teacher's training on, with its three training functions given."""
    torch.manual_seed(42)
    nn_deep = DeepNN(num_classes=CLASSES)
    train(nn_deep, train_loader, epochs=EPOCHS, learning_rate=LR, device=device)
    test(nn_deep, test_loader, device)

    torch.manual_seed(42)
    new_nn_light = LightNN(num_classes=CLASSES)
    train_knowledge_distillation(teacher=nn_deep, student=new_nn_light, train_loader=train_loader, epochs=EPOCHS,
                                 learning_rate=LR, T=T, soft_target_loss_weight=SOFT_WEIGHT, ce_loss_weight=CE_WEIGHT,
                                 device=device)
    test(new_nn_light, test_loader, device)

    torch.manual_seed(42)
    modified_light_nn_mse = ModifiedLightNNRegressor(num_classes=CLASSES)
    modified_nn_deep_reg = ModifiedDeepNNRegressor(num_classes=CLASSES)
    modified_nn_deep_reg.load_state_dict(nn_deep.state_dict())
    train_mse_loss(teacher=modified_nn_deep_reg, student=modified_light_nn_mse, train_loader=train_loader,
                   epochs=EPOCHS, learning_rate=LR, feature_map_weight=SOFT_WEIGHT, ce_loss_weight=CE_WEIGHT,
                   device=device)
    test(modified_light_nn_mse, test_loader, device, multiple_outputs=True)
    return nn.ModuleDict({"deep": nn_deep, "light_kd": new_nn_light, "light_mse": modified_light_nn_mse})


def loaders():
    gen = torch.Generator().manual_seed(4)
    make = lambda: (torch.randn(4, 3, 8, 8, generator=gen), torch.randint(CLASSES, (4,), generator=gen))
    return [make() for _ in range(3)], [make() for _ in range(2)]


def hand(train_loader, test_loader):
    return tutorial(train_loader, test_loader, train, train_knowledge_distillation, train_mse_loss)


# -- the port ----------------------------------------------------------------------------------------------------
class Distill(Trainer):
    teacher: nn.Module

    def on_fit_start(self):
        self.teacher.eval()

    def training_step(self, batch):
        inputs, labels = batch
        with torch.no_grad():
            teacher_logits = self.teacher(inputs)
        student_logits = self.model(inputs)
        soft_targets = nn.functional.softmax(teacher_logits / T, dim=-1)
        soft_prob = nn.functional.log_softmax(student_logits / T, dim=-1)
        soft_targets_loss = -torch.sum(soft_targets * soft_prob) / soft_prob.size()[0] * (T**2)
        label_loss = nn.CrossEntropyLoss()(student_logits, labels)
        return SOFT_WEIGHT * soft_targets_loss + CE_WEIGHT * label_loss


class Hint(Distill):
    def training_step(self, batch):
        inputs, labels = batch
        with torch.no_grad():
            _, teacher_feature_map = self.teacher(inputs)
        student_logits, regressor_feature_map = self.model(inputs)
        hidden_rep_loss = nn.MSELoss()(regressor_feature_map, teacher_feature_map)
        label_loss = nn.CrossEntropyLoss()(student_logits, labels)
        return SOFT_WEIGHT * hidden_rep_loss + CE_WEIGHT * label_loss


def fit(kind, model, train_loader, check, teacher=None, **kwargs):
    trainer = kind(model=model, train_data=train_loader, optimizer=partial(optim.Adam, lr=LR), max_epochs=EPOCHS,
                   device="cpu", progress=False, loggers=(), guard={"check": check}, **kwargs)
    if teacher is not None:
        trainer.teacher = teacher
    trainer.fit()
    assert trainer.state.step == EPOCHS * len(train_loader)


def port(train_loader, test_loader, check):
    return tutorial(
        train_loader, test_loader,
        lambda model, loader, epochs, learning_rate, device: fit(Trainer, model, loader, check,
                                                                 loss_fn=nn.CrossEntropyLoss()),
        lambda teacher, student, train_loader, **kw: fit(Distill, student, train_loader, check, teacher),
        lambda teacher, student, train_loader, **kw: fit(Hint, student, train_loader, check, teacher))


@pytest.mark.parametrize("check", checks())
def test_distillation_from_logits_and_from_a_hint_after_the_teacher_is_trained(check):
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref = hand(*loaders())
    with strict(own), Watch(GraphGuard(check=check), hand.__code__.co_filename):  # as harness.compare
        watched = hand(*loaders())
    assert_same(watched, ref)
    with strict(own):
        ours = port(*loaders(), check)
    assert_same(ours, ref)
    torch.manual_seed(42)
    start = LightNN(num_classes=CLASSES)
    assert not torch.equal(ref["light_kd"].classifier[3].weight, start.classifier[3].weight)
