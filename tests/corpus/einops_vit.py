"""lucidrains' vit-pytorch and x-transformers idioms with einops itself, on 'cuda': a ViT whose
patch embedding is ``Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)')`` in an nn.Sequential,
a CLS token by ``repeat(self.cls_token, '1 1 d -> b 1 d')`` and ``pack``/``unpack``, attention
by ``rearrange(..., 'b n (h d) -> b h n d')`` and ``einops.einsum``, 2-D sincos positions by
``torch.meshgrid(indexing='ij')``, mean pooling by ``reduce``/``Reduce``, an ``EinMix`` token
mixer (MLP-Mixer), ``parse_shape``; then MAE's random masking (``torch.rand(...).argsort``,
``tokens[batch_range, unmasked_indices]``) and its pixel loss, each trained a few AdamW steps."""
import json

import torch
import torch.nn.functional as F
from einops import einsum, pack, parse_shape, rearrange, reduce, repeat, unpack
from einops.layers.torch import EinMix, Rearrange, Reduce
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def pair(t):
    return t if isinstance(t, tuple) else (t, t)


def posemb_sincos_2d(h, w, dim, temperature=10000, dtype=torch.float32):
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    omega = torch.arange(dim // 4) / (dim // 4 - 1)
    omega = 1.0 / (temperature ** omega)
    y = y.flatten()[:, None] * omega[None, :]
    x = x.flatten()[:, None] * omega[None, :]
    pe = torch.cat((x.sin(), x.cos(), y.sin(), y.cos()), dim=1)
    return pe.type(dtype)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.norm = nn.LayerNorm(dim)
        self.attend = nn.Softmax(dim=-1)
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x):
        x = self.norm(x)
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: rearrange(t, "b n (h d) -> b h n d", h=self.heads), qkv)
        dots = einsum(q, k, "b h i d, b h j d -> b h i j") * self.scale
        attn = self.attend(dots)
        out = torch.matmul(attn, v)
        out = rearrange(out, "b h n d -> b n (h d)")
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim, depth, heads, dim_head, mlp_dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([Attention(dim, heads=heads, dim_head=dim_head),
                                              FeedForward(dim, mlp_dim)]))

    def forward(self, x):
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.norm(x)


