"""Each trap of DESIGN.md ("Traps found in a prototype") handled, against a real gateway.

The reference for every value is the same computation in local PyTorch on the CPU.
"""
from __future__ import annotations

import copy
import inspect
import io
import math
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import interception_removed

pytestmark = pytest.mark.usefixtures("remote")


def cpu_copy(t):
    return t.detach().cpu().clone()


# ---------------------------------------------------------------- silently wrong unless handled

def test_optimizer_built_before_cuda_trains_the_cuda_parameters():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    p_before = model.weight
    model.cuda()
    assert model.weight is p_before and model.weight.is_cuda
    assert opt.param_groups[0]["params"][0] is model.weight
    w0 = cpu_copy(model.weight)
    loss = model(torch.ones(3, 4, device="cuda")).pow(2).sum()
    loss.backward()
    opt.step()
    assert not torch.equal(cpu_copy(model.weight), w0), "the optimizer must update the cuda parameters"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_channels_last_convolutions_keep_one_layout_on_both_sides(dtype):
    """A convolution's output layout is its backend's choice, unknown to meta kernels: the client
    and the gateway follow one rule (cuDNN's), so views of the output run on the same strides
    there as here (``y.view(-1)`` of a channels-last output failed on the gateway)."""
    torch.manual_seed(0)
    convs = [nn.Conv2d(4, 4, 3, groups=4, padding=1), nn.Conv2d(4, 4, 3, padding=1),
             nn.ConvTranspose2d(4, 2, 2, stride=2), nn.Conv2d(4, 3, 1)]
    x = torch.randn(2, 4, 6, 6, dtype=dtype).to(memory_format=torch.channels_last)
    for conv in convs:
        conv = conv.to(dtype)
        local = conv(x.requires_grad_())
        local.sum().backward()
        remote_conv = copy.deepcopy(conv).cuda()
        rx = x.detach().cuda().requires_grad_()
        y = remote_conv(rx)
        y.sum().backward()
        want = torch.channels_last if dtype == torch.float32 else torch.contiguous_format
        assert y.is_contiguous(memory_format=want), (conv, y.stride())
        flat = y.view(-1) if y.is_contiguous() else y.permute(0, 2, 3, 1).reshape(-1)
        ref = local.reshape(-1) if y.is_contiguous() else local.permute(0, 2, 3, 1).reshape(-1)
        assert torch.allclose(flat.cpu(), ref.detach(), atol=1e-6)
        # the gateway's storage holds the values in the order the client's strides say
        in_order = local.detach().contiguous(memory_format=want)
        assert torch.allclose(y.as_strided((8,), (1,)).cpu(), in_order.as_strided((8,), (1,)), atol=1e-6)
        assert torch.allclose(rx.grad.cpu(), x.grad, atol=1e-6)
        assert torch.allclose(remote_conv.weight.grad.cpu(), conv.weight.grad, atol=1e-6)
        x.grad = None
        conv.zero_grad()


def test_csr_and_nested_tensors_say_plainly_they_do_not_cross():
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1], [2, 0]]), torch.tensor([3.0, 4.0]), (2, 3))
    for t, words in [(coo.to_sparse_csr(), "sparse_csr tensors"),
                     (torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)]), "nested tensors")]:
        with pytest.raises(NotImplementedError, match=words):
            t.cuda()
    assert torch.equal(coo.to_dense().cuda().cpu(), coo.to_dense())  # the advice works, the session goes on


def test_sparse_tensors_other_than_coo_made_on_cuda_say_plainly_they_cannot_be():
    """A sparse CSR tensor made on 'cuda' (by a constructor or by to_sparse_csr) was a wrapper
    that said strided, or C++'s 'not linked with support for cuda devices' (COO ones are
    supported: tests/test_sparse.py)."""
    i, v = torch.tensor([[0, 1, 2], [1, 2, 0]]), torch.tensor([1.0, 2.0, 3.0])
    for make in [lambda: torch.eye(3, device="cuda").to_sparse_csr(),
                 lambda: torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 3]), i[1], v, device="cuda")]:
        with pytest.raises(NotImplementedError, match="remotecuda: sparse_csr tensors cannot be made on"):
            make()


def test_half_changes_the_gateway_tensor_too():
    m = nn.Linear(3, 2).cuda()
    ref = cpu_copy(m.weight).half()
    m.half()
    assert m.weight.dtype == torch.float16
    assert m.weight.cpu().dtype == torch.float16 and torch.equal(m.weight.cpu(), ref)
    out = m(torch.ones(1, 3, device="cuda", dtype=torch.float16))
    assert out.dtype == torch.float16 and out.cpu().dtype == torch.float16


def test_assigning_p_data_is_seen_by_the_gateway():
    m = nn.Linear(3, 2, bias=False).cuda()
    m.weight.data = torch.full((2, 3), 2.0, device="cuda")
    assert m(torch.ones(1, 3, device="cuda")).cpu().tolist() == [[6.0, 6.0]]
    m.weight.data = torch.ones(2, 3)  # a CPU value assigned to a cuda parameter
    assert m.weight.is_cuda
    assert m(torch.ones(1, 3, device="cuda")).cpu().tolist() == [[3.0, 3.0]]
    cpu_param = nn.Parameter(torch.zeros(2))
    cpu_param.data = cpu_param.data.cuda()  # the old idiom for moving a parameter
    assert cpu_param.is_cuda and isinstance(cpu_param, nn.Parameter)


