"""pytorch/examples time_sequence_prediction, shrunk: two LSTMCells in float64 fitted to sine waves
with L-BFGS (a closure), then predicting the future
plus activation checkpointing with dropout
inside (torch.utils.checkpoint restores the device's RNG state for the recomputation)."""

import json

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.checkpoint import checkpoint

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 12)
        self.lstm2 = nn.LSTMCell(12, 12)
        self.linear = nn.Linear(12, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 12, dtype=torch.double, device=input.device)
        c_t = torch.zeros(input.size(0), 12, dtype=torch.double, device=input.device)
        h_t2 = torch.zeros(input.size(0), 12, dtype=torch.double, device=input.device)
        c_t2 = torch.zeros(input.size(0), 12, dtype=torch.double, device=input.device)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


np.random.seed(2)
T, L, N = 20, 40, 8
x = np.empty((N, L), "int64")
x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
data = np.sin(x / 1.0 / T).astype("float64")
np.random.seed(0)
torch.manual_seed(0)
input = torch.from_numpy(data[3:, :-1]).to(device)
target = torch.from_numpy(data[3:, 1:]).to(device)
test_input = torch.from_numpy(data[:3, :-1]).to(device)
test_target = torch.from_numpy(data[:3, 1:]).to(device)
seq = Sequence().double().to(device)
criterion = nn.MSELoss()
optimizer = optim.LBFGS(seq.parameters(), lr=0.8, max_iter=4)
log = {"loss": [], "test": []}
for i in range(2):

    def closure():
        optimizer.zero_grad()
        out = seq(input)
        loss = criterion(out, target)
        loss.backward()
        return loss

    log["loss"].append(optimizer.step(closure).item())
    with torch.no_grad():
        future = 5
        pred = seq(test_input, future=future)
        log["test"].append(criterion(pred[:, :-future], test_target).item())
log["pred"] = pred[0, -future:].detach().cpu().numpy().tolist()

block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.GELU()).to(device)
head = nn.Linear(8, 1).to(device)
xs = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).to(device)
torch.manual_seed(5)  # dropout draws from the device's generator
ck = []
for use_reentrant in (False, True):
    h = checkpoint(block, xs.requires_grad_(True), use_reentrant=use_reentrant)
    head(h).sum().backward()
    ck.append(block[0].weight.grad.sum().item())
    block.zero_grad()
log["checkpoint_grads"] = ck
log["device"] = str(pred.device)
print(json.dumps(log))
