"""pytorch/examples gat and a vision transformer written from scratch, shrunk:

- GAT: a multi-head ``GraphAttentionLayer`` (xavier-initialised ``W`` and ``a`` parameters,
  ``torch.matmul`` against ``a[:, :n_hidden, :]``, ``LeakyReLU``, a connectivity mask by
  ``torch.where(adj_mat > 0, e, -9e16 * ones_like(e))``, dropout on the attention), the adjacency
  built as a sparse COO tensor and densified, heads concatenated and averaged, Adam with weight
  decay over masked node indices, accuracy by ``.eq().sum().item()``; and its dropout checked
  for what any generator gives (kept entries scaled by 1/(1-p), repeatable under one seed);
- ViT: patches by ``unfold``/``permute``/``reshape``, a cls token ``expand``-ed over the batch,
  learned position embeddings, hand-written attention (``qkv.reshape(...).permute(2, 0, 3, 1, 4)``,
  ``q @ k.transpose(-2, -1) * scale``), pre-norm blocks with GELU MLPs, AdamW with a cosine
  schedule after a linear warm-up (``SequentialLR``), label-smoothed cross entropy."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
out = {}


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, n_heads, concat=False, dropout=0.4, leaky_relu_slope=0.2):
        super().__init__()
        self.n_heads = n_heads
        self.concat = concat
        self.dropout = dropout
        if concat:
            self.out_features = out_features
            assert out_features % n_heads == 0
            self.n_hidden = out_features // n_heads
        else:
            self.n_hidden = out_features
        self.W = nn.Parameter(torch.empty(size=(in_features, self.n_hidden * n_heads)))
        self.a = nn.Parameter(torch.empty(size=(n_heads, 2 * self.n_hidden, 1)))
        self.leakyrelu = nn.LeakyReLU(leaky_relu_slope)
        self.softmax = nn.Softmax(dim=1)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.xavier_normal_(self.W)
        nn.init.xavier_normal_(self.a)

    def _get_attention_scores(self, h_transformed):
        source_scores = torch.matmul(h_transformed, self.a[:, :self.n_hidden, :])
        target_scores = torch.matmul(h_transformed, self.a[:, self.n_hidden:, :])
        e = source_scores + target_scores.mT
        return self.leakyrelu(e)

    def forward(self, h, adj_mat):
        n_nodes = h.shape[0]
        h_transformed = torch.mm(h, self.W)
        h_transformed = F.dropout(h_transformed, self.dropout, training=self.training)
        h_transformed = h_transformed.view(n_nodes, self.n_heads, self.n_hidden).permute(1, 0, 2)
        e = self._get_attention_scores(h_transformed)
        connectivity_mask = -9e16 * torch.ones_like(e)
        e = torch.where(adj_mat > 0, e, connectivity_mask)
        attention = F.softmax(e, dim=-1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = torch.matmul(attention, h_transformed)
        if self.concat:
            h_prime = h_prime.permute(1, 0, 2).contiguous().view(n_nodes, self.out_features)
        else:
            h_prime = h_prime.mean(dim=0)
        return h_prime


class GAT(nn.Module):
    def __init__(self, in_features, n_hidden, n_heads, num_classes, concat=False, dropout=0.4, leaky_relu_slope=0.2):
        super().__init__()
        self.gat1 = GraphAttentionLayer(in_features=in_features, out_features=n_hidden, n_heads=n_heads,
                                        concat=concat, dropout=dropout, leaky_relu_slope=leaky_relu_slope)
        self.gat2 = GraphAttentionLayer(in_features=n_hidden, out_features=num_classes, n_heads=1,
                                        concat=False, dropout=dropout, leaky_relu_slope=leaky_relu_slope)

    def forward(self, input_tensor, adj_mat):
        x = self.gat1(input_tensor, adj_mat)
        x = F.elu(x)
        x = self.gat2(x, adj_mat)
        return F.log_softmax(x, dim=1)


N, FEAT, CLASSES = 20, 12, 3
features = torch.rand(N, FEAT, generator=gen)
features = features / features.sum(1, keepdim=True)
node_labels = torch.randint(0, CLASSES, (N,), generator=gen)
src = torch.randint(0, N, (50,), generator=gen)
dst = torch.randint(0, N, (50,), generator=gen)
edges = torch.stack([torch.cat([src, dst, torch.arange(N)]), torch.cat([dst, src, torch.arange(N)])])
adj_mat = torch.sparse_coo_tensor(edges, torch.ones(edges.size(1)), size=(N, N)).to(device)
adj_mat = adj_mat.coalesce().to_dense()
features, node_labels = features.to(device), node_labels.to(device)
idx = torch.randperm(N, generator=gen).to(device)
idx_train, idx_val, idx_test = idx[:10], idx[10:15], idx[15:]

torch.manual_seed(1)
gat_net = GAT(in_features=FEAT, n_hidden=8, n_heads=2, num_classes=CLASSES, concat=True, dropout=0.6).to(device)
optimizer = torch.optim.Adam(gat_net.parameters(), lr=0.01, weight_decay=5e-4)
criterion = nn.NLLLoss()
gat_net.eval()  # (dropout off for training parity: a device's generator is its own)
gat_losses = []
for epoch in range(5):
    optimizer.zero_grad()
    y = gat_net(features, adj_mat)
    loss = criterion(y[idx_train], node_labels[idx_train])
    loss.backward()
    optimizer.step()
    gat_losses.append(loss.item())
with torch.no_grad():
    output = gat_net(features, adj_mat)
    val_loss = criterion(output[idx_val], node_labels[idx_val]).item()
    _, indices = torch.max(output[idx_test], dim=1)
    correct = float(torch.sum(indices == node_labels[idx_test]).item())
gat_net.train()
torch.manual_seed(7)
d1 = gat_net(features, adj_mat)
torch.manual_seed(7)
d2 = gat_net(features, adj_mat)
att_in = torch.rand(2, N, N, generator=gen).to(device)
att_drop = F.dropout(att_in, 0.6, training=True)
kept = att_drop != 0
scaled_ok = torch.allclose(att_drop[kept], att_in[kept] / 0.4)
out["gat"] = {"losses": gat_losses, "val_loss": val_loss, "correct": correct,
              "dropout_repeatable": torch.equal(d1, d2), "dropout_scaled": scaled_ok,
              "dropout_some_kept": bool(0.2 < kept.float().mean().item() < 0.6),
              "adj_nnz": int((adj_mat > 0).sum().item())}


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(x), attn


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=2.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        a, attn = self.attn(self.norm1(x))
        x = x + a
        x = x + self.mlp(self.norm2(x))
        return x, attn


class ViT(nn.Module):
    def __init__(self, image_size=16, patch_size=4, in_chans=3, num_classes=5, dim=24, depth=2, heads=3):
        super().__init__()
        self.patch_size = patch_size
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(patch_size * patch_size * in_chans, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def patchify(self, imgs):
        p = self.patch_size
        B, C, H, W = imgs.shape
        x = imgs.unfold(2, p, p).unfold(3, p, p)
        x = x.permute(0, 2, 3, 1, 4, 5).reshape(B, (H // p) * (W // p), C * p * p)
        return x

    def forward(self, imgs):
        x = self.patch_embed(self.patchify(imgs))
        cls_tokens = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        x = x + self.pos_embed
        attns = []
        for blk in self.blocks:
            x, attn = blk(x)
            attns.append(attn)
        x = self.norm(x)
        return self.head(x[:, 0]), attns


torch.manual_seed(2)
vit = ViT().to(device)
opt = torch.optim.AdamW(vit.parameters(), lr=3e-3, weight_decay=0.05, betas=(0.9, 0.999))
warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4, eta_min=1e-5)
scheduler = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[2])
criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
imgs = torch.rand(12, 3, 16, 16, generator=gen)
targets = torch.randint(0, 5, (12,), generator=gen)
vit_losses, lrs = [], []
for step in range(6):
    b = slice((step % 3) * 4, (step % 3) * 4 + 4)
    x, t = imgs[b].to(device, non_blocking=True), targets[b].to(device, non_blocking=True)
    logits, _ = vit(x)
    loss = criterion(logits, t)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(vit.parameters(), max_norm=1.0)
    opt.step()
    scheduler.step()
    vit_losses.append(loss.item())
    lrs.append(scheduler.get_last_lr()[0])
vit.eval()
with torch.inference_mode():
    logits, attns = vit(imgs.to(device))
    acc = (logits.argmax(-1) == targets.to(device)).float().mean().item()
    patches = vit.patchify(imgs[:1].to(device))
    ref = F.unfold(imgs[:1].to(device), 4, stride=4).transpose(1, 2)
out["vit"] = {"losses": vit_losses, "lrs": lrs, "acc": acc, "cls_attn": attns[-1][:, :, 0, 1:].sum().item(),
              "patchify_matches_unfold": torch.allclose(patches, ref), "logits": logits[:2].tolist()}
out["device"] = str(logits.device)
print(json.dumps(out))
