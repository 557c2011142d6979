""""Learning PyTorch with Examples" and "Extending PyTorch" (custom autograd Functions), shrunk:
a third-order polynomial fitted to sin(x) with tensors and hand-written gradients, then with
autograd and manual ``-=`` updates under ``no_grad``, then through the tutorial's
``LegendrePolynomial3`` Function; then the ``ctx`` machinery the extending guide documents:
``save_for_backward``, ``needs_input_grad``, ``mark_non_differentiable`` (a sort that returns
its indices), ``set_materialize_grads(False)`` (a backward given None), ``mark_dirty`` (an
in-place Function), ``once_differentiable``, a ``setup_context`` Function with a ``jvp``
(forward-mode AD) and ``generate_vmap_rule`` (per-sample gradients of a model through it by
``vmap(grad(...))`` of a ``functional_call``), a double-differentiable Function, and
``gradcheck``/``gradgradcheck`` on the device."""
import json
import math

import torch
from torch.autograd.function import once_differentiable

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.float
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)


def r(*shape, dt=dtype):
    return torch.randn(*shape, generator=gen, dtype=dt).to(device)


out = {}

# --- tensors and hand-written gradients
x = torch.linspace(-math.pi, math.pi, 200, device=device, dtype=dtype)
y = torch.sin(x)
out["device"] = str(x.device)
a, b, c, d = r(()), r(()), r(()), r(())
learning_rate = 1e-6
losses = []
for t in range(60):
    y_pred = a + b * x + c * x ** 2 + d * x ** 3
    loss = (y_pred - y).pow(2).sum().item()
    if t % 20 == 19:
        losses.append(loss)
    grad_y_pred = 2.0 * (y_pred - y)
    grad_a = grad_y_pred.sum()
    grad_b = (grad_y_pred * x).sum()
    grad_c = (grad_y_pred * x ** 2).sum()
    grad_d = (grad_y_pred * x ** 3).sum()
    a -= learning_rate * grad_a
    b -= learning_rate * grad_b
    c -= learning_rate * grad_c
    d -= learning_rate * grad_d
out["tensors"] = {"losses": losses, "coef": [a.item(), b.item(), c.item(), d.item()]}

# --- autograd, manual updates
a, b, c, d = (r((), ).requires_grad_() for _ in range(4))
losses = []
for t in range(60):
    y_pred = a + b * x + c * x ** 2 + d * x ** 3
    loss = (y_pred - y).pow(2).sum()
    if t % 20 == 19:
        losses.append(loss.item())
    loss.backward()
    with torch.no_grad():
        a -= learning_rate * a.grad
        b -= learning_rate * b.grad
        c -= learning_rate * c.grad
        d -= learning_rate * d.grad
        a.grad = None
        b.grad = None
        c.grad = None
        d.grad = None
out["autograd"] = {"losses": losses, "coef": [a.item(), b.item(), c.item(), d.item()]}


# --- the tutorial's LegendrePolynomial3
class LegendrePolynomial3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(input)
        return 0.5 * (5 * input ** 3 - 3 * input)

    @staticmethod
    def backward(ctx, grad_output):
        input, = ctx.saved_tensors
        return grad_output * 1.5 * (5 * input ** 2 - 1)


a = torch.full((), 0.0, device=device, dtype=dtype, requires_grad=True)
b = torch.full((), -1.0, device=device, dtype=dtype, requires_grad=True)
c = torch.full((), 0.0, device=device, dtype=dtype, requires_grad=True)
d = torch.full((), 0.3, device=device, dtype=dtype, requires_grad=True)
learning_rate = 5e-6
losses = []
for t in range(60):
    P3 = LegendrePolynomial3.apply
    y_pred = a + b * P3(c + d * x)
    loss = (y_pred - y).pow(2).sum()
    if t % 20 == 19:
        losses.append(loss.item())
    loss.backward()
    with torch.no_grad():
        for p in (a, b, c, d):
            p -= learning_rate * p.grad
            p.grad = None
out["legendre"] = {"losses": losses, "coef": [a.item(), b.item(), c.item(), d.item()]}


# --- the extending guide's LinearFunction: needs_input_grad decides what backward computes
class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        output = input.mm(weight.t())
        if bias is not None:
            output += bias.unsqueeze(0).expand_as(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        computed.append(list(ctx.needs_input_grad))
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.mm(weight)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.t().mm(input)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0)
        return grad_input, grad_weight, grad_bias


computed = []
inp = r(5, 4).requires_grad_()
w = r(3, 4).requires_grad_()
bias = r(3)
LinearFunction.apply(inp, w, bias).pow(2).sum().backward()
w2 = r(3, 4)
g_only_input = torch.autograd.grad(LinearFunction.apply(inp, w2).sum(), inp)[0]
ld = r(2, 4, dt=torch.double).requires_grad_()
wd = r(3, 4, dt=torch.double).requires_grad_()
bd = r(3, dt=torch.double).requires_grad_()
out["linear"] = {"needs": computed, "ginp": inp.grad.sum().item(), "gw": w.grad.sum().item(),
                 "g_only_input": g_only_input.sum().item(), "needs_after": computed[-1],
                 "gradcheck": torch.autograd.gradcheck(LinearFunction.apply, (ld, wd, bd))}