def test_deepcopy_does_not_share_the_gateway_tensor():
    x = torch.zeros(3, device="cuda", requires_grad=True)
    y = copy.deepcopy(x)
    with torch.no_grad():
        y.add_(5)
    assert x.cpu().tolist() == [0, 0, 0] and y.cpu().tolist() == [5, 5, 5]
    assert y.requires_grad and y.is_leaf
    m = nn.Sequential(nn.Linear(2, 2)).cuda()
    m2 = copy.deepcopy(m)
    with torch.no_grad():
        m2[0].weight.zero_()
    assert m[0].weight.abs().sum().item() > 0
    assert isinstance(m2[0].weight, nn.Parameter)


def test_list_index_reads_the_right_rows():
    ref = torch.arange(20.).reshape(5, 4)
    x = ref.cuda()
    assert torch.equal(x[[1, 3]].cpu(), ref[[1, 3]])
    assert torch.equal(x[:, [0, 2]].cpu(), ref[:, [0, 2]])
    x[[0, 4]] = 0.0
    ref[[0, 4]] = 0.0
    assert torch.equal(x.cpu(), ref)


def test_every_sequence_in_an_index_reads_and_writes_as_on_the_cpu():
    """A range, a NumPy array, a tuple or an empty list in an index becomes an index tensor in C++
    (a meta one, for a cuda tensor): x[range(n), y] = v is the forward-forward tutorial's labelling."""
    np = pytest.importorskip("numpy")

    def index(x, y):
        out = [x[range(5), y], x[:, range(1, 3)], x[np.array([0, 2])], x[np.array([0, 2]), np.int64(1)],
               x[[]], x[[True, False, True, False, True]], x[(0, 1), ]]
        x = x.clone()
        x[range(x.shape[0]), y] = x.max()
        x[range(2), [1, 2]] = torch.tensor([5.0, 6.0])
        x[np.array([3])] = 0.0
        return [*out, x]

    ref = torch.arange(20.).reshape(5, 4)
    y = torch.tensor([1, 3, 2, 0, 3])
    for got, want in zip(index(ref.cuda(), y.cuda()), index(ref, y), strict=True):
        assert torch.equal(got.cpu(), want)


def test_torch_tensor_of_a_list_of_zero_dim_tensors():
    """torch.tensor([R]) with R a 0-d tensor (actor-critic's ``torch.tensor([R])`` of a return)
    failed for CPU tensors too once indexing was routed on torch.Tensor: C++ then took every
    tensor for a sequence. A GPU reads cuda tensors in such a list as well."""
    returns = torch.tensor([1.5, -0.5])
    assert torch.equal(torch.tensor([returns[0]]), torch.tensor([1.5]))
    assert torch.equal(torch.as_tensor([[returns[1], 2.0]]), torch.tensor([[-0.5, 2.0]]))
    losses = torch.tensor([0.25, 4.0], device="cuda")
    got = torch.tensor([losses[0], 3.0, losses[1]])
    assert not got.is_cuda and torch.equal(got, torch.tensor([0.25, 3.0, 4.0]))
    on_gpu = torch.tensor([losses[1], losses[0]], device="cuda")
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), torch.tensor([4.0, 0.25]))
    with pytest.raises(ValueError, match="only one element tensors"):
        torch.tensor([losses, losses])



def test_torch_tensor_of_a_cuda_tensor_onto_cuda_is_a_copy():
    """``torch.tensor(t, device='cuda')`` of a 'cuda' tensor is a new leaf without gradient, as
    torch makes it; it was ``t`` itself (a write to it wrote to ``t``, its ``requires_grad`` was
    ``t``'s): the route compared torch's function with ``torch.tensor``, which is the route itself
    while active. ``torch.as_tensor`` of it is ``t``, as torch gives it."""
    def run(device):
        t = torch.ones(3, device=device, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch's advice to clone: test_warnings_parity.py)
            u = torch.tensor(t, device=device)
        with torch.no_grad():
            u[0] = 5.0
        return u is t, u.requires_grad, t.tolist(), torch.as_tensor(t, device=device) is t
    assert run("cuda") == run("cpu") == (False, False, [1.0, 1.0, 1.0], True)

def test_new_tensor_is_a_cuda_tensor_with_the_values():
    x = torch.ones(2, device="cuda", dtype=torch.float64)
    y = x.new_tensor([1.5, 2.5])
    assert y.is_cuda and y.dtype == torch.float64 and y.cpu().tolist() == [1.5, 2.5]


def test_legacy_new_with_data_keeps_the_values_on_cuda():
    """x.new([1.5, 2.5]) gave a plain meta tensor (its values lost); x.new(2, device='cuda') raised."""
    x = torch.ones(2, device="cuda", dtype=torch.float64)
    for got, want in [(x.new([1.5, 2.5]), [1.5, 2.5]), (x.new([[1, 2]]), [[1.0, 2.0]]), (x.new([]), []),
                      (x.new([3.0], device="cuda"), [3.0])]:
        assert got.is_cuda and got.dtype == torch.float64 and got.cpu().tolist() == want
    assert x.new(2, 3).is_cuda and x.new(2, 3).shape == (2, 3) and x.new().shape == (0,)
    assert x.new(4, device="cuda").shape == (4,)


def test_sending_a_cuda_tensor_to_another_process_says_it_cannot_be_shared():
    """Hogwild (mnist_hogwild with --cuda and spawn) shares a model's CUDA weights by CUDA IPC; the
    spawned child's arguments failed with 'bad value(s) in fds_to_keep', and a copy would not be shared."""
    from multiprocessing.reduction import ForkingPickler
    model = nn.Linear(3, 2).cuda()
    for t in (model.weight, torch.ones(2, device="cuda")):
        with pytest.raises(NotImplementedError, match="remotecuda: a cuda tensor cannot be sent to another process"):
            ForkingPickler.dumps(t)
    cpu = model.weight.detach().cpu()
    assert torch.equal(pickle.loads(ForkingPickler.dumps(cpu)), cpu)  # the advice


def test_mixing_cpu_and_cuda_raises_as_on_a_gpu():
    x = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(torch.ones(3, 3), torch.ones(3, 3, device="cuda"))
    # a 0-dim CPU tensor is allowed with CUDA tensors, as in PyTorch
    assert (x * torch.tensor(2.0)).cpu().tolist() == [2.0, 2.0, 2.0]


def test_a_cpu_tensor_indexed_with_cuda_tensors_is_not_silently_left_unchanged():
    """cpu[cuda_idx] = v wrote to a copy of the CPU tensor on the gateway (the user's unchanged) and
    cpu[cuda_idx] came back on 'cuda'. A GPU's torch refuses the read, moves a write's indices to
    the CPU (index_put_'s make_info), and reads a 0-d cuda value into cpu[idx]."""
    c, g = torch.arange(6.0), torch.arange(6.0, device="cuda")
    with pytest.raises(RuntimeError, match=r"indices should be either on cpu or on the same device .* \(cpu\)"):
        c[torch.tensor([1], device="cuda")]
    c[g > 4] = 3.0
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        c[torch.tensor([0, 1])] = g[:2]
    c[torch.tensor([0, 1])] = g[3]
    g[torch.tensor([4, 5])] = torch.tensor(7.0)
    assert c.tolist() == [3.0, 3.0, 2.0, 3.0, 4.0, 3.0] and g.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 7.0, 7.0]


