"""Training idioms at the edges of the optimizer and nn.utils APIs, on 'cuda' and on the local CPU:
each must give the same values (or, where a GPU refuses the call, the same error)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from local_parity import assert_matches_local, registry
from local_parity import data as D
from torch import nn

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()


def _lists(dev: str) -> tuple[list, list, list]:
    return ([D(3, seed=i).to(dev) for i in range(3)], [D(3, seed=10 + i).to(dev) for i in range(3)],
            [D(3, seed=20 + i).abs().add(0.5).to(dev) for i in range(3)])


@case
def foreach_addcdiv_with_packed_scalars(dev):
    """The ``Tensor scalars`` overloads (a hand-written Adam's per-parameter step sizes): a CPU
    tensor next to 'cuda' lists, which CUDA's kernels read on the host."""
    a, b, c = _lists(dev)
    s = torch.tensor([0.1, 0.2, 0.3])
    out = [*torch._foreach_addcdiv(a, b, c, s), *torch._foreach_addcmul(a, b, c, s)]
    torch._foreach_addcdiv_(a, b, c, s)
    torch._foreach_addcmul_(b, a, c, torch.tensor([1, 2, 3]))
    return [*out, *a, *b]


@case
def transformer_encoder_fast_path_pads_with_zeros(dev):
    """In eval under no_grad a left-aligned padding mask makes the encoder nest its batch, and
    the padded positions come back as zeros (then through its norm): a mean over all positions
    depends on them. A mask that is not left-aligned keeps the batch dense, on a GPU too."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8)).to(dev).eval()
    x = D(3, 5, 8).to(dev)
    pad = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool).to(dev)
    with torch.no_grad():
        out = [enc(x, src_key_padding_mask=pad).mean(1), enc(x, src_key_padding_mask=pad.float() * -1e9),
               enc(x, src_key_padding_mask=pad.flip(1))]
    out.append(enc(x, src_key_padding_mask=pad))  # with grad: no fast path
    return out


@case
def torch_func_transforms_through_an_lstm(dev):
    """jacrev/grad of an LSTM's output by its input (saliency, input-gradient penalties): the
    transforms' wrappers reached the one-op RNN path, which named them on another device."""
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, batch_first=True).to(dev)
    gru = nn.GRU(3, 4, num_layers=2).to(dev)
    x = D(1, 4, 3).to(dev)
    return [torch.func.jacrev(lambda t: lstm(t)[0].sum(-1))(x), torch.func.grad(lambda t: gru(t)[0].pow(2).sum())(x)]


@case
def forward_mode_ad_through_a_gru(dev):
    """A dual input (torch.autograd.forward_ad): the one-op RNN path dropped its tangent."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    gru = nn.GRU(3, 4).to(dev)
    x = D(4, 1, 3).to(dev)
    with fwAD.dual_level():
        out, _ = gru(fwAD.make_dual(x, torch.ones_like(x)))
        primal, tangent = fwAD.unpack_dual(out)
    return [primal, tangent]


@case
def forward_mode_ad_with_python_numbers(dev):
    """``dual * 2``, ``dual + 1``, ``dual / 3`` (forward-mode PINN derivatives: jvp, jacfwd):
    the Python number's zero tangent, moved to 'meta' by C++ for a shape check, became a remote
    tensor and torch's assertion on wrapped numbers failed, on CPU tensors too while active."""
    import torch.autograd.forward_ad as fwAD
    from torch.autograd.functional import jacobian
    from torch.func import jacfwd, jvp
    x = D(5).to(dev)
    with fwAD.dual_level():
        dx = fwAD.make_dual(x, torch.ones_like(x))
        primal, tangent = fwAD.unpack_dual((dx * 2 + 1) / 3 - 0.5 * dx ** 2)

    def u(t):
        return (2 * t.sin() + 1) / 3 - t ** 2 * 0.5
    _, j = jvp(u, (x,), (torch.ones_like(x),))
    fm = [jacobian(lambda t: t[0] * 2 + t.sum() / 3, x.to(dt), vectorize=True, strategy="forward-mode")
          for dt in (torch.float32, torch.float64)]
    zero_dim = []  # (0-dim results in a Python number's dtypes: their zero tangents too)
    for dt in (torch.float64, torch.complex128):
        with fwAD.dual_level():
            d = fwAD.make_dual(torch.tensor(0.7, device=dev, dtype=dt), torch.tensor(1.0, device=dev, dtype=dt))
            zero_dim += [torch.view_as_real(t) if t.is_complex() else t for t in fwAD.unpack_dual(d * 2.5 - d / 4 + 3)]
    return [primal, tangent, j, jacfwd(u)(x), *fm, *zero_dim]


