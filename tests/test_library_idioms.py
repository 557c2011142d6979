"""torch's own libraries on 'cuda', unchanged: torch.func transforms, distributions,
parametrizations, the Transformer and MultiheadAttention fast paths, SWA/EMA, schedulers,
linalg, complex einsum and friends. Each case runs on the local CPU and through the gateway,
in one process, and must give the same values."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

CASES: dict[str, Callable[[str], torch.Tensor | float]] = {}
W = torch.randn(5, 3, generator=torch.Generator().manual_seed(100))
X = torch.randn(4, 5, generator=torch.Generator().manual_seed(101))


def case(fn: Callable[[str], torch.Tensor | float]) -> Callable:
    CASES[fn.__name__] = fn
    return fn


def _seeded(shape: tuple, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _steps(m: nn.Module, opt: torch.optim.Optimizer, dev: str, n: int, after: Callable = lambda: None) -> None:
    for _ in range(n):
        opt.zero_grad()
        m(X.to(dev)).pow(2).mean().backward()
        opt.step()
        after()


@case
def vmap(dev):
    w = W.to(dev)
    return torch.func.vmap(lambda r: r @ w)(X.to(dev))


@case
def func_grad(dev):
    x = X.to(dev)
    return torch.func.grad(lambda w: (x @ w).pow(2).sum())(W.to(dev))


@case
def jacrev(dev):
    return torch.func.jacrev(torch.sin)(X[0].to(dev))


@case
def functional_call(dev):
    m = nn.Linear(5, 3).to(dev)
    params = {k: v.detach() * 2 for k, v in m.named_parameters()}
    return torch.func.functional_call(m, params, (X.to(dev),))


@case
def normal_log_prob(dev):
    d = torch.distributions.Normal(torch.zeros(3, device=dev), torch.ones(3, device=dev))
    return d.log_prob(torch.tensor([0.5, 1.0, -1.0], device=dev))


@case
def categorical_entropy(dev):
    return torch.distributions.Categorical(logits=X.to(dev)).entropy()


@case
def weight_norm(dev):
    m = nn.utils.parametrizations.weight_norm(nn.Linear(5, 3)).to(dev)
    m(X.to(dev)).sum().backward()
    return m.parametrizations.weight.original1.grad


@case
def spectral_norm(dev):
    m = nn.utils.parametrizations.spectral_norm(nn.Linear(5, 3)).to(dev).eval()
    return m(X.to(dev))


@case
def linalg(dev):
    a = _seeded((4, 4), 3).to(dev)
    a = a @ a.T + torch.eye(4, device=dev)
    return torch.stack([torch.linalg.cholesky(a), torch.linalg.inv(a), torch.linalg.eigh(a)[1].abs()])


@case
def einsum_complex(dev):
    c = torch.complex(X, X.flip(0)).to(dev)
    return torch.view_as_real(torch.einsum("ij,kj->ik", c, c.conj()))


@case
def pad_sequence(dev):
    seqs = [torch.arange(n, dtype=torch.float32, device=dev) for n in (3, 1, 4)]
    return nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=-1)


@case
def bucketize_searchsorted(dev):
    b = torch.tensor([0., 1., 2.], device=dev)
    x = X.to(dev)
    return torch.bucketize(x, b).float() + torch.searchsorted(b, x.sort().values.contiguous()).float()


@case
def scatter_reduce(dev):
    idx = torch.tensor([0, 1, 0, 1, 2], device=dev)
    return torch.zeros(3, device=dev).scatter_reduce(0, idx, X[0].to(dev), reduce="amax", include_self=False)


@case
def sdpa_bool_mask(dev):
    q = _seeded((2, 4, 6, 8), 4).to(dev)
    mask = torch.ones(6, 6, dtype=torch.bool, device=dev).tril()
    return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@case
def cdist_topk(dev):
    x = X.to(dev)
    return torch.cdist(x, x).topk(2, dim=1).values


@case
def autocast_bf16_clip_grad_value(dev):
    m = nn.Linear(5, 3).to(dev)
    with torch.autocast(device_type=dev, dtype=torch.bfloat16):
        y = m(X.to(dev))
    y.float().sum().backward()
    nn.utils.clip_grad_value_(m.parameters(), 0.1)
    return m.weight.grad


@case
def swa_ema(dev):
    m = nn.Linear(5, 3).to(dev)
    ema = torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    _steps(m, torch.optim.AdamW(m.parameters(), lr=0.1), dev, 3, lambda: ema.update_parameters(m))
    return ema.module.weight


@case
def one_cycle_nesterov(dev):
    m = nn.Linear(5, 3).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=5)
    _steps(m, opt, dev, 4, sched.step)
    return m.weight


@case
def masked_and_list_index_assignment(dev):
    x = X.to(dev)
    x[x > 0] = 0
    x[:, [0, 2]] += 1
    return x


@case
def multinomial_shape(dev):
    return float(torch.multinomial(torch.softmax(X.to(dev), -1), 3, replacement=True).shape[0])


@case
def embedding_bag(dev):
    e = nn.EmbeddingBag(10, 3, mode="mean").to(dev)
    return e(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9], device=dev), torch.tensor([0, 4], device=dev))


@case
def transformer_encoder_padding_mask(dev):
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(dev).eval()
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2], device=dev)
    with torch.no_grad():
        return enc(_seeded((2, 5, 8), 11).to(dev), src_key_padding_mask=mask)


@case
def multihead_attention_fast_path(dev):
    """Inference without weights takes _native_multi_head_attention, whose CPU and CUDA kernels
    return an undefined weights tensor where its meta kernel gives an empty one."""
    mha = nn.MultiheadAttention(8, 2, batch_first=True).to(dev).eval()
    x = _seeded((2, 5, 8), 11).to(dev)
    with torch.inference_mode():
        return mha(x, x, x, need_weights=False)[0]


@case
def conv_batchnorm_channels_last(dev):
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).to(dev)
    m = m.to(memory_format=torch.channels_last)
    x = _seeded((2, 3, 8, 8), 1).to(dev).to(memory_format=torch.channels_last)
    m(x).sum().backward()
    return m[0].weight.grad


@case
def gradient_penalty_double_backward(dev):
    critic = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).to(dev)
    x = X.clone().to(dev).requires_grad_()
    (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
    ((g.norm(2, dim=1) - 1) ** 2).mean().backward()
    return critic[0].weight.grad


@case
def hooks_and_retain_grad(dev):
    x = X.clone().to(dev).requires_grad_()
    y = x * 2
    y.retain_grad()
    x.register_hook(lambda g: g * 3)
    (y ** 2).sum().backward(retain_graph=True)
    (y ** 2).sum().backward()
    return torch.cat([x.grad.flatten(), y.grad.flatten()])


@case
def interpolate_and_grid_sample(dev):
    img = _seeded((1, 2, 5, 5), 2).to(dev)
    up = nn.functional.interpolate(img, scale_factor=2, mode="bilinear", align_corners=False)
    theta = torch.tensor([[[0.9, 0.1, 0.0], [-0.1, 0.9, 0.0]]], device=dev)
    grid = nn.functional.affine_grid(theta, [1, 2, 4, 4], align_corners=False)
    return torch.cat([up.flatten(), nn.functional.grid_sample(img, grid, align_corners=False).flatten()])


@case
def stft_and_rfft(dev):
    s = _seeded((256,), 4).to(dev)
    spec = torch.stft(s, 64, window=torch.hann_window(64, device=dev), return_complex=True)
    return torch.cat([spec.abs().flatten(), torch.fft.rfft(s).abs()])


def _ctc(dev, reduction="mean", lengths_on=None):
    """CTC with lengths as CPU tensors (F.ctc_loss's usual call; CUDA reads them on the CPU)."""
    log_probs = _seeded((12, 2, 5), 5).log_softmax(2).to(dev).requires_grad_()
    targets = torch.randint(1, 5, (2, 4), generator=torch.Generator().manual_seed(6)).to(dev)
    lengths = (torch.full((2,), 12, dtype=torch.long), torch.tensor([4, 3]))
    if lengths_on is not None:
        lengths = tuple(t.to(lengths_on) for t in lengths)
    loss = nn.functional.ctc_loss(log_probs, targets, *lengths, reduction=reduction)
    loss.backward()
    return torch.cat([loss.reshape(1), log_probs.grad.flatten()])


@case
def ctc_loss_cpu_lengths(dev):
    return _ctc(dev)


@case
def ctc_loss_sum_lengths_on_device(dev):
    return _ctc(dev, "sum", lengths_on=dev)


@case
def data_dependent_ops(dev):
    t = torch.tensor([3, 1, 3, 0, 2, 3], device=dev)
    values, counts = torch.unique(t, return_counts=True)
    return torch.cat([values, counts, torch.bincount(t), torch.where(t > 1)[0], nn.functional.one_hot(t).sum(0),
                      torch.histc(t.float(), bins=4, min=0, max=3).long()]).float()


@case
def embedding_max_norm_renorms_in_forward(dev):
    e = nn.Embedding(10, 4, max_norm=1.0).to(dev)
    y = e(torch.tensor([1, 2, 1], device=dev))
    return torch.cat([y.flatten(), e.weight.norm(dim=1)])


@case
def index_add_masked_scatter_put_take(dev):
    t = torch.zeros(5, 3, device=dev)
    t.index_add_(0, torch.tensor([0, 2, 0], device=dev), X[:3, :3].to(dev))
    mask = torch.zeros(5, 3, dtype=torch.bool, device=dev)
    mask[1] = True
    t.masked_scatter_(mask, torch.arange(3.0, device=dev))
    t.put_(torch.tensor([14], device=dev), torch.tensor([9.0], device=dev))
    return torch.cat([t.flatten(), t.take(torch.tensor([0, 14], device=dev))])


@case
def lstm_cell_unrolled(dev):
    cell = nn.LSTMCell(5, 3).to(dev)
    h = c = torch.zeros(4, 3, device=dev)
    for _ in range(3):
        h, c = cell(X.to(dev), (h, c))
    h.sum().backward()
    return torch.cat([h.flatten(), cell.weight_ih.grad.flatten()])


@case
def cross_entropy_ignore_index_label_smoothing(dev):
    logits = X.clone().to(dev).requires_grad_()
    loss = nn.functional.cross_entropy(logits, torch.tensor([1, -100, 4, 0], device=dev), ignore_index=-100,
                                       label_smoothing=0.1)
    loss.backward()
    return torch.cat([loss.reshape(1), logits.grad.flatten()])


@case
def per_sample_grads_expanded_weights(dev):
    # Opacus' grad_sample_mode="ew": each parameter becomes an ExpandedWeight of itself
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.Flatten(), nn.Linear(12, 4), nn.LayerNorm(4)).to(dev)
    x = _seeded((5, 2, 4, 4), 102).to(dev)
    call_for_per_sample_grads(m)(x).pow(2).sum().backward()
    return torch.cat([p.grad_sample.flatten() for p in m.parameters()])


