"""Scientific and probabilistic programs, round 7, shrunk (tiny sizes, few steps, seeded, synthetic
data) and run unchanged with plain ``python`` (the local CPU) and under ``remotecuda run`` on a CPU
gateway; the JSON each prints last must agree value by value (tests/test_corpus.py's rules). The
programs live in tests/corpus:

- pinn_poisson: a physics-informed network in float64 (``set_default_dtype``): the Laplacian by
  ``autograd.grad(create_graph=True)`` twice, Adam then L-BFGS with strong Wolfe, and again by
  ``torch.func`` (vmap of hessian through ``functional_call``);
- gaussian_process: GP regression by hand: a jitter loop on ``cholesky_ex`` reading ``info``,
  ``cholesky_solve``/``solve_triangular``, the marginal likelihood by Cholesky, ``logdet``,
  ``slogdet``, ``eigh`` and ``MultivariateNormal``, posterior draws; ``lstsq``/``qr``/``svd``/
  ``pinv`` baselines, ``quantile``/``histc``/``bucketize``/``bincount``/``searchsorted``;
- flows_bayes: RealNVP with coupling masks over ``MultivariateNormal`` and ``MixtureSameFamily``
  bases, ``TransformedDistribution``, Bayes-by-backprop with ``kl_divergence`` and
  ``Categorical(logits=...)``;
- fno_spectral: a Fourier neural operator (complex parameters, ``rfft2``/``irfft2``, complex
  ``einsum``, modes written by slices), checkpointed with ``torch.save``, ``view_as_real``/
  ``view_as_complex``; a complex128 Poisson solve and a split-step Schrödinger propagator;
- mcmc_ode: Hamiltonian Monte Carlo, denoising and sliced score matching with Langevin sampling, a
  neural ODE through a hand-written RK4, preconditioned conjugate gradients on a sparse Laplacian
  stopping on ``.item()``.

Beside them, the fidelity gaps the round found (CUDA's kernels take what the CPU's refuse), each
shown directly, and the probabilistic libraries' own idioms (gpytorch, pyro, zuko) where installed.
"""
from __future__ import annotations

import math

import pytest
import torch
from local_parity import data as D
from test_corpus import F32, assert_program_matches

pytestmark = pytest.mark.usefixtures("remote")

PROGRAMS = ["pinn_poisson", "gaussian_process", "flows_bayes", "fno_spectral", "mcmc_ode"]


@pytest.mark.parametrize("name", PROGRAMS)
def test_program_matches_local(gateway, name: str):
    """The program prints under ``remotecuda run`` what it prints with plain ``python``."""
    assert_program_matches(gateway, name, F32)


@pytest.mark.parametrize("driver", ["gesvd", "gesvdj", "gesvda"])
def test_svd_takes_cusolvers_drivers(driver: str):
    """``torch.linalg.svd(A, driver="gesvdj")`` (and ``svdvals``) names one of cuSOLVER's drivers,
    an argument only 'cuda' tensors take: the CPU kernel serving 'cuda' refused it ("only supported
    on CUDA inputs"). Every driver gives the same decomposition (up to signs)."""
    A = D(3, 6, 4).double()
    U, S, Vh = torch.linalg.svd(A.cuda(), full_matrices=False, driver=driver)
    want = torch.linalg.svd(A, full_matrices=False)
    torch.testing.assert_close(S.cpu(), want.S)
    torch.testing.assert_close((U @ torch.diag_embed(S) @ Vh).cpu(), A)
    torch.testing.assert_close(Vh.abs().cpu(), want.Vh.abs())
    torch.testing.assert_close(torch.linalg.svdvals(A.cuda(), driver=driver).cpu(), want.S)
    out = tuple(torch.empty(0, dtype=A.dtype, device="cuda") for _ in range(3))
    torch.linalg.svd(A.cuda(), full_matrices=False, driver=driver, out=out)
    torch.testing.assert_close((out[0] @ torch.diag_embed(out[1]) @ out[2]).cpu(), A)


def test_svd_refuses_a_driver_cusolver_does_not_have():
    with pytest.raises(RuntimeError, match="unknown svd driver gesdd"):
        torch.linalg.svd(torch.ones(3, 3, device="cuda"), driver="gesdd")


