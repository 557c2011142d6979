"""Errors a GPU raises at the call, where torch's meta kernels (which give a 'cuda' op's output
metadata on the client) accept the arguments: raised at the call here too, with the device's
type and message, not at the next sync point as asynchronous ones (remotecuda/call_checks.py).

Each mistake runs locally on the CPU (the gateway's device here) and on 'cuda' with
REMOTECUDA_SYNC off; the remote error must come from the call itself and be the local one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.usefixtures("remote")


def _raised(fn, dev):
    with pytest.raises(Exception) as info:
        fn(dev)
    return info.value


MISTAKES = {
    "conv2d_zero_dilation": lambda d: F.conv2d(torch.randn(1, 2, 5, 5, device=d), torch.randn(3, 2, 3, 3, device=d),
                                               dilation=0),
    "conv3d_negative_padding": lambda d: F.conv3d(torch.randn(1, 1, 4, 4, 4, device=d),
                                                  torch.randn(1, 1, 2, 2, 2, device=d), padding=-1),
    "conv_transpose_negative_output_padding": lambda d: torch.ops.aten.convolution(
        torch.randn(1, 2, 5, 5, device=d), torch.randn(2, 3, 3, 3, device=d), None, [2, 2], [0, 0], [1, 1], True,
        [-1, -1], 1),
    "uniform_from_above_to": lambda d: torch.empty(3, device=d).uniform_(2.0, 1.0),
    "index_add_source_shape": lambda d: torch.zeros(5, 3, device=d).index_add_(
        0, torch.tensor([0, 1], device=d), torch.ones(2, 4, device=d)),
    "index_add_source_of_fewer_dims": lambda d: torch.zeros(3, 2, device=d).index_add(
        0, torch.tensor([0, 1], device=d), torch.ones(2, device=d)),
    "bucketize_2d_boundaries": lambda d: torch.bucketize(torch.randn(3, device=d), torch.randn(2, 3, device=d)),
    "aminmax_out_of_another_float": lambda d: torch.aminmax(
        torch.randn(3, device=d), out=(torch.empty(0, dtype=torch.float64, device=d), torch.empty(0, device=d))),
    # (an out= of another dtype than the result: the meta kernels cast into it, most device kernels refuse it)
    "tril_out_of_another_float": lambda d: torch.tril(torch.randn(3, 3, device=d),
                                                      out=torch.empty(3, 3, dtype=torch.float64, device=d)),
    "neg_out_of_another_float": lambda d: torch.neg(torch.randn(3, device=d),
                                                    out=torch.empty(3, dtype=torch.float64, device=d)),
    "amax_out_of_another_float": lambda d: torch.amax(torch.randn(2, 3, device=d), 0,
                                                      out=torch.empty(3, dtype=torch.float64, device=d)),
    "any_float_out": lambda d: torch.any(torch.randn(3, device=d), 0, out=torch.empty((), device=d)),
    "cumsum_bool_out": lambda d: torch.cumsum(torch.randn(3, device=d), 0,
                                              out=torch.empty(3, dtype=torch.bool, device=d)),
    "softmax_half_out": lambda d: torch.softmax(torch.randn(3, device=d), 0,
                                                out=torch.empty(3, dtype=torch.float16, device=d)),
    "isin_long_out": lambda d: torch.isin(torch.arange(3, device=d), torch.arange(2, device=d),
                                          out=torch.empty(3, dtype=torch.long, device=d)),
    "multinomial_float_out": lambda d: torch.multinomial(torch.rand(4, device=d), 2, out=torch.empty(2, device=d)),
    "multinomial_no_samples": lambda d: torch.multinomial(torch.rand(4, device=d), 0),
    "multinomial_more_than_categories": lambda d: torch.multinomial(torch.rand(4, device=d), 5),
    "complex_out_of_another_dtype": lambda d: torch.complex(
        torch.randn(2, device=d), torch.randn(2, device=d), out=torch.empty(2, dtype=torch.complex128, device=d)),
    "as_strided_scatter_out_of_bounds": lambda d: torch.as_strided_scatter(
        torch.zeros(4, device=d), torch.ones(3, device=d), (3,), (2,)),
    "layer_norm_float64_weight": lambda d: F.layer_norm(torch.randn(2, 4, device=d), (4,),
                                                        torch.randn(4, dtype=torch.float64, device=d)),
    "add_into_expanded": lambda d: torch.zeros(1, device=d).expand(3).add_(1),
    "index_select_into_expanded": lambda d: torch.index_select(
        torch.randn(3, device=d), 0, torch.tensor([0, 1, 2], device=d), out=torch.zeros(1, device=d).expand(3)),
    "meta_tensor_to_cuda": lambda d: torch.empty(3, device="meta").to(d),
    "random_from_above_to": lambda d: torch.empty(3, device=d).random_(5, 2),
    "random_to_zero": lambda d: torch.empty(3, device=d).random_(0),
    "bernoulli_p_above_one": lambda d: torch.empty(3, device=d).bernoulli_(1.5),
    "bernoulli_fn_p_below_zero": lambda d: torch.bernoulli(torch.empty(3, device=d), -0.5),
    "std_of_integers": lambda d: torch.zeros(3, dtype=torch.long, device=d).std(),
    "var_mean_of_integers": lambda d: torch.var_mean(torch.zeros(3, dtype=torch.long, device=d)),
    "index_select_2d_index": lambda d: torch.randn(4, 5, device=d).index_select(
        0, torch.zeros(2, 2, dtype=torch.long, device=d)),
    "searchsorted_side": lambda d: torch.searchsorted(torch.arange(3.0, device=d), torch.ones(2, device=d),
                                                      side="middle"),
    "searchsorted_float_sorter": lambda d: torch.searchsorted(torch.arange(3.0, device=d), torch.ones(2, device=d),
                                                              sorter=torch.arange(3.0, device=d)),
    "ctc_loss_blank_out_of_range": lambda d: F.ctc_loss(
        torch.randn(5, 2, 4, device=d).log_softmax(2), torch.ones(2, 3, dtype=torch.long, device=d), (5, 5), (3, 3),
        blank=7),
}

#: mistakes in a float argument, made after the same call with a good value (one signature): the
#: cached entry of the good call must not let the bad one through
AFTER_A_GOOD_CALL = {
    "geometric_": (lambda x: x.geometric_(0.5), lambda x: x.geometric_(2.0)),
    "log_normal_": (lambda x: x.log_normal_(0.0, 1.0), lambda x: x.log_normal_(0.0, -1.0)),
    "bernoulli_": (lambda x: x.bernoulli_(0.5), lambda x: x.bernoulli_(1.5)),
    "uniform_": (lambda x: x.uniform_(0.0, 1.0), lambda x: x.uniform_(1.0, 0.0)),
    "histc": (lambda x: torch.histc(x, 4, 0.0, 1.0), lambda x: torch.histc(x, 4, 3.0, 1.0)),
}


@pytest.mark.parametrize("calls", list(AFTER_A_GOOD_CALL.values()), ids=list(AFTER_A_GOOD_CALL))
def test_a_bad_float_after_a_good_one_is_raised_at_the_call(calls):
    good, bad = calls

    def mistake(d):
        x = torch.rand(3, device=d)
        good(x)
        bad(x)
    local = _raised(mistake, "cpu")
    got = _raised(mistake, "cuda")
    assert (type(got), str(got)) == (type(local), str(local))
    torch.cuda.synchronize()


@pytest.mark.parametrize("mistake", list(MISTAKES.values()), ids=list(MISTAKES))
def test_raised_at_the_call_as_the_device_raises_it(mistake):
    local = _raised(mistake, "cpu")
    got = _raised(mistake, "cuda")  # (no sync point: an asynchronous error would not come here)
    assert (type(got), str(got)) == (type(local), str(local))
    torch.cuda.synchronize()  # nothing was queued that fails later
    assert torch.ones(2, device="cuda").sum().item() == 2.0


def test_a_checked_op_with_accepted_arguments_runs():
    """The checks refuse only what the device refuses: the same signatures with good values run,
    and a refused value after an accepted one (the same shapes: one cache entry) is still refused."""
    x = torch.empty(1000, device="cuda")
    for bound in (0.5, 0.25, 2.0):  # nn.init's uniform_(-bound, bound), a new bound per layer
        x.uniform_(-bound, bound)
        assert -bound <= x.min().item() and x.max().item() <= bound
    with pytest.raises(RuntimeError, match=r"from=1 > to=0.5"):
        x.uniform_(1.0, 0.5)
    assert torch.multinomial(torch.rand(4, device="cuda"), 4).sort().values.tolist() == [0, 1, 2, 3]
    s = torch.zeros(5, 3, device="cuda").index_add_(0, torch.tensor([0, 4], device="cuda"),
                                                    torch.ones(2, 3, device="cuda"))
    assert s.sum().item() == 6.0


@pytest.mark.parametrize("fill", [lambda t: t.fill_(2.0), lambda t: t.zero_()], ids=["fill_", "zero_"])
def test_expanded_tensors_the_device_writes_still_run(fill):
    """``fill_`` and ``zero_`` write an expanded tensor on a GPU too (the gateway says so)."""
    local = fill(torch.ones(1).expand(3))
    got = fill(torch.ones(1, device="cuda").expand(3))
    assert got.cpu().tolist() == local.tolist()


_A = torch.randn(4, 4)
_S = _A @ _A.T + 4 * torch.eye(4)
_B = torch.randn(4, 2)
_INT = torch.int32
#: structured linalg kernels that lay a resized ``out=`` column-major: (call, out dtypes)
LINALG_OUTS = {
    "qr": (lambda d, o: torch.linalg.qr(_A.to(d), out=o), (None, None)),
    "qr_complete": (lambda d, o: torch.linalg.qr(_A[:, :3].to(d), mode="complete", out=o), (None, None)),
    "lu_factor": (lambda d, o: torch.linalg.lu_factor(_S.to(d), out=o), (None, _INT)),
    "ldl_factor": (lambda d, o: torch.linalg.ldl_factor(_S.to(d), out=o), (None, _INT)),
    "triangular_solve": (lambda d, o: torch.triangular_solve(_B.to(d), _S.to(d), out=o), (None, None)),
    "lu_solve": (lambda d, o: torch.linalg.lu_solve(*torch.linalg.lu_factor(_S.to(d)), _B.to(d), out=o[0]), (None,)),
    "householder_product": (lambda d, o: torch.linalg.householder_product(
        _A.to(d), torch.linspace(0.1, 0.9, 3, device=d), out=o[0]), (None,)),
}


@pytest.mark.parametrize("case", list(LINALG_OUTS.values()), ids=list(LINALG_OUTS))
@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
def test_linalg_out_of_another_shape_is_laid_out_as_the_device_lays_it(case):
    """A resized ``out=`` has the strides the device's kernel gives it (column-major), so a later
    ``view`` is refused, or allowed, at the call as on a GPU, not by the gateway later."""
    call, dtypes = case
    outs = {d: tuple(torch.empty(0, dtype=t or torch.float32, device=d) for t in dtypes) for d in ("cpu", "cuda")}
    for d, o in outs.items():
        call(d, o)
    assert [t.stride() for t in outs["cuda"]] == [t.stride() for t in outs["cpu"]]
    assert all(torch.equal(r.cpu(), c) for r, c in zip(outs["cuda"], outs["cpu"]))
    local = _raised(lambda d: outs[d][0].view(-1), "cpu")
    got = _raised(lambda d: outs[d][0].view(-1), "cuda")
    assert (type(got), str(got)) == (type(local), str(local))


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_an_uploaded_tensor_grows_as_a_gpu_tensor_does():
    """``x.cuda().resize_(n)`` and an ``out=`` that must grow: a GPU resizes any of its storages.
    On a CPU gateway an upload's bytes sit in a storage torch cannot resize, and the op failed at
    the next sync ("Trying to resize storage that is not resizable")."""
    def grow(d):
        x = torch.arange(3.0).to(d)
        view = x[:2]
        x.resize_(10)
        x[0] = 7.0
        out = torch.arange(2.0).to(d)
        torch.cat([x[:3], x[:3]], out=out)
        return x[:3].cpu(), view.cpu(), out.cpu()
    assert all(torch.equal(r, c) for r, c in zip(grow("cuda"), grow("cpu")))


#: ``out=`` of another dtype than the result that the device's kernels cast into (TensorIterator's
#: ops, sum and mean's reductions): run, and the second call is a hit of the dispatch cache
CASTS_INTO_OUT = {
    "add": lambda d, o: torch.add(torch.arange(6.0, device=d), 0.5, out=o),
    "sum": lambda d, o: torch.sum(torch.randn(2, 3, generator=torch.Generator().manual_seed(0)).to(d), 0, out=o),
    "mean": lambda d, o: torch.mean(torch.arange(6.0, device=d).view(2, 3), 0, out=o),
    "cumsum": lambda d, o: torch.cumsum(torch.arange(3.0, device=d), 0, out=o),
}


@pytest.mark.parametrize("call", list(CASTS_INTO_OUT.values()), ids=list(CASTS_INTO_OUT))
def test_an_out_of_another_dtype_the_device_casts_into(call):
    import remotecuda
    local = torch.empty(0, dtype=torch.float64)
    call("cpu", local)
    got = torch.empty(0, dtype=torch.float64, device="cuda")
    call("cuda", got)
    assert got.dtype is torch.float64 and torch.equal(got.cpu(), local)
    remotecuda.stats(reset=True)
    again = torch.empty(0, dtype=torch.float64, device="cuda")
    call("cuda", again)  # the gateway said yes once: the meta kernel describes this signature now
    assert remotecuda.stats()["metadata_cache_bypasses"] == 0
    assert torch.equal(again.cpu(), local)