def _value(fn: Callable, dev: str) -> torch.Tensor:
    torch.manual_seed(0)
    r = fn(dev)
    return r.detach().cpu().double() if isinstance(r, torch.Tensor) else torch.tensor(r, dtype=torch.float64)


@pytest.mark.parametrize("name", sorted(CASES))
def test_library_idiom_matches_local(remote, name):
    fn = CASES[name]
    torch.testing.assert_close(_value(fn, "cuda"), _value(fn, "cpu"), rtol=1e-4, atol=1e-5)


def test_per_sample_grads_of_an_lstm(remote):
    """ExpandedWeight decomposes ``_VF.lstm`` by its ``__torch_function__`` (as on a GPU), not
    through the one-op cuDNN route, which refused its weights as on another device. (The local
    CPU path cannot: its decomposition meets mkldnn; the reference is one backward per sample.)"""
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    m = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
    x = _seeded((5, 2, 3), 103)
    want: dict[str, list[torch.Tensor]] = {}
    for i in range(2):
        m.zero_grad()
        m(x[:, i:i + 1])[0].sum().backward()
        for k, p in m.named_parameters():
            want.setdefault(k, []).append(p.grad.clone())
    m.zero_grad()
    m.cuda()
    call_for_per_sample_grads(m, batch_size=2)(x.cuda())[0].sum().backward()
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad_sample.cpu(), torch.stack(want[k]), rtol=1e-4, atol=1e-5)