#: transforms a Fourier layer makes, each of a (2, 4, 8) signal
HALF_FFTS = {
    "rfft": lambda t: torch.fft.rfft(t),
    "rfft2": lambda t: torch.fft.rfft2(t, norm="ortho"),
    "fft2": lambda t: torch.fft.fft2(t),
    "irfft2": lambda t: torch.fft.irfft2(torch.fft.rfft2(t), s=(4, 8)),
    "ifftn": lambda t: torch.fft.ifftn(torch.fft.fft(t), dim=(-2, -1)),
}


@pytest.mark.parametrize("name", HALF_FFTS)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")  # (torch's, on a GPU too)
def test_half_precision_fft_of_power_of_two_sizes(name: str):
    """cuFFT transforms float16 and complex32 signals whose sizes are powers of two (a
    ``model.half()`` Fourier layer); the CPU's FFT serving 'cuda' refused them ("MKL FFT doesn't
    support tensors of type: Half"). The values are the single-precision transform's, to half
    precision."""
    fn = HALF_FFTS[name]
    x = D(2, 4, 8).half()
    got = fn(x.cuda())
    want = fn(x.float())
    assert got.dtype == (torch.float16 if want.dtype == torch.float32 else torch.complex32)
    assert got.shape == want.shape
    got = got.cpu()
    got = got.float() if not got.is_complex() else torch.view_as_real(got).float()
    want = want if not want.is_complex() else torch.view_as_real(want)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("call", [
    lambda: torch.fft.rfft(torch.ones(6, dtype=torch.half, device="cuda")),
    lambda: torch.fft.fft2(torch.ones(3, 4, dtype=torch.half, device="cuda")),
    lambda: torch.fft.irfft(torch.ones(4, dtype=torch.chalf, device="cuda"), n=6),
], ids=["rfft6", "fft2_3x4", "irfft_to6"])
def test_half_precision_fft_of_other_sizes_is_refused_at_the_call(call):
    """cuFFT's half plans take power-of-two sizes only, and say so at the call (the
    ``try``/``except`` around it catches it), not at a later sync."""
    with pytest.raises(RuntimeError, match="powers of two when computing in half precision"):
        call()
    assert torch.ones(2, device="cuda").sum().item() == 2  # (nothing queued was poisoned)


# ------------------------------------------------------------ the probabilistic libraries, in-process

def _both(fn) -> None:
    def run(dev: str) -> object:
        torch.manual_seed(0)
        return torch.utils._pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, fn(dev))
    torch.testing.assert_close(run("cuda"), run("cpu"), rtol=1e-4, atol=1e-5)