def test_a_cpu_tensor_written_with_a_cuda_tensor_raises_as_on_a_gpu():
    """total = torch.tensor(0.); total += loss (a cuda loss) left total at 0: the 0-d CPU tensor
    was uploaded as a scalar and the gateway's copy written. A GPU refuses a CPU output."""
    loss = torch.tensor(2.5, device="cuda")
    total = torch.tensor(0.0)
    for write in (lambda: total.add_(loss), lambda: torch.add(total, loss, out=total),
                  lambda: torch.add(loss, loss, out=torch.empty(0))):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            write()
    total += loss.item()
    assert total.item() == 2.5 and total.copy_(loss * 2).item() == 5.0  # what works on a GPU works
    g = torch.ones(2, device="cuda")
    g += torch.tensor(2.0)  # a 0-d CPU input (not output) is fine, as on a GPU
    assert g.cpu().tolist() == [3.0, 3.0]


def test_device_identity():
    x = torch.zeros(4, 4, device="cuda")
    assert x.is_cuda and x.device == torch.device("cuda", 0) and x.get_device() == 0
    assert x.data_ptr() != 0 and not x.is_meta
    assert x[1].data_ptr() == x.data_ptr() + 4 * 4  # a view points into its base
    assert torch.zeros(2).cuda().data_ptr() != x.data_ptr()


def test_autocast_casts_like_cuda():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ra, rb = a.cuda(), b.cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        mm = ra @ rb
        lin = F.linear(ra, rb)
        sm = torch.softmax(mm, dim=-1)
        added = mm + 1  # not on any list: follows its input
    assert mm.dtype == torch.float16 and lin.dtype == torch.float16
    assert sm.dtype == torch.float32 and added.dtype == torch.float16
    torch.testing.assert_close(mm.cpu().float(), (a.half().float() @ b.half().float()), rtol=1e-2, atol=1e-2)
    assert (ra @ rb).dtype == torch.float32  # off again after the block
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert (ra @ rb).dtype == torch.bfloat16
    assert torch.cuda.is_bf16_supported()


def test_autocast_decorator_reentered_and_nested():
    a = torch.randn(4, 4).cuda()

    @torch.autocast("cuda", dtype=torch.float16)
    def mm(x):
        return x @ x

    assert mm(a).dtype == torch.float16 and mm(a).dtype == torch.float16  # one instance, entered twice
    with torch.autocast("cuda", dtype=torch.float16):
        with torch.autocast("cuda", enabled=False):
            assert (a @ a).dtype == torch.float32
        assert (a @ a).dtype == torch.float16
    assert (a @ a).dtype == torch.float32