# --- mark_non_differentiable: a sort whose indices carry no gradient
class SortFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        values, idx = torch.sort(x, dim=-1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(idx)
        return values, idx

    @staticmethod
    def backward(ctx, g_values, g_idx):
        idx, = ctx.saved_tensors
        return torch.zeros_like(g_values).scatter_(-1, idx, g_values)


xs = r(3, 5).requires_grad_()
vals, idx = SortFn.apply(xs)
(vals * torch.arange(5, device=device)).sum().backward()
out["sort"] = {"idx": idx.tolist(), "idx_requires_grad": idx.requires_grad, "grad": xs.grad.tolist(),
               "vals_requires_grad": vals.requires_grad}


# --- set_materialize_grads(False): backward sees None for an output that was not used
class SplitScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.set_materialize_grads(False)
        ctx.k = k
        return x.clone(), x * k

    @staticmethod
    def backward(ctx, g1, g2):
        seen.append([g1 is None, g2 is None])
        gx = torch.zeros(())
        if g1 is not None:
            gx = g1
        if g2 is not None:
            gx = gx + g2 * ctx.k
        return gx, None


seen = []
xm = r(4).requires_grad_()
o1, o2 = SplitScale.apply(xm, 3.0)
o2.sum().backward()
g_second = xm.grad.clone()
xm.grad = None
o1, o2 = SplitScale.apply(xm, 3.0)
(o1 * 2).sum().backward()
out["materialize"] = {"seen": seen, "g_second": g_second.tolist(), "g_first": xm.grad.tolist()}


# --- mark_dirty: an in-place Function
class InplaceMulAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.mark_dirty(x)
        ctx.s = s
        return x.mul_(s).add_(1)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return g * ctx.s, None


leaf = r(4).requires_grad_()
z = leaf * 1.0
z2 = InplaceMulAdd.apply(z, 2.5)
z2.pow(2).sum().backward()
out["dirty"] = {"same": z2 is z, "version": z._version > 0, "grad": leaf.grad.tolist(),
                "value": z2.tolist()}
try:
    gg = r(3).requires_grad_()
    h = InplaceMulAdd.apply(gg * 1.0, 2.0)
    torch.autograd.grad(torch.autograd.grad(h.sum(), gg, create_graph=True)[0].sum(), gg)
    out["once_differentiable_error"] = "none"
except RuntimeError as e:
    out["once_differentiable_error"] = "once_differentiable" in str(e) or "does not require grad" in str(e)


# --- setup_context style with a jvp and a generated vmap rule
class MyExp(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.exp(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        result, = ctx.saved_tensors
        return g * result

    @staticmethod
    def jvp(ctx, x_t):
        result, = ctx.saved_tensors
        return x_t * result


xe = r(6) * 0.3
tangent = r(6)
import torch.autograd.forward_ad as fwAD  # noqa: E402

with fwAD.dual_level():
    dual = fwAD.make_dual(xe, tangent)
    jvp_out = fwAD.unpack_dual(MyExp.apply(dual)).tangent
vm = torch.vmap(MyExp.apply)(xe.view(2, 3))
gx = torch.func.grad(lambda t: MyExp.apply(t).sum())(xe)
jac = torch.func.jacrev(MyExp.apply)(xe[:3])
head = torch.nn.Linear(6, 2).to(device)
params = {k: v.detach() for k, v in head.named_parameters()}


def head_loss(p, inp):
    return MyExp.apply(torch.func.functional_call(head, p, (inp,)) * 0.1).sum()


per_sample = torch.func.vmap(torch.func.grad(head_loss), in_dims=(None, 0))(params, r(4, 6))
out["setup_context"] = {"jvp": jvp_out.tolist(), "vmap": vm.tolist(), "grad": gx.tolist(),
                        "jac_diag": torch.diagonal(jac).tolist(),
                        "per_sample": {k: v.sum(-1).tolist() for k, v in per_sample.items()}}


# --- a double-differentiable Function (its backward is built from differentiable ops)
class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return g * 3 * x ** 2


xc = r(5, dt=torch.double).requires_grad_()
g1, = torch.autograd.grad(Cube.apply(xc).sum(), xc, create_graph=True)
g2, = torch.autograd.grad(g1.sum(), xc)
out["double"] = {"g1": g1.tolist(), "g2": g2.tolist(),
                 "gradgradcheck": torch.autograd.gradgradcheck(Cube.apply, (xc,))}
print(json.dumps(out))
