"""The PyTorch tutorial "Adversarial Example Generation" (FGSM), shrunk: a small LeNet trained
for a few steps on synthetic digits, then attacked one example at a time with the sign of the
input's gradient, its accuracy read per epsilon as the tutorial reads it."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(42)
gen = torch.Generator().manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


images = torch.rand(24, 1, 12, 12, generator=gen)
labels = torch.randint(0, 10, (24,), generator=gen)
model = Net().to(device)
optimizer = optim.Adadelta(model.parameters(), lr=1.0)
train_losses = []
model.train()
for step in range(4):
    data, target = images[step * 6:(step + 1) * 6].to(device), labels[step * 6:(step + 1) * 6].to(device)
    optimizer.zero_grad()
    loss = F.nll_loss(model(data), target)
    loss.backward()
    optimizer.step()
    train_losses.append(loss.item())


def fgsm_attack(image, epsilon, data_grad):
    sign_data_grad = data_grad.sign()
    perturbed_image = image + epsilon * sign_data_grad
    perturbed_image = torch.clamp(perturbed_image, 0, 1)
    return perturbed_image


def denorm(batch, mean=(0.1307,), std=(0.3081,)):
    if isinstance(mean, tuple):
        mean = torch.tensor(mean).to(device)
    if isinstance(std, tuple):
        std = torch.tensor(std).to(device)
    return batch * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)


def test(model, device, epsilon):
    correct = 0
    adv_examples = []
    for i in range(len(images)):
        data, target = images[i:i + 1].to(device), labels[i:i + 1].to(device)
        data.requires_grad = True
        output = model(data)
        init_pred = output.max(1, keepdim=True)[1]
        if init_pred.item() != target.item():
            continue
        loss = F.nll_loss(output, target)
        model.zero_grad()
        loss.backward()
        data_grad = data.grad.data
        data_denorm = denorm(data)
        perturbed_data = fgsm_attack(data_denorm, epsilon, data_grad)
        perturbed_data_normalized = (perturbed_data - 0.1307) / 0.3081
        output = model(perturbed_data_normalized)
        final_pred = output.max(1, keepdim=True)[1]
        if final_pred.item() == target.item():
            correct += 1
        if len(adv_examples) < 2:
            adv_ex = perturbed_data.squeeze().detach().cpu().numpy()
            adv_examples.append((init_pred.item(), final_pred.item(), float(adv_ex.sum())))
    final_acc = correct / float(len(images))
    return final_acc, adv_examples


model.eval()
accuracies, examples = [], []
for eps in [0, 0.05, 0.2]:
    acc, ex = test(model, device, eps)
    accuracies.append(acc)
    examples.append(ex)
print(json.dumps({"train_losses": train_losses, "accuracies": accuracies, "examples": examples,
                  "device": str(next(model.parameters()).device)}))