def test_autocast_reaches_the_calls_inside_functional_composites():
    """CUDA autocast casts at the aten level, so the linear inside multi_head_attention_forward and the
    norm inside F.normalize are cast too; the mode saw only the outer call, and a TransformerEncoderLayer
    in training under autocast failed with 'expected m1 and m2 to have the same dtype'."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    want_layer, (want_out, want_w) = layer(x), mha(x, x, x)
    layer.cuda(), mha.cuda()
    rx = x.cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        got_layer = layer(rx)
        got_out, got_w = mha(rx, rx, rx)
        unit = F.normalize(rx.half(), dim=-1)
        pooled = F.max_pool2d(rx, 2)  # (boolean_dispatch's wrapper: its callee hands the wrapper to the mode)
    assert got_layer.dtype == torch.float32  # its last op is a layer norm, in float32
    assert got_out.dtype == torch.float16 and got_w.dtype == torch.float32  # softmax runs in float32
    assert unit.dtype == torch.float32  # the norm in float32, and half / float promotes
    assert torch.equal(pooled.cpu(), F.max_pool2d(x, 2))
    got_layer.sum().backward()
    assert layer.self_attn.in_proj_weight.grad.dtype == torch.float32
    for got, want in ((got_layer, want_layer), (got_out, want_out), (got_w, want_w)):
        torch.testing.assert_close(got.cpu().float(), want.detach(), rtol=2e-2, atol=2e-2)


_SPELLINGS = {  # CUDA autocast's float32 ops reached through a Tensor method, an operator or an alias
    "Tensor.log1p": lambda x: x.log1p(), "Tensor.expm1": lambda x: x.expm1(),
    "Tensor.reciprocal": lambda x: (x + 1e-9).reciprocal(),  # (DAC's Snake activation)
    "Tensor.log2": lambda x: x.log2(), "Tensor.log10": lambda x: x.log10(), "Tensor.sinh": lambda x: x.sinh(),
    "Tensor.erfinv": lambda x: (x - 1).erfinv(), "Tensor.renorm": lambda x: x.renorm(2, 0, 1.0),
    "Tensor.dist": lambda x: x.dist(x.flip(0)), "rpow": lambda x: 2 ** x,
    "special.expm1": torch.special.expm1, "special.log1p": torch.special.log1p,
    "special.softmax": lambda x: torch.special.softmax(x, 0),
    "special.logsumexp": lambda x: torch.special.logsumexp(x, 0),
    "linalg.norm": torch.linalg.norm, "rms_norm": lambda x: torch.rms_norm(x, [4]),
    "Tensor.square": lambda x: x.square(), "Tensor.arccos": lambda x: (x - 1).arccos(),  # (pow's, acos' composites)
}


@pytest.mark.parametrize("name", sorted(_SPELLINGS))
def test_autocast_casts_every_spelling_of_an_op(name):
    """CUDA autocast casts at the aten level, so ``x.log1p()``, ``2 ** x`` and ``torch.special.expm1``
    run in float32 as ``torch.log1p`` does; the mode's lists named the ``torch.*`` functions only, and
    the other spellings ran in half precision (another result, and the dtype downstream)."""
    x = torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) + 0.5
    fn = _SPELLINGS[name]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = fn(x.cuda().bfloat16())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), fn(x.bfloat16().float()))


def test_autocast_spellings_of_lower_and_promoted_ops():
    """``torch.linalg.matmul`` is ``matmul`` (half precision); ``vdot`` promotes its operands, as
    ``dot`` does; ``F.interpolate(mode='area')`` is an adaptive average pool, on none of CUDA's lists,
    so it keeps its input's dtype where the upsampling modes run in float32."""
    a = torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    v = torch.rand(4, generator=torch.Generator().manual_seed(1))
    img = torch.rand(1, 2, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert torch.linalg.matmul(a.cuda(), a.cuda()).dtype == torch.bfloat16
        assert torch.linalg.vecdot(a.cuda(), a.cuda()).dtype == torch.bfloat16
        dot = torch.vdot(v.cuda().bfloat16(), v.cuda())
        area = F.interpolate(img.cuda().bfloat16(), size=(4, 4), mode="area")
        nearest = F.interpolate(img.cuda().bfloat16(), scale_factor=2, mode="nearest")
    assert dot.dtype == torch.float32
    torch.testing.assert_close(dot.cpu(), torch.vdot(v.bfloat16().float(), v))
    assert area.dtype == torch.bfloat16 and nearest.dtype == torch.float32
    torch.testing.assert_close(area.cpu(), F.interpolate(img.bfloat16(), size=(4, 4), mode="area"))


def test_no_function_mode_on_the_op_path():
    """Ops on remote tensors pay for no TorchFunctionMode (~8 µs each): only autocast pushes one."""
    assert torch._C._len_torch_function_stack() == 0
    with torch.autocast("cuda"):
        assert torch._C._len_torch_function_stack() == 1
    assert torch._C._len_torch_function_stack() == 0


def test_user_meta_stays_meta_and_ordinals_mean_cuda():
    x = torch.ones(2, 3, device="cuda")
    for t in (torch.empty(2, 3, device="meta"), torch.zeros(2, device=torch.device("meta")),
              torch.ones(2).to("meta"), torch.tensor([1.0], device="meta"), torch.zeros_like(x.cpu(), device="meta")):
        assert t.is_meta and type(t) is torch.Tensor
    with torch.device("meta"):
        lin = nn.Linear(3, 2)
    assert lin.weight.is_meta
    lin = lin.to_empty(device="cuda")
    assert lin.weight.is_cuda and lin(x).shape == (2, 2)
    for t in (x.new_zeros(2, device=0), torch.randn(2, device=0), torch.arange(3, device=0)):
        assert t.is_cuda and t.device == torch.device("cuda", 0)
    assert torch.where(x > 0, x, 0.).is_cuda  # C++ builds the scalar on 'meta' from x: remote


def test_a_cuda_tensors_factories_go_where_they_are_told():
    """``x.new_*``, ``*_like`` and ``to`` with an explicit 'cpu' or 'meta' give a tensor there, as on a
    GPU, not a cuda tensor (C++ sees a remote tensor's device as meta, so 'meta' looks like staying put)."""
    x = torch.arange(6, dtype=torch.float64, device="cuda").view(2, 3).t()
    ref = torch.arange(6, dtype=torch.float64).view(2, 3).t()
    for device in ("cpu", "meta"):
        made = [x.new_zeros(2, device=device), x.new_ones((2, 2), device=device), x.new_empty(3, device=device),
                x.new_full((2,), 7.0, device=device), x.new_empty_strided((2, 2), (1, 2), device=device),
                x.new_tensor([1.0, 2.0], device=device), torch.zeros_like(x, device=device),
                torch.rand_like(x, device=device), x.to(device, torch.float16)]
        local = [ref.new_zeros(2, device=device), ref.new_ones((2, 2), device=device), ref.new_empty(3, device=device),
                 ref.new_full((2,), 7.0, device=device), ref.new_empty_strided((2, 2), (1, 2), device=device),
                 ref.new_tensor([1.0, 2.0], device=device), torch.zeros_like(ref, device=device),
                 torch.rand_like(ref, device=device), ref.to(device, torch.float16)]
        for t, want in zip(made, local):
            assert type(t) is torch.Tensor and t.device.type == device, (device, t.device)
            assert (t.dtype, t.shape, t.stride()) == (want.dtype, want.shape, want.stride())
    with pytest.warns(UserWarning, match="copy construct"):  # as PyTorch warns for its own
        assert torch.equal(x.new_tensor(x, device="cpu"), ref)
    assert torch.equal(x.to("cpu", torch.float16), ref.half())
    assert x.cpu().stride() == ref.stride() and x.cpu(memory_format=torch.contiguous_format).is_contiguous()
    assert torch.equal(x.new_full((2,), 7.0, device="cpu"), torch.full((2,), 7.0, dtype=torch.float64))
    assert torch.ones(3).new_zeros(2, device="meta").is_meta and torch.ones(3).new_tensor([1], device="meta").is_meta
    assert x.new_zeros(2).is_cuda and torch.zeros_like(x).is_cuda and x.new_tensor([1.0]).is_cuda


def test_linspace_and_logspace_with_cuda_scalar_ends_read_them_as_a_gpu_does():
    """``torch.linspace(start, end, n)`` with 0-d 'cuda' ends (a schedule from a tensor's max): torch's
    kernel reads them (``item()``) and makes the result on the device asked, the CPU by default. It
    gave an unusable 'meta' tensor (the result was computed from the ends' meta stand-ins)."""
    lo, hi = torch.tensor(0.5, device="cuda"), torch.tensor(2.5, device="cuda")
    cases = [(torch.linspace, (lo, hi, 5), {}), (torch.linspace, (0, hi, 3), {}), (torch.linspace, (lo, 3, 4), {}),
             (torch.logspace, (lo, hi, 3), {}), (torch.logspace, (lo, 2, 3), {"base": 2.0}),
             (torch.linspace, (lo, hi, 3), {"dtype": torch.float64})]
    for fn, args, kw in cases:
        want = fn(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args], **kw)
        got = fn(*args, **kw)
        assert type(got) is torch.Tensor and got.device.type == "cpu", (fn.__name__, args, got.device)
        assert torch.equal(got, want)
        on_cuda = fn(*args, **kw, device="cuda")
        assert on_cuda.is_cuda and torch.equal(on_cuda.cpu(), want)
    out = torch.empty(3)
    assert torch.linspace(lo, hi, 3, out=out) is out and out.tolist() == [0.5, 1.5, 2.5]
    out = torch.empty(3, device="cuda")
    torch.logspace(lo, hi, 3, out=out)
    assert torch.equal(out.cpu(), torch.logspace(0.5, 2.5, 3))
    with pytest.raises(RuntimeError, match="0-dimensional"):
        torch.linspace(torch.zeros(2, device="cuda"), hi, 3)


