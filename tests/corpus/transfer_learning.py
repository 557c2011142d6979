"""The PyTorch tutorial "Transfer Learning for Computer Vision", shrunk: a small pretrained-style
ResNet fine-tuned whole, then used as a fixed feature extractor (``requires_grad = False``, a new
head), with the tutorial's train/val phases under ``torch.set_grad_enabled``, StepLR, running
corrects summed from ``preds == labels.data`` and the best weights kept by deepcopy."""
import copy
import json

import torch
import torch.nn as nn
import torch.optim as optim
from torch.optim import lr_scheduler

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
gen = torch.Generator().manual_seed(7)


class BasicBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class TinyResNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(8)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def make_loader(n, bs):
    xs = torch.randn(n, 3, 16, 16, generator=gen)
    ys = (xs[:, 0].mean((1, 2)) > 0).long()
    return [(xs[i:i + bs], ys[i:i + bs]) for i in range(0, n, bs)]


dataloaders = {"train": make_loader(24, 8), "val": make_loader(12, 6)}
dataset_sizes = {"train": 24, "val": 12}


def train_model(model, criterion, optimizer, scheduler, num_epochs=2):
    history = []
    best_model_wts = copy.deepcopy(model.state_dict())
    best_acc = 0.0
    for epoch in range(num_epochs):
        for phase in ["train", "val"]:
            if phase == "train":
                model.train()
            else:
                model.eval()
            running_loss = 0.0
            running_corrects = 0
            for inputs, labels in dataloaders[phase]:
                inputs = inputs.to(device)
                labels = labels.to(device)
                optimizer.zero_grad()
                with torch.set_grad_enabled(phase == "train"):
                    outputs = model(inputs)
                    _, preds = torch.max(outputs, 1)
                    loss = criterion(outputs, labels)
                    if phase == "train":
                        loss.backward()
                        optimizer.step()
                running_loss += loss.item() * inputs.size(0)
                running_corrects += torch.sum(preds == labels.data)
            if phase == "train":
                scheduler.step()
            epoch_loss = running_loss / dataset_sizes[phase]
            epoch_acc = running_corrects.double() / dataset_sizes[phase]
            history.append([phase, epoch_loss, epoch_acc.item(), scheduler.get_last_lr()[0]])
            if phase == "val" and epoch_acc > best_acc:
                best_acc = epoch_acc
                best_model_wts = copy.deepcopy(model.state_dict())
    model.load_state_dict(best_model_wts)
    return model, history, float(best_acc)


pretrained = TinyResNet(num_classes=10)  # stands for models.resnet18(weights=...)
state = copy.deepcopy(pretrained.state_dict())

model_ft = TinyResNet(num_classes=10)
model_ft.load_state_dict(state)
num_ftrs = model_ft.fc.in_features
model_ft.fc = nn.Linear(num_ftrs, 2)
model_ft = model_ft.to(device)
criterion = nn.CrossEntropyLoss()
optimizer_ft = optim.SGD(model_ft.parameters(), lr=0.01, momentum=0.9)
exp_lr_scheduler = lr_scheduler.StepLR(optimizer_ft, step_size=1, gamma=0.1)
model_ft, hist_ft, best_ft = train_model(model_ft, criterion, optimizer_ft, exp_lr_scheduler)

model_conv = TinyResNet(num_classes=10)
model_conv.load_state_dict(state)
for param in model_conv.parameters():
    param.requires_grad = False
model_conv.fc = nn.Linear(num_ftrs, 2)
model_conv = model_conv.to(device)
optimizer_conv = optim.SGD(model_conv.fc.parameters(), lr=0.01, momentum=0.9)
exp_lr_scheduler = lr_scheduler.StepLR(optimizer_conv, step_size=1, gamma=0.1)
model_conv, hist_conv, best_conv = train_model(model_conv, criterion, optimizer_conv, exp_lr_scheduler)

model_conv.eval()
with torch.no_grad():
    inputs, _ = dataloaders["val"][0]
    probs = torch.softmax(model_conv(inputs.to(device)), 1)
print(json.dumps({
    "finetune": hist_ft, "best_finetune": best_ft, "feature_extractor": hist_conv, "best_conv": best_conv,
    "frozen_grads": [p.grad is None for p in model_conv.layer1.parameters()],
    "running_mean": model_ft.bn1.running_mean.cpu().tolist(),
    "probs": probs.cpu().tolist(), "device": str(probs.device),
}))
