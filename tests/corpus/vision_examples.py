"""Three small vision programs, shrunk, on synthetic 28x28 digits:

- "Spatial Transformer Networks" tutorial: a localisation net whose last layer starts at the
  identity (``fc_loc[2].weight.data.zero_()``, ``bias.data.copy_``), ``F.affine_grid`` and
  ``F.grid_sample`` with ``align_corners`` both ways, trained with SGD; the tutorial's
  visualisation path (``convert_image_np``: ``.cpu().numpy().transpose``, torchvision-free grid);
- pytorch/examples mnist_rnn: an ``nn.LSTM(28, 64, batch_first=True)`` over image rows,
  Adadelta with StepLR, the test loop's ``pred.eq(target.view_as(pred)).sum().item()``;
- pytorch/examples siamese_network: a shared tower over image pairs, the concatenated and the
  ``|f1 - f2|`` heads with ``BCELoss``/``BCEWithLogitsLoss``, then ``TripletMarginLoss`` and
  ``TripletMarginWithDistanceLoss`` on anchor/positive/negative triplets."""
import json

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
images = torch.rand(16, 1, 28, 28, generator=gen)
labels = torch.randint(0, 10, (16,), generator=gen)
out = {}


class STNet(nn.Module):
    def __init__(self, align_corners):
        super().__init__()
        self.align_corners = align_corners
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(128, 16)
        self.fc2 = nn.Linear(16, 10)
        self.localization = nn.Sequential(
            nn.Conv2d(1, 4, kernel_size=7), nn.MaxPool2d(2, stride=2), nn.ReLU(True),
            nn.Conv2d(4, 6, kernel_size=5), nn.MaxPool2d(2, stride=2), nn.ReLU(True))
        self.fc_loc = nn.Sequential(nn.Linear(6 * 3 * 3, 32), nn.ReLU(True), nn.Linear(32, 3 * 2))
        self.fc_loc[2].weight.data.zero_()
        self.fc_loc[2].bias.data.copy_(torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.float))

    def stn(self, x):
        xs = self.localization(x)
        xs = xs.view(-1, 6 * 3 * 3)
        theta = self.fc_loc(xs)
        theta = theta.view(-1, 2, 3)
        grid = F.affine_grid(theta, x.size(), align_corners=self.align_corners)
        return F.grid_sample(x, grid, align_corners=self.align_corners)

    def forward(self, x):
        x = self.stn(x)
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 128)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def convert_image_np(inp):
    inp = inp.numpy().transpose((1, 2, 0))
    mean = np.array([0.485, 0.456, 0.406])
    std = np.array([0.229, 0.224, 0.225])
    inp = std * inp + mean
    return np.clip(inp, 0, 1)


for align_corners in (False, True):
    torch.manual_seed(1)
    model = STNet(align_corners).to(device)
    optimizer = optim.SGD(model.parameters(), lr=0.05)
    model.eval()  # (dropout off: a device's generator is its own)
    losses = []
    for step in range(3):
        data, target = images[step * 4:(step + 1) * 4].to(device), labels[step * 4:(step + 1) * 4].to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        data = images[:4].to(device)
        input_tensor = data.cpu()
        transformed_input_tensor = model.stn(data).cpu()
        in_grid = convert_image_np(input_tensor[0].repeat(3, 1, 1))
        out_grid = convert_image_np(transformed_input_tensor[0].repeat(3, 1, 1))
        test_loss = F.nll_loss(model(data), labels[:4].to(device), reduction="sum").item()
        theta = model.fc_loc(model.localization(data).view(-1, 54)).view(-1, 2, 3)
    out[f"stn_{align_corners}"] = {"losses": losses, "test_loss": test_loss, "in_grid": float(in_grid.sum()),
                                   "out_grid": float(out_grid.sum()), "theta": theta[0].tolist()}


class RNNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(input_size=28, hidden_size=32, batch_first=True)
        self.batchnorm = nn.BatchNorm1d(32)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, input):
        input = input.reshape(-1, 28, 28)
        output, hidden = self.rnn(input)
        output = output[:, -1, :]
        output = self.batchnorm(output)
        output = self.dropout1(output)
        output = self.fc1(output)
        output = F.relu(output)
        output = self.dropout2(output)
        output = self.fc2(output)
        return F.log_softmax(output, dim=1)