def test_threads_no_active_thread_started_take_the_mode():
    """A thread no active thread started (here one started below ``threading``, as a thread started
    before ``activate()`` is) runs 'cuda' as a GPU's threads do: it takes the dispatch mode at its
    first 'cuda' call or op on a remote tensor (tests/test_left_alone.py; threads started while
    active take it at their start: tests/test_hf_more.py)."""
    import _thread
    import threading
    x = torch.arange(6.0).reshape(2, 3)
    remote = x.cuda()
    out = {}
    done = threading.Event()

    def work():
        try:  # the first op has no route: a number made a tensor, then an index from a list
            out["where"] = torch.where(remote > 2, remote, 0.0).cpu()
            out["index"] = remote[[1, 0]].cpu()
            out["moved"] = torch.ones(2).to("cuda")
        except Exception as e:
            out["error"] = e
        done.set()
    _thread.start_new_thread(work, ())
    assert done.wait(30)
    assert "error" not in out, out["error"]
    assert torch.equal(out["where"], torch.where(x > 2, x, 0.0)) and torch.equal(out["index"], x[[1, 0]])
    assert out["moved"].is_cuda and torch.equal(out["moved"].cpu(), torch.ones(2))
    assert torch.ones(2).to("cuda").is_cuda  # this thread is unaffected


def test_deactivate_restores_torch_exactly():
    with interception_removed():  # what deactivate() does, keeping the fixture's sessions
        assert torch.Tensor.to is torch._C.TensorBase.to and "data" not in vars(torch.Tensor)
        assert torch.zeros is torch._C._VariableFunctions.zeros
        assert torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
        assert "__enter__" in vars(torch.amp.autocast_mode.autocast)
        assert torch.autocast.__enter__.__module__ == "torch.amp.autocast_mode"
        assert torch.ones(2).to("meta").is_meta
    assert torch.zeros(2, device="cuda").is_cuda


# ---------------------------------------------------------------- breaks loudly unless handled