@case
def ctc_loss_under_torch_func_grad(dev):
    """torch.func.grad of a CTC loss by its log-probabilities, lengths as CPU (and 'cuda')
    tensors: the transform's wrapper met the CPU lengths as tensors of another device."""
    lp = D(8, 2, 5).to(dev)
    targets = torch.tensor([[1, 2, 3], [2, 2, 0]]).to(dev)
    il, tl = torch.tensor([8, 6]), torch.tensor([3, 2])
    def loss(t, reduction, zero_infinity):
        return F.ctc_loss(t.log_softmax(2), targets, il, tl, reduction=reduction, zero_infinity=zero_infinity).sum()
    out = [torch.func.grad(loss)(lp, r, z) for r in ("mean", "sum", "none") for z in (False, True)]
    out.append(torch.func.grad(lambda t: F.ctc_loss(t.log_softmax(2), targets, il.to(dev), tl.to(dev)))(lp))
    return out


@case
def capturable_optimizers_match_the_cpu_ones(dev):
    """capturable=True (CUDA graphs' optimizers: steps kept on the device) is refused on the CPU,
    so the local run is the plain optimizer: same values."""
    out = []
    for make in (lambda ps, c: torch.optim.Adam(ps, lr=1e-2, capturable=c, foreach=True),
                 lambda ps, c: torch.optim.NAdam(ps, lr=1e-2, capturable=c),
                 lambda ps, c: torch.optim.ASGD(ps, lr=1e-2, capturable=c, t0=1),
                 lambda ps, c: torch.optim.Rprop(ps, lr=1e-2, capturable=c, foreach=False)):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).to(dev)
        opt = make(m.parameters(), dev == "cuda")
        x, y = D(10, 6).to(dev), D(10, 2, seed=1).to(dev)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
        out += list(m.parameters())
    return out


@case
def checkpoint_sequential_with_dropout(dev):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 16), nn.Dropout(0.5),
                      nn.Linear(16, 2)).to(dev)
    x = D(8, 6).to(dev).requires_grad_()
    torch.manual_seed(1)
    y = torch.utils.checkpoint.checkpoint_sequential(m, 3, x, use_reentrant=False)
    y.sum().backward()
    return [y, x.grad, *(p.grad for p in m.parameters())]


@case
def ensemble_of_stacked_modules_trained_under_vmap(dev):
    import copy

    from torch.func import functional_call, stack_module_state
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1)).to(dev) for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    opt = torch.optim.AdamW(params.values(), lr=0.01)
    x, y = D(3, 6, 4).to(dev), D(3, 6, 1, seed=1).to(dev)
    for _ in range(2):
        opt.zero_grad()
        out = torch.vmap(lambda p, b, t: functional_call(base, (p, b), (t,)))(params, buffers, x)
        F.mse_loss(out, y).backward()
        opt.step()
    return list(params.values())


@case
def embedding_bag_with_sparse_gradients(dev):
    """nn.EmbeddingBag(sparse=True) (a recommender's tables, with SparseAdam): its backward kernel
    ran on the gateway, which returns no sparse tensor, and refused."""
    out = []
    for mode, kw in (("sum", {"padding_idx": 3}), ("mean", {}), ("sum", {"include_last_offset": True})):
        torch.manual_seed(0)
        bag = nn.EmbeddingBag(20, 4, mode=mode, sparse=True, **kw).to(dev)
        opt = torch.optim.SparseAdam(list(bag.parameters()), lr=0.05)
        idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 19]).to(dev)
        offsets = torch.tensor([0, 3, 8] if kw.get("include_last_offset") else [0, 3, 5]).to(dev)
        weights = D(8).to(dev) if mode == "sum" and not kw else None
        for _ in range(2):
            opt.zero_grad()
            bag(idx, offsets, per_sample_weights=weights).pow(2).sum().backward()
            opt.step()
        grad = bag.weight.grad.coalesce()
        out += [bag.weight, grad.indices(), grad.values()]
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, 3, mode="mean", sparse=True).to(dev)
    bag(torch.tensor([[1, 2], [2, 9]]).to(dev)).sum().backward()
    return [*out, bag.weight.grad.to_dense()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_program_matches_local(name):
    assert_matches_local(CASES[name])


def test_packed_scalars_on_cuda_are_refused_as_a_gpu_refuses_them():
    a, b, c = _lists("cuda")
    with pytest.raises(RuntimeError, match=r"Expected scalars to be on CPU, got cuda:0 instead\."):
        torch._foreach_addcdiv(a, b, c, torch.tensor([0.1, 0.2, 0.3], device="cuda"))
    with pytest.raises(RuntimeError, match="Expected length of scalars to match input of length 3 but got 2"):
        torch._foreach_addcmul_(a, b, c, torch.tensor([0.1, 0.2]))