class ViT(nn.Module):
    def __init__(self, *, image_size, patch_size, num_classes, dim, depth, heads, mlp_dim, channels=3, dim_head=8,
                 pool="cls"):
        super().__init__()
        image_height, image_width = pair(image_size)
        patch_height, patch_width = pair(patch_size)
        patch_dim = channels * patch_height * patch_width
        self.to_patch_embedding = nn.Sequential(
            Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch_height, p2=patch_width),
            nn.LayerNorm(patch_dim), nn.Linear(patch_dim, dim), nn.LayerNorm(dim))
        self.register_buffer("pos_embedding", posemb_sincos_2d(image_height // patch_height,
                                                               image_width // patch_width, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.transformer = Transformer(dim, depth, heads, dim_head, mlp_dim)
        self.pool = pool
        self.mlp_head = nn.Linear(dim, num_classes)

    def forward(self, img):
        x = self.to_patch_embedding(img)
        x = x + self.pos_embedding.to(x.device, dtype=x.dtype)
        b = x.shape[0]
        cls_tokens = repeat(self.cls_token, "1 1 d -> b 1 d", b=b)
        x, ps = pack([cls_tokens, x], "b * d")
        x = self.transformer(x)
        cls, x = unpack(x, ps, "b * d")
        x = reduce(x, "b n d -> b d", "mean") if self.pool == "mean" else rearrange(cls, "b 1 d -> b d")
        return self.mlp_head(x)


def mixer(image_size, channels, patch_size, dim, depth, num_classes):
    num_patches = (image_size // patch_size) ** 2
    layers = [Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch_size, p2=patch_size),
              nn.Linear((patch_size ** 2) * channels, dim)]
    for _ in range(depth):
        layers += [nn.LayerNorm(dim),
                   EinMix("b n d -> b n2 d", weight_shape="n n2", bias_shape="n2", n=num_patches, n2=num_patches),
                   nn.LayerNorm(dim),
                   EinMix("b n d -> b n d2", weight_shape="d d2", bias_shape="d2", d=dim, d2=dim * 2), nn.GELU(),
                   EinMix("b n d2 -> b n d", weight_shape="d2 d", d=dim, d2=dim * 2)]
    layers += [nn.LayerNorm(dim), Reduce("b n c -> b c", "mean"), nn.Linear(dim, num_classes)]
    return nn.Sequential(*layers)


g = torch.Generator().manual_seed(1)
imgs = torch.randn(4, 3, 16, 16, generator=g).to(device)
labels = torch.randint(0, 5, (4,), generator=g).to(device)
out = {"shape": parse_shape(imgs, "b c h w"), "device": str(imgs.device)}
for name, make in [("vit_cls", lambda: ViT(image_size=16, patch_size=4, num_classes=5, dim=16, depth=2, heads=2,
                                            mlp_dim=32)),
                   ("vit_mean", lambda: ViT(image_size=16, patch_size=8, num_classes=5, dim=16, depth=1, heads=2,
                                             mlp_dim=32, pool="mean")),
                   ("mixer", lambda: mixer(16, 3, 4, 16, 2, 5))]:
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(imgs), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out[name] = {"losses": losses, "pred": model(imgs).argmax(-1).tolist()}


class MAE(nn.Module):
    def __init__(self, encoder, decoder_dim, masking_ratio=0.75, decoder_depth=1):
        super().__init__()
        self.masking_ratio = masking_ratio
        self.encoder = encoder
        num_patches, encoder_dim = encoder.pos_embedding.shape
        self.to_patch = encoder.to_patch_embedding[0]
        self.patch_to_emb = nn.Sequential(*encoder.to_patch_embedding[1:])
        pixel_values_per_patch = encoder.to_patch_embedding[2].weight.shape[-1]
        self.enc_to_dec = nn.Linear(encoder_dim, decoder_dim) if encoder_dim != decoder_dim else nn.Identity()
        self.mask_token = nn.Parameter(torch.randn(decoder_dim))
        self.decoder = Transformer(decoder_dim, decoder_depth, 2, 8, decoder_dim * 2)
        self.decoder_pos_emb = nn.Embedding(num_patches, decoder_dim)
        self.to_pixels = nn.Linear(decoder_dim, pixel_values_per_patch)

    def forward(self, img):
        device = img.device
        patches = self.to_patch(img)
        batch, num_patches, *_ = patches.shape
        tokens = self.patch_to_emb(patches)
        tokens = tokens + self.encoder.pos_embedding.to(device, dtype=tokens.dtype)
        num_masked = int(self.masking_ratio * num_patches)
        rand_indices = torch.rand(batch, num_patches, device=device).argsort(dim=-1)
        masked_indices, unmasked_indices = rand_indices[:, :num_masked], rand_indices[:, num_masked:]
        batch_range = torch.arange(batch, device=device)[:, None]
        tokens = tokens[batch_range, unmasked_indices]
        masked_patches = patches[batch_range, masked_indices]
        encoded_tokens = self.encoder.transformer(tokens)
        decoder_tokens = self.enc_to_dec(encoded_tokens)
        unmasked_decoder_tokens = decoder_tokens + self.decoder_pos_emb(unmasked_indices)
        mask_tokens = repeat(self.mask_token, "d -> b n d", b=batch, n=num_masked)
        mask_tokens = mask_tokens + self.decoder_pos_emb(masked_indices)
        decoder_tokens = torch.zeros(batch, num_patches, unmasked_decoder_tokens.shape[-1], device=device)
        decoder_tokens[batch_range, unmasked_indices] = unmasked_decoder_tokens
        decoder_tokens[batch_range, masked_indices] = mask_tokens
        decoded_tokens = self.decoder(decoder_tokens)
        mask_tokens = decoded_tokens[batch_range, masked_indices]
        pred_pixel_values = self.to_pixels(mask_tokens)
        return F.mse_loss(pred_pixel_values, masked_patches)


torch.manual_seed(0)
encoder = ViT(image_size=16, patch_size=4, num_classes=5, dim=16, depth=1, heads=2, mlp_dim=32)
mae = MAE(encoder, decoder_dim=8).to(device)
opt = torch.optim.AdamW(mae.parameters(), lr=1e-3)
losses = []
for step in range(3):
    torch.manual_seed(10 + step)  # (the mask's draw: from the device's generator, seeded here on both runs)
    loss = mae(imgs)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
out["mae"] = {"losses": losses, "mask_token_grad": mae.mask_token.grad.abs().sum().item()}
print(json.dumps(out))
