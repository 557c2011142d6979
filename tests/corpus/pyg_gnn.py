"""torch_geometric's examples (gcn.py, gat.py, a graph-classification GIN with global pooling),
shrunk onto small synthetic graphs: Data moved with .to(device), cached GCN normalisation,
GAT attention with dropout, mini-batches from PyG's DataLoader."""

import json

import torch
import torch.nn.functional as F
import torch_geometric.transforms as T
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GATConv, GCNConv, GINConv, global_add_pool, global_mean_pool
from torch_geometric.utils import to_undirected

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
g = torch.Generator().manual_seed(0)
torch.manual_seed(0)


def graph(n, e, feats, classes):
    edge_index = to_undirected(torch.randint(0, n, (2, e), generator=g))
    data = Data(
        x=torch.rand(n, feats, generator=g), edge_index=edge_index, y=torch.randint(0, classes, (n,), generator=g)
    )
    data.train_mask = torch.rand(n, generator=g) < 0.6
    data.test_mask = ~data.train_mask
    return data


data = T.NormalizeFeatures()(graph(40, 120, 8, 3)).to(device)


class GCN(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels):
        super().__init__()
        self.conv1 = GCNConv(in_channels, hidden_channels, cached=True, normalize=True)
        self.conv2 = GCNConv(hidden_channels, out_channels, cached=True, normalize=True)

    def forward(self, x, edge_index, edge_weight=None):
        x = F.dropout(x, p=0.5, training=self.training)
        x = self.conv1(x, edge_index, edge_weight).relu()
        x = F.dropout(x, p=0.5, training=self.training)
        return self.conv2(x, edge_index, edge_weight)


class GAT(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, heads):
        super().__init__()
        self.conv1 = GATConv(in_channels, hidden_channels, heads, dropout=0.6)
        self.conv2 = GATConv(hidden_channels * heads, out_channels, heads=1, concat=False, dropout=0.6)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=0.6, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=0.6, training=self.training)
        return self.conv2(x, edge_index)


out = {"device": str(data.x.device)}
for name, model in (("gcn", GCN(8, 16, 3)), ("gat", GAT(8, 4, 3, heads=2))):
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    torch.manual_seed(3)  # dropout draws from the device's generator: seed it after the CPU-side init
    losses, accs = [], []
    for epoch in range(4):
        model.train()
        optimizer.zero_grad()
        o = model(data.x, data.edge_index)
        loss = F.cross_entropy(o[data.train_mask], data.y[data.train_mask])
        loss.backward()
        optimizer.step()
        model.eval()
        pred = model(data.x, data.edge_index).argmax(dim=-1)
        accs.append(int((pred[data.test_mask] == data.y[data.test_mask]).sum()) / int(data.test_mask.sum()))
        losses.append(float(loss))
    out[name] = {"losses": losses, "accs": accs}


class GIN(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        for i in range(2):
            mlp = torch.nn.Sequential(
                torch.nn.Linear(in_channels if i == 0 else hidden, hidden),
                torch.nn.BatchNorm1d(hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, hidden),
            )
            self.convs.append(GINConv(mlp, train_eps=True))
        self.lin = torch.nn.Linear(2 * hidden, out_channels)

    def forward(self, x, edge_index, batch):
        for conv in self.convs:
            x = conv(x, edge_index).relu()
        return self.lin(torch.cat([global_add_pool(x, batch), global_mean_pool(x, batch)], -1))


dataset = []
for i in range(12):
    d = graph(6 + i % 4, 12, 5, 1)
    d.y = torch.tensor([i % 2])
    dataset.append(d)
loader = DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
torch.manual_seed(4)  # the CPU generator: locally the dropout above drew from it
model = GIN(5, 16, 2).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
losses = []
for epoch in range(2):
    model.train()
    for batch in loader:
        batch = batch.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch.x, batch.edge_index, batch.batch), batch.y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item() * batch.num_graphs)
out["gin"] = {"losses": losses, "eps": [c.eps.item() for c in model.convs]}
print(json.dumps(out))