def test_gpytorch_exact_gp_regression():
    """gpytorch's "Simple GP Regression" tutorial: an ExactGP with a scaled RBF kernel, trained on the
    exact marginal log likelihood, predictions with ``fast_pred_var`` and confidence regions."""
    gpytorch = pytest.importorskip("gpytorch")

    def fit(dev: str) -> object:
        train_x = torch.linspace(0, 1, 30, device=dev)
        train_y = torch.sin(train_x * (2 * math.pi)) + 0.2 * D(30).to(dev)

        class ExactGPModel(gpytorch.models.ExactGP):
            def __init__(self, x, y, likelihood):
                super().__init__(x, y, likelihood)
                self.mean_module = gpytorch.means.ConstantMean()
                self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

            def forward(self, x):
                return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(dev)
        model = ExactGPModel(train_x, train_y, likelihood).to(dev)
        model.train()
        likelihood.train()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = -mll(model(train_x), train_y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        likelihood.eval()
        with torch.no_grad(), gpytorch.settings.fast_pred_var():
            pred = likelihood(model(torch.linspace(0, 1, 11, device=dev)))
            lower, upper = pred.confidence_region()
        return losses, pred.mean, lower, upper, likelihood.noise
    _both(fit)


def test_pyro_svi_map_estimate():
    """pyro's SVI with an ``AutoDelta`` guide (a MAP fit, so no sampling): a Bayesian linear
    regression with a ``plate``, ``HalfNormal`` noise and pyro's own Adam."""
    pyro = pytest.importorskip("pyro")
    import pyro.distributions as dist
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoDelta

    def fit(dev: str) -> object:
        pyro.clear_param_store()
        x = D(50).to(dev)
        y = 2 * x + 1 + 0.1 * D(50, seed=1).to(dev)

        def model(x, y=None):
            a = pyro.sample("a", dist.Normal(torch.tensor(0.0, device=dev), 10.0))
            b = pyro.sample("b", dist.Normal(torch.tensor(0.0, device=dev), 10.0))
            s = pyro.sample("s", dist.HalfNormal(torch.tensor(1.0, device=dev)))
            with pyro.plate("data", len(x)):
                pyro.sample("obs", dist.Normal(a * x + b, s), obs=y)

        guide = AutoDelta(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
        losses = [svi.step(x, y) for _ in range(8)]
        return losses, guide.median()
    _both(fit)


def test_zuko_conditional_flows():
    """zuko's conditional masked autoregressive flow and neural spline flow, trained by their log
    likelihood (sampling shapes only: the draws are the device generator's)."""
    zuko = pytest.importorskip("zuko")

    def fit(dev: str) -> object:
        flow = zuko.flows.MAF(features=2, context=1, transforms=2, hidden_features=(16, 16)).to(dev)
        nsf = zuko.flows.NSF(features=2, transforms=1, hidden_features=(8,)).to(dev)
        opt = torch.optim.Adam(flow.parameters(), lr=1e-3)
        x, c = D(32, 2).to(dev), D(32, 1, seed=1).to(dev)
        losses = []
        for _ in range(3):
            loss = -flow(c).log_prob(x).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, nsf().log_prob(x[:4]), list(flow(c[:3]).rsample((4,)).shape)
    _both(fit)


def _diagonally_dominant(*shape: int) -> torch.Tensor:
    """Matrices whose partial pivoting swaps no rows: their LU with and without pivoting agree."""
    return D(*shape).double() + 10 * torch.eye(shape[-2], shape[-1], dtype=torch.float64)


@pytest.mark.parametrize("shape", [(4, 4), (2, 5, 3), (2, 3, 5)])
def test_lu_without_pivoting(shape: tuple[int, ...]):
    """``torch.linalg.lu_factor(A, pivot=False)`` and ``torch.linalg.lu(A, pivot=False)`` factor
    without row exchanges on CUDA; the CPU kernel serving 'cuda' refused ("LU without pivoting is
    not implemented on the CPU"). Pivots are ``1..k`` and ``P`` is empty, as CUDA gives them; on a
    matrix partial pivoting leaves in place the factors are the pivoted ones, gradients too."""
    A = _diagonally_dominant(*shape)
    want_LU, want_piv = torch.linalg.lu_factor(A)
    k = min(shape[-2:])
    assert torch.equal(want_piv, torch.arange(1, k + 1, dtype=torch.int32).expand_as(want_piv))
    LU, piv, info = torch.linalg.lu_factor_ex(A.cuda(), pivot=False)
    assert LU.stride() == want_LU.stride()
    torch.testing.assert_close(LU.cpu(), want_LU)
    assert torch.equal(piv.cpu(), want_piv) and not info.cpu().any()

    Ac, Ag = A.clone().requires_grad_(), A.cuda().requires_grad_()
    _, want_L, want_U = torch.linalg.lu(Ac)
    P, L, U = torch.linalg.lu(Ag, pivot=False)
    assert P.shape == (0,) and P.dtype == A.dtype
    torch.testing.assert_close((L.cpu(), U.cpu()), (want_L, want_U))
    (want_L.sum() + want_U.pow(2).sum()).backward()
    (L.sum() + U.pow(2).sum()).backward()
    torch.testing.assert_close(Ag.grad.cpu(), Ac.grad)


def test_lu_without_pivoting_of_a_singular_matrix():
    """``info`` names the first zero pivot, and ``lu_factor`` raises at the call as on CUDA."""
    ones = torch.ones(2, 3, 3, device="cuda")
    assert torch.linalg.lu_factor_ex(ones, pivot=False).info.tolist() == [2, 2]
    with pytest.raises(RuntimeError, match=r"U\[2,2\] is zero"):
        torch.linalg.lu_factor(ones, pivot=False)
    x = torch.linalg.lu_solve(*torch.linalg.lu_factor(_diagonally_dominant(3, 3).cuda(), pivot=False),
                              torch.ones(3, 1, dtype=torch.float64, device="cuda"))
    torch.testing.assert_close(x.cpu(), torch.linalg.solve(_diagonally_dominant(3, 3), torch.ones(3, 1).double()))
