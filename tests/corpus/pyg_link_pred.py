"""torch_geometric's link_pred.py, shrunk: T.Compose([NormalizeFeatures, ToDevice, RandomLinkSplit])
on a synthetic graph, GCN encoder, negative_sampling each epoch, ROC-AUC via sklearn."""

import json
import random

import torch
import torch_geometric.transforms as T
from sklearn.metrics import roc_auc_score
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv
from torch_geometric.utils import dropout_edge, negative_sampling, to_undirected

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = Data(x=torch.rand(30, 6, generator=g), edge_index=to_undirected(torch.randint(0, 30, (2, 80), generator=g)))
transform = T.Compose(
    [
        T.NormalizeFeatures(),
        T.ToDevice(device),
        T.RandomLinkSplit(num_val=0.1, num_test=0.1, is_undirected=True, add_negative_train_samples=False),
    ]
)
torch.manual_seed(1)
random.seed(1)  # its negative edges come from Python's random
train_data, val_data, test_data = transform(data)


class Net(torch.nn.Module):
    def __init__(self, i, h, o):
        super().__init__()
        self.conv1, self.conv2 = GCNConv(i, h), GCNConv(h, o)

    def encode(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    def decode(self, z, edge_label_index):
        return (z[edge_label_index[0]] * z[edge_label_index[1]]).sum(dim=-1)


torch.manual_seed(3)  # the CPU generator: RandomLinkSplit drew from the device's
model = Net(6, 16, 8).to(device)
optimizer = torch.optim.Adam(params=model.parameters(), lr=0.01)
criterion = torch.nn.BCEWithLogitsLoss()
torch.manual_seed(2)
random.seed(2)  # negative_sampling draws with Python's random
losses, aucs = [], []
for epoch in range(3):
    model.train()
    optimizer.zero_grad()
    ei, _ = dropout_edge(train_data.edge_index, p=0.2)
    z = model.encode(train_data.x, ei)
    neg = negative_sampling(
        edge_index=train_data.edge_index,
        num_nodes=train_data.num_nodes,
        num_neg_samples=train_data.edge_label_index.size(1),
        method="sparse",
    )
    eli = torch.cat([train_data.edge_label_index, neg], dim=-1)
    el = torch.cat([train_data.edge_label, train_data.edge_label.new_zeros(neg.size(1))], dim=0)
    loss = criterion(model.decode(z, eli).view(-1), el)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        z = model.encode(test_data.x, test_data.edge_index)
        out = model.decode(z, test_data.edge_label_index).view(-1).sigmoid()
    aucs.append(roc_auc_score(test_data.edge_label.cpu().numpy(), out.cpu().numpy()))
print(
    json.dumps(
        {
            "device": str(train_data.x.device),
            "losses": losses,
            "aucs": aucs,
            "n_train": int(train_data.edge_label_index.size(1)),
            "neg": neg[:, :4].tolist(),
        }
    )
)