def test_format_numpy_tolist_item():
    x = torch.tensor([1.25, 2.5], device="cuda")
    assert f"{x.sum():.3f}" == "3.750"
    assert x.tolist() == [1.25, 2.5] and x[0].item() == 1.25
    assert x.cpu().numpy().tolist() == [1.25, 2.5]
    with pytest.raises(TypeError, match="can't convert cuda"):
        x.numpy()  # as on a real GPU


def test_scalar_setitem():
    x = torch.zeros(3, 3, device="cuda")
    x[1, 2] = 7.0
    x[x > 5] = 3.0
    x[0] = 1
    ref = torch.zeros(3, 3)
    ref[1, 2] = 3.0
    ref[0] = 1
    assert torch.equal(x.cpu(), ref)


def test_pin_memory_and_non_blocking():
    cpu = torch.arange(6.).pin_memory()
    assert not cpu.is_pinned()
    x = cpu.cuda(non_blocking=True)
    assert x.cpu().tolist() == list(range(6))


def test_save_and_load_across_the_boundary(tmp_path):
    m = nn.Linear(3, 2).cuda()
    buf = io.BytesIO()
    torch.save({"sd": m.state_dict(), "t": m.weight[0]}, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True by default
    assert loaded["sd"]["weight"].is_cuda and torch.equal(loaded["sd"]["weight"].cpu(), m.weight.cpu())
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert not on_cpu["t"].is_cuda and torch.equal(on_cpu["t"], m.weight[0].cpu())
    path = tmp_path / "cpu.pt"
    torch.save({"w": torch.arange(4.)}, path)
    to_cuda = torch.load(path, map_location="cuda")
    assert to_cuda["w"].is_cuda and to_cuda["w"].cpu().tolist() == [0, 1, 2, 3]
    m2 = nn.Linear(3, 2).cuda()
    m2.load_state_dict(loaded["sd"])
    assert torch.equal(m2.bias.cpu(), m.bias.cpu())


def test_load_a_checkpoint_written_with_cuda_storages(tmp_path):
    """A file from a GPU machine names 'cuda:0' storages; rewrite a CPU file's locations to get one."""
    import zipfile
    path = tmp_path / "gpu.pt"
    torch.save({"w": torch.arange(3.)}, path)
    fixed = tmp_path / "gpu_cuda.pt"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(fixed, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith("data.pkl"):
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            dst.writestr(item, data)
    loaded = torch.load(fixed)
    assert loaded["w"].is_cuda and loaded["w"].cpu().tolist() == [0, 1, 2]


def test_inference_mode_views():
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    ref_in = torch.randn(2, 3, 8)
    layer.eval()
    with torch.inference_mode():
        ref = layer(ref_in)
    layer.cuda()
    with torch.inference_mode():
        out = layer(ref_in.cuda())
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-5)


def test_data_parallel_single_device():
    m = nn.DataParallel(nn.Linear(3, 1)).cuda()
    assert m(torch.ones(2, 3, device="cuda")).shape == (2, 1)
    assert list(m.state_dict())[0].startswith("module.")


def test_clip_grad_norm_foreach():
    torch.manual_seed(0)
    ref = nn.Linear(5, 3)
    m = copy.deepcopy(ref).cuda()
    x = torch.randn(4, 5)
    ref(x).sum().backward()
    m(x.cuda()).sum().backward()
    n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, foreach=True)
    n = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, foreach=True)
    torch.testing.assert_close(n.cpu(), n_ref)
    torch.testing.assert_close(m.weight.grad.cpu(), ref.weight.grad)


def test_sdpa_causal_and_where_with_python_scalar():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = F.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), is_causal=True)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-6)
    x = torch.randn(6)
    torch.testing.assert_close(torch.where(x.cuda() > 0, x.cuda(), 0.).cpu(), torch.where(x > 0, x, 0.))
    import remotecuda
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    torch.cuda.synchronize()
    before = remotecuda.stats()["ops"]
    F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    assert remotecuda.stats()["ops"] - before <= 2, "one fused attention op, not the decomposed math path"