torch.manual_seed(2)
model = RNNNet().to(device)
for m in (model.dropout1, model.dropout2):
    m.p = 0.0
optimizer = optim.Adadelta(model.parameters(), lr=1.0)
scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
rnn_losses = []
for epoch in range(2):
    model.train()
    for batch_idx in range(2):
        data = images[batch_idx * 8:(batch_idx + 1) * 8].to(device)
        target = labels[batch_idx * 8:(batch_idx + 1) * 8].to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        rnn_losses.append(loss.item())
    scheduler.step()
model.eval()
test_loss, correct = 0, 0
with torch.no_grad():
    data, target = images.to(device), labels.to(device)
    output = model(data)
    test_loss += F.nll_loss(output, target, reduction="sum").item()
    pred = output.argmax(dim=1, keepdim=True)
    correct += pred.eq(target.view_as(pred)).sum().item()
out["mnist_rnn"] = {"losses": rnn_losses, "test_loss": test_loss, "correct": correct,
                    "lr": scheduler.get_last_lr(), "running_var": model.batchnorm.running_var.sum().item()}


class SiameseNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.ReLU(inplace=True),
                                   nn.Conv2d(4, 8, 3, stride=2), nn.ReLU(inplace=True),
                                   nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten())
        self.fc = nn.Sequential(nn.Linear(16, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
        self.sigmoid = nn.Sigmoid()
        self.tower.apply(self.init_weights)
        self.fc.apply(self.init_weights)

    def init_weights(self, m):
        if isinstance(m, nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            m.bias.data.fill_(0.01)

    def forward_once(self, x):
        return self.tower(x)

    def forward(self, input1, input2):
        output1 = self.forward_once(input1)
        output2 = self.forward_once(input2)
        output = torch.cat((output1, output2), 1)
        output = self.fc(output)
        return self.sigmoid(output), output1, output2


torch.manual_seed(3)
model = SiameseNetwork().to(device)
head = nn.Linear(8, 1).to(device)
optimizer = optim.Adadelta([*model.parameters(), *head.parameters()], lr=1.0)
criterion = nn.BCELoss()
siamese = []
for step in range(3):
    idx = torch.randperm(16, generator=gen)[:8]
    images_1, images_2 = images[idx[:4]].to(device), images[idx[4:]].to(device)
    targets = (labels[idx[:4]] == labels[idx[4:]]).float().to(device)
    targets[0] = 1.0
    optimizer.zero_grad()
    outputs, f1, f2 = model(images_1, images_2)
    outputs = outputs.squeeze()
    loss = criterion(outputs, targets)
    loss2 = F.binary_cross_entropy_with_logits(head(torch.abs(f1 - f2)).squeeze(1), targets)
    (loss + loss2).backward()
    optimizer.step()
    pred = torch.where(outputs > 0.5, 1, 0)
    siamese.append([loss.item(), loss2.item(), pred.eq(targets.view_as(pred)).sum().item()])
anchor, positive, negative = (torch.randn(6, 16, generator=gen).to(device).requires_grad_() for _ in range(3))
triplet = nn.TripletMarginLoss(margin=1.0, p=2)(anchor, positive, negative)
triplet_swap = nn.TripletMarginLoss(margin=0.5, p=1, swap=True, reduction="none")(anchor, positive, negative)
cos = nn.TripletMarginWithDistanceLoss(distance_function=lambda a, b: 1.0 - F.cosine_similarity(a, b),
                                       margin=0.3)(anchor, positive, negative)
(triplet + triplet_swap.sum() + cos).backward()
out["siamese"] = {"steps": siamese, "triplet": triplet.item(), "triplet_swap": triplet_swap.tolist(),
                  "cos": cos.item(), "anchor_grad": anchor.grad.abs().sum().item(),
                  "negative_grad": negative.grad.sum().item()}
out["device"] = str(anchor.device)
print(json.dumps(out))
