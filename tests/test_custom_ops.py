"""A user's own ops (``torch.library.custom_op``, ``torch.library.Library``) on 'cuda': the kernel a
GPU's dispatcher picks runs on the client, its ops streamed to the gateway (which knows no
library's ops); inside ``torch.compile`` the graph holds that kernel's aten ops; an op with no
kernel for CUDA is refused at the call, as on a GPU. (The plain eager case with a registered
autograd formula: test_hf_more.py.)"""
from __future__ import annotations

import textwrap
import warnings

import pytest
import torch
from torch import Tensor, nn

from conftest import run_python

pytestmark = pytest.mark.usefixtures("remote")

NS = "rc_test_custom_ops"
_lib = torch.library.Library(NS, "DEF")  # (kept alive: a Library unregisters its ops when collected)


@torch.library.custom_op(f"{NS}::twice_sin", mutates_args=())
def twice_sin(x: Tensor) -> Tensor:
    return torch.sin(x) * 2


@twice_sin.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def _twice_sin_backward(ctx, grad):  # noqa: ANN001, ANN202 - torch's signature
    return grad * 2 * torch.cos(ctx.saved_tensors[0])


twice_sin.register_autograd(_twice_sin_backward,
                            setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))

_lib.define("shifted(Tensor x, float a) -> Tensor")
_lib.impl("shifted", lambda x, a: x * a, "CPU")
_lib.impl("shifted", lambda x, a: x * a + 0.5, "CUDA")  # (distinct, to see which one runs)
_lib.impl("shifted", lambda x, a: torch.empty_like(x), "Meta")
_lib.define("cpu_only(Tensor x) -> Tensor")
_lib.impl("cpu_only", lambda x: x + 1, "CPU")
_lib.impl("cpu_only", lambda x: torch.empty_like(x), "Meta")


def test_a_compiled_training_step_through_a_custom_op_runs_as_gateway_programs():
    """The graph holds the op's kernel's aten ops (the gateway knows no ``rc_test_custom_ops``),
    the backward its registered formula: no eager fallback, the values and gradients local's."""
    def steps(dev: str) -> tuple:
        torch.manual_seed(0)
        m = nn.Linear(4, 4).to(dev)
        f = torch.compile(lambda x: twice_sin(m(x)).square().sum())
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(dev)
        losses = []
        for _ in range(3):
            loss = f(x)
            loss.backward()
            losses.append(loss.detach().cpu())
        return losses, m.weight.grad.cpu(), m.bias.grad.cpu()

    expected = steps("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a fallback to eager warns)
        got = steps("cuda")
        x = torch.ones(3, 4, device="cuda", requires_grad=True)
        torch.compile(twice_sin)(x).sum().backward()  # (the op itself compiled)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x.grad.cpu(), 2 * torch.cos(torch.ones(3, 4)))


def test_a_library_ops_cuda_kernel_runs_and_an_op_without_one_is_refused():
    x = torch.ones(3)
    torch.testing.assert_close(torch.ops.rc_test_custom_ops.shifted(x.cuda(), 2.0).cpu(), x * 2 + 0.5)
    torch.testing.assert_close(torch.ops.rc_test_custom_ops.shifted(x, 2.0), x * 2)
    with pytest.raises(NotImplementedError, match="Could not run 'rc_test_custom_ops::cpu_only' with arguments "
                                                  "from the 'CUDA' backend"):
        torch.ops.rc_test_custom_ops.cpu_only(x.cuda())
    torch.testing.assert_close(torch.ops.rc_test_custom_ops.cpu_only(x), x + 1)


def test_opcheck_of_an_op_on_cuda_inputs_checks_it_and_does_not_end_the_process(gateway):
    """opcheck's AOTAutograd checks fake its inputs: a fake 'cuda' tensor with autograd aborts a
    CPU-only torch (a fresh interpreter, so that a regression cannot end the test run)."""
    code = textwrap.dedent(f"""
        import torch, remotecuda
        remotecuda.activate({gateway.address!r}, fallback="error")

        @torch.library.custom_op("rc_opcheck::sin2", mutates_args=())
        def sin2(x: torch.Tensor) -> torch.Tensor:
            return x.sin() * 2

        @sin2.register_fake
        def _(x):
            return torch.empty_like(x)

        sin2.register_autograd(lambda ctx, g: g * 2 * ctx.saved_tensors[0].cos(),
                               setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))
        x = torch.randn(3).cuda().requires_grad_()
        print(sorted(torch.library.opcheck(sin2, (x,)).items()))
        print(torch.library.opcheck(sin2, (x,), test_utils="test_aot_dispatch_static"))
    """)
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == str(sorted((u, "SUCCESS") for u in ("test_schema", "test_autograd_registration",
                                                            "test_faketensor", "test_aot_dispatch_dynamic")))
    assert lines[1] == "{'test_aot_dispatch_static': 'SUCCESS'}"