def test_cuda_generator():
    g = torch.Generator(device="cuda")
    assert g.device.type == "cuda"
    g.manual_seed(7)
    a = torch.randn(4, device="cuda", generator=g)
    g.manual_seed(7)
    b = torch.randn(4, device="cuda", generator=g)
    assert torch.equal(a.cpu(), b.cpu())
    assert isinstance(g, torch.Generator)
    assert torch.Generator().device.type == "cpu"  # CPU generators unchanged


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=False),
], ids=["adam-fused", "adamw-foreach", "sgd-for-loop"])
def test_optimizer_implementations_match_local(make_opt):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    model = copy.deepcopy(ref).cuda()
    opt_ref, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    x = torch.randn(8, 6)
    for _ in range(3):
        for m, o, inp in ((ref, opt_ref, x), (model, opt, x.cuda())):
            o.zero_grad()
            m(inp).pow(2).mean().backward()
            o.step()
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p.cpu(), p_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16])
def test_factories_follow_set_default_dtype(default):
    """``torch.ones(n, device='cuda')`` and ``int_tensor / 3`` under ``set_default_dtype``
    (Lightning's "bf16-true", float64 science code) were made in the gateway's default, float32,
    while the client said ``default``: float32 arithmetic, and ``mm`` with a ``default`` weight
    refused. The same ops run first under float32, whose metadata must not be reused."""
    def made(dev):
        return [torch.ones(2, 4, device=dev) / 3, torch.zeros(2, 4, device=dev) + 0.1,
                torch.full((2, 4), 0.7, device=dev), torch.empty(2, 4, device=dev).fill_(1 / 3),
                torch.arange(0, 1, 0.125, device=dev).reshape(2, 4),
                torch.eye(2, 4, device=dev) / 3, torch.full((2, 4), 3, device=dev),
                torch.arange(8, device=dev).reshape(2, 4) / 3, torch.tensor([[1, 2, 3, 4]]).to(dev).sqrt()]

    def run(dev):
        w = torch.linspace(-1, 1, 12, dtype=default).reshape(3, 4).to(dev)
        return [m @ w.t() if m.is_floating_point() else m for m in made(dev)]

    [m.cpu() for m in made("cuda")]
    old = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        want, got = run("cpu"), run("cuda")
    finally:
        torch.set_default_dtype(old)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_set_default_tensor_type_reaches_the_gateway():
    """``set_default_tensor_type(torch.DoubleTensor)`` sets the default dtype in C++, past
    ``torch.set_default_dtype``: ``arange(4) / 3`` was float32 on the gateway."""
    old = torch.get_default_dtype()
    with warnings.catch_warnings():  # (deprecated, and said once per process)
        warnings.simplefilter("ignore", UserWarning)
        torch.set_default_tensor_type(torch.DoubleTensor)
    try:
        got = torch.arange(4, device="cuda") / 3
        got = (got.reshape(4, 1) @ torch.ones(1, 1, dtype=got.dtype, device="cuda")).cpu().flatten()
        want = torch.arange(4) / 3
    finally:
        torch.set_default_dtype(old)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_autocast_reaches_the_calls_inside_cxx_composites():
    """CUDA autocast casts the inner calls of a C++ composite that is on none of its lists:
    ``F.pairwise_distance``'s norm runs in float32, ``torch.cov``'s sums in float32 and its ``mm`` in
    half precision (so ``corrcoef``'s too); a remote tensor's composite ran them below the mode, uncast."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    x = torch.randn(4, 6, generator=g)
    with torch.autocast("cuda", dtype=torch.float16):
        dist = F.pairwise_distance(a.cuda().half(), b.cuda().half())
        cov = torch.cov(x.cuda())
        method = x.cuda().cov(correction=0)
        corr = torch.corrcoef(x.cuda())
    centered = x - x.sum(1, keepdim=True) / 6  # (CUDA: the sum in float32, the mm of half precision)
    want_cov = torch.mm(centered.half(), centered.t().half())
    assert (dist.dtype, cov.dtype, method.dtype, corr.dtype) == (torch.float32,) + (torch.float16,) * 3
    torch.testing.assert_close(dist.cpu(), torch.norm((a.half() - b.half() + 1e-6).float(), 2, 1))
    torch.testing.assert_close(cov.cpu(), want_cov / 5)
    torch.testing.assert_close(method.cpu(), want_cov / 6)
    std = (want_cov / 5).diagonal().sqrt()
    torch.testing.assert_close(corr.cpu(), ((want_cov / 5) / std.view(-1, 1) / std.view(1, -1)).clip(-1, 1))
    assert torch.cov(x.cuda()).dtype == torch.float32  # off again after the block


def test_autocast_cov_warns_and_refuses_as_torch_does():
    """``torch.cov`` under CUDA autocast (its transcription, remotecuda/autocast.py) gives ATen's
    warning, at the program's line, and ATen's errors."""
    x = torch.randn(3, 1, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as local:
        warnings.simplefilter("always")
        torch.cov(x)
    with torch.autocast("cuda", dtype=torch.float16):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            torch.cov(x.cuda())
        with pytest.raises(RuntimeError, match=r"^cov\(\): fweights cannot be negative$"):
            torch.cov(x.cuda().view(1, 3), fweights=torch.tensor([1, -1, 2], device="cuda"))
    assert [str(w.message) for w in got] == [str(w.message) for w in local]
    assert [(w.filename, w.lineno) for w in got] == [(__file__, line)]


def test_autocast_reaches_the_sums_and_matmuls_inside_trapezoid_mvlgamma_pinv_matrix_power():
    """More C++ bodies CUDA autocast reaches inside: ``trapezoid``'s ``sum``, ``cumulative_trapezoid``'s
    ``cumsum`` and ``mvlgamma``'s ``sum`` of half inputs run in float32 (so their results are float32),
    ``linalg.pinv``'s final ``matmul`` and ``matrix_power``'s of a float32 input in half precision;
    remotely the whole op ran below the mode, uncast (float16 sums, a float32 pinv)."""
    g = torch.Generator().manual_seed(0)
    y, xs, a = torch.randn(4, 7, generator=g).half(), torch.rand(7, generator=g).cumsum(0).half(), \
        (torch.rand(5, generator=g) * 4 + 2).half()
    m = torch.randn(5, 3, generator=g)
    sym = m.t() @ m
    with torch.autocast("cuda", dtype=torch.float16):
        got = {"trapezoid": torch.trapezoid(y.cuda(), dx=0.5), "trapz": torch.trapz(y.cuda(), xs.cuda()),
               "cumulative": torch.cumulative_trapezoid(y.cuda(), dim=0),
               "cumulative_x": torch.cumulative_trapezoid(y.cuda(), xs.cuda()),
               "mvlgamma": torch.mvlgamma(a.cuda(), 3), "multigammaln": torch.special.multigammaln(a.cuda(), 2),
               "pinv": torch.linalg.pinv(m.cuda()), "pinverse": m.cuda().pinverse(),
               "hermitian": torch.linalg.pinv(sym.cuda(), hermitian=True),
               "pinv64": torch.linalg.pinv(m.double().cuda())}
        in_place = a.cuda().mvlgamma_(3)
        with pytest.raises(RuntimeError, match="^trapezoid: There must be one `x` value for each sample point$"):
            torch.trapezoid(y.cuda(), xs[:3].cuda())
        with pytest.raises(RuntimeError, match="^The size of tensor a \\(6\\) must match the size of tensor b \\(2\\)"):
            torch.trapezoid(y.cuda(), torch.ones(2, 3, device="cuda").half())  # (the op's own words, not meta's)
        with pytest.raises(RuntimeError, match="^p has to be greater than or equal to 1$"):
            torch.mvlgamma(a.cuda(), 0)
    pairs = y[:, :-1] + y[:, 1:]
    f32 = torch.float32

    def mvlgamma(p):  # (CUDA: the sum of the half lgammas in float32)
        return (torch.arange(-p / 2 + 0.5, 0.5, 0.5).half() + a.unsqueeze(-1)).lgamma().sum(-1, dtype=f32) \
            + p * (p - 1) * math.log(math.pi) / 4

    def pinv(u, s, vh, keep):  # (CUDA: the matmul in half precision)
        s_pinv = torch.where(keep, s.reciprocal(), torch.zeros(()))
        return torch.matmul((vh.mH * s_pinv.unsqueeze(-2)).half(), u.mH.half())
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    e, q = torch.linalg.eigh(sym)
    eps = torch.finfo(f32).eps
    want = {"trapezoid": (y.sum(-1, dtype=f32) - (y[:, 0] + y[:, -1]) * 0.5) * 0.5,
            "trapz": (pairs * (xs[1:] - xs[:-1])).sum(-1, dtype=f32) / 2,
            "cumulative": (0.5 * (y[:-1] + y[1:])).cumsum(0, dtype=f32),
            "cumulative_x": (pairs * (xs[1:] - xs[:-1])).cumsum(-1, dtype=f32) / 2,
            "mvlgamma": mvlgamma(3), "multigammaln": mvlgamma(2),
            "pinv": pinv(u, s, vh, s > eps * 5 * s[0]), "pinverse": pinv(u, s, vh, s > 1e-15 * s[0]),
            "hermitian": pinv(q, e, q.mH, e.abs() > eps * 3 * e.abs().max()),
            "pinv64": torch.linalg.pinv(m.double())}
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    for k, v in got.items():
        torch.testing.assert_close(v.cpu(), want[k], msg=k)
    assert in_place.dtype == torch.float16
    torch.testing.assert_close(in_place.cpu(), mvlgamma(3).half())
    with torch.autocast("cuda", dtype=torch.float16):  # (matrix_power's matmuls in half precision, by n's bits)
        powers = [torch.linalg.matrix_power(sym.cuda(), 3), sym.cuda().matrix_power(5),
                  torch.matrix_power(sym.cuda(), -2), torch.linalg.matrix_power(sym.cuda(), 1)]
    h, inv = sym.half(), torch.linalg.inv(sym).half()
    want_powers = [h @ h @ h, h @ ((h @ h) @ (h @ h)), inv @ inv, sym]
    assert [p.dtype for p in powers] == [p.dtype for p in want_powers]
    for got_power, want_power in zip(powers, want_powers):
        torch.testing.assert_close(got_power.cpu(), want_power, rtol=0, atol=0)
    with torch.autocast("cuda", dtype=torch.float16):  # (vander refuses half inputs; others' cumprod is uncast)
        with pytest.raises(RuntimeError, match="linalg.vander supports"):
            torch.linalg.vander(a.cuda())
        assert torch.equal(torch.linalg.vander(a.float().cuda()).cpu(), torch.linalg.vander(a.float()))


def test_autocast_runs_a_half_precision_weight_norms_norm_in_float32():
    """``torch._weight_norm`` (nn.utils' weight norm) of half-precision tensors is, off its fused kernel,
    ``v * (g / norm_except_dim(v))`` in C++, whose ``norm`` CUDA autocast runs in float32: a float32
    weight. Remotely it ran below the mode: float16 (bfloat16) norms and weights."""
    gen = torch.Generator().manual_seed(0)
    v, g0, g1 = torch.randn(4, 3, 5, generator=gen), torch.rand(4, 1, 1, generator=gen) + 0.5, \
        torch.rand(1, 3, 1, generator=gen) + 0.5
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(3, 4, 5)).half()
    with torch.autocast("cuda", dtype=torch.float16):
        got = [torch._weight_norm(v.half().cuda(), g0.half().cuda(), 0),
               torch._weight_norm(v.bfloat16().cuda(), g1.bfloat16().cuda(), dim=1),
               torch._weight_norm(v.bfloat16().cuda(), g0.bfloat16().cuda())]  # (its fused kernel: uncast)
        conv.cuda()
        weight = conv.weight
    h, b = v.half(), v.bfloat16()
    want = [h * (g0.half() / h.float().view(4, -1).norm(2, 1).view(4, 1, 1)),
            b * (g1.bfloat16() / b.float().transpose(0, 1).reshape(3, -1).norm(2, 1).view(3, 1, 1).transpose(0, 1)),
            torch._weight_norm(b, g0.bfloat16())]
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.bfloat16]
    for got_one, want_one in zip(got, want):
        torch.testing.assert_close(got_one.cpu(), want_one)
    assert weight.dtype == torch.float32
