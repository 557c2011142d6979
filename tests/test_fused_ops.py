"""Composite ops sent to the gateway as the one fused op its device runs (SDPA, RNNs), against a
real gateway; every value is compared with the same computation in local PyTorch on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remotecuda

pytestmark = pytest.mark.usefixtures("remote")


def _ops(fn):
    """(fn's result, the number of ops it sent)."""
    torch.cuda.synchronize()
    before = remotecuda.stats()["ops"]
    out = fn()
    return out, remotecuda.stats()["ops"] - before


def _sdpa_both(q, k, v, mask=None, **kw):
    """SDPA locally and remotely, forward and backward: (local out, grads), (remote out, grads)."""
    results = []
    for dev in ("cpu", "cuda"):
        leaves = [t.detach().to(dev).requires_grad_() for t in (q, k, v)]
        m = None if mask is None else mask.to(dev)
        out = F.scaled_dot_product_attention(*leaves, attn_mask=m, **kw)
        (out * torch.arange(out.numel(), device=dev).view(out.shape).sin()).sum().backward()
        results.append((out.detach().cpu(), [t.grad.cpu() for t in leaves]))
    return results


# ---------------------------------------------------------------- scaled dot-product attention

def _padding_mask(b, heads, lq, lk, lengths):
    """(b, heads, lq, lk) True where a key is a real token; row 0's last query sees nothing."""
    mask = (torch.arange(lk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    mask = mask.expand(b, heads, lq, lk).clone()
    mask[0, :, -1, :] = False
    return mask


@pytest.mark.parametrize("shape", ["4d_broadcast_heads", "4d_full", "2d", "3d"])
def test_sdpa_boolean_mask_matches_local(shape):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    full = _padding_mask(2, 3, 5, 5, [5, 3])
    mask = {"4d_broadcast_heads": full[:, :1], "4d_full": full, "2d": full[1, 0], "3d": full[1]}[shape]
    (ref, ref_grads), (out, grads) = _sdpa_both(q, k, v, mask)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_sdpa_boolean_mask_runs_the_fused_kernel():
    q, k, v = (torch.randn(2, 3, 5, 8, device="cuda") for _ in range(3))
    mask = _padding_mask(2, 1, 5, 5, [5, 3]).cuda()
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # the backend choice, asked once
    _, n = _ops(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert n <= 6, f"mask conversion and one fused attention op, not the math path ({n} ops)"


@pytest.mark.parametrize("case", ["float_mask", "causal", "scale", "gqa", "gqa_mask", "3d_inputs"])
def test_sdpa_variants_match_local(case):
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    mask, kw = None, {}
    if case == "float_mask":
        mask = torch.randn(2, 1, 6, 6)
    elif case == "causal":
        kw = {"is_causal": True}
    elif case == "scale":
        kw = {"scale": 0.3}
    elif case.startswith("gqa"):
        k, v, kw = k[:, :2].contiguous(), v[:, :2].contiguous(), {"enable_gqa": True}
        if case == "gqa_mask":
            mask = _padding_mask(2, 1, 6, 6, [6, 2])
    elif case == "3d_inputs":
        q, k, v = q[0], k[0], v[0]
    (ref, ref_grads), (out, grads) = _sdpa_both(q, k, v, mask, **kw)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_sdpa_takes_its_arguments_by_keyword():
    """diffusers' attention dispatch (Flux, Wan, QwenImage...) calls it with ``query=``, ``key=``, ``value=``."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    mask = _padding_mask(2, 1, 5, 5, [5, 2])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for dev in ("cpu", "cuda"):
        got = F.scaled_dot_product_attention(query=q.to(dev), key=k.to(dev), value=v.to(dev), attn_mask=mask.to(dev),
                                             dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
        torch.testing.assert_close(got.cpu(), want)


def test_sdpa_dropout_with_boolean_mask_keeps_masked_keys_out():
    torch.manual_seed(2)
    q, k = torch.randn(2, 2, 4, 8, device="cuda"), torch.randn(2, 2, 4, 8, device="cuda")
    v = torch.ones(2, 2, 4, 8)
    v[:, :, 2:] = 1e6  # keys 2 and 3 are masked out: their values must never show
    mask = torch.tensor([True, True, False, False], device="cuda")
    out = F.scaled_dot_product_attention(q, k, v.cuda(), attn_mask=mask, dropout_p=0.5).cpu()
    assert out.abs().max() < 10
    assert not torch.allclose(out, torch.ones_like(out)), "without dropout every output would be 1"


# ---------------------------------------------------------------- Hugging Face models, padded batches

def _hf_model(name):
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, bos_token_id=0, eos_token_id=0, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls = transformers.GPT2LMHeadModel
    elif name == "llama":
        cfg = transformers.LlamaConfig(**small, num_key_value_heads=2, max_position_embeddings=16)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.BertConfig(**small, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, num_labels=3)
        cls = transformers.BertForSequenceClassification
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(cfg)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_hf_padded_batch_matches_local(name, side):
    model = _hf_model(name)
    remote_model = copy.deepcopy(model).cuda()
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (3, 7))
    attn = torch.ones(3, 7, dtype=torch.long)
    pad = (slice(None, 3) if side == "left" else slice(4, None))
    attn[1, pad] = 0
    attn[2, (slice(None, 1) if side == "left" else slice(6, None))] = 0
    labels = torch.randint(0, 3, (3,)) if name == "bert" else ids.masked_fill(attn == 0, -100)
    ref = model(input_ids=ids, attention_mask=attn, labels=labels)
    ref.loss.backward()
    out = remote_model(input_ids=ids.cuda(), attention_mask=attn.cuda(), labels=labels.cuda())
    out.loss.backward()
    keep = attn.bool() if name != "bert" else slice(None)
    torch.testing.assert_close(out.logits.detach().cpu()[keep], ref.logits.detach()[keep], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss.detach().cpu(), ref.loss.detach(), rtol=1e-4, atol=1e-5)
    for (n, p), (_, rp) in zip(remote_model.named_parameters(), model.named_parameters()):
        if rp.grad is not None:
            torch.testing.assert_close(p.grad.cpu(), rp.grad, rtol=1e-4, atol=1e-5, msg=n)


# ---------------------------------------------------------------- recurrent layers

def _run_rnn(m, x, dev, hx=None, packed_lengths=None):
    """m(x) on ``dev`` with a gradient through everything: (outputs, grads of x, hx and weights)."""
    x = x.detach().to(dev).requires_grad_()
    hx = None if hx is None else tuple(h.detach().to(dev).requires_grad_() for h in hx)
    inp = x
    if packed_lengths is not None:
        inp = nn.utils.rnn.pack_padded_sequence(x, packed_lengths, batch_first=m.batch_first, enforce_sorted=False)
    h_arg = None if hx is None else (hx if isinstance(m, nn.LSTM) else hx[0])
    out, h = m(inp, h_arg)
    if packed_lengths is not None:
        out = nn.utils.rnn.pad_packed_sequence(out, batch_first=m.batch_first)[0]
    hs = h if isinstance(h, tuple) else (h,)
    loss = out.sin().sum() + sum((t * t).sum() for t in hs)
    loss.backward()
    grads = [x.grad, *(() if hx is None else (t.grad for t in hx)), *(p.grad for p in m.parameters())]
    return [t.detach().cpu() for t in (out, *hs, *grads)]


RNN_CASES = {
    "lstm": (nn.LSTM, {}),
    "lstm_bidirectional_batch_first": (nn.LSTM, dict(bidirectional=True, batch_first=True)),
    "lstm_proj": (nn.LSTM, dict(proj_size=3)),
    "lstm_proj_bidirectional": (nn.LSTM, dict(proj_size=3, bidirectional=True)),
    "gru_bidirectional": (nn.GRU, dict(bidirectional=True)),
    "gru_batch_first": (nn.GRU, dict(batch_first=True)),
    "rnn_tanh": (nn.RNN, {}),
    "rnn_relu_bidirectional": (nn.RNN, dict(nonlinearity="relu", bidirectional=True)),
}


@pytest.mark.parametrize("case", list(RNN_CASES))
@pytest.mark.parametrize("inputs", ["padded", "with_hx", "packed"])
def test_rnn_matches_local(case, inputs):
    cls, kw = RNN_CASES[case]
    torch.manual_seed(0)
    m = cls(4, 6, num_layers=2, **kw)
    x = torch.randn(3, 5, 4) if m.batch_first else torch.randn(5, 3, 4)
    hx = lengths = None
    if inputs == "with_hx":
        d = 2 if m.bidirectional else 1
        hx = (torch.randn(2 * d, 3, m.proj_size or 6), torch.randn(2 * d, 3, 6))[:2 if cls is nn.LSTM else 1]
    elif inputs == "packed":
        lengths = torch.tensor([3, 5, 2])
    ref = _run_rnn(m, x, "cpu", hx, lengths)
    got = _run_rnn(copy.deepcopy(m).cuda(), x, "cuda", hx, lengths)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def test_rnn_is_one_op_each_way():
    m = nn.LSTM(8, 16, num_layers=2).cuda()
    x = torch.randn(35, 4, 8, device="cuda")
    m(x)[0].sum().backward()  # (a first step's one-time work, the gradients' creation, is not counted)
    (out, _), n_fwd = _ops(lambda: m(x))
    _, n_bwd = _ops(lambda: out.sum().backward())
    assert n_fwd <= 3, f"one rc::rnn op (and the zero initial state), not one per time step ({n_fwd} ops)"
    assert n_bwd <= 12, f"one rc::rnn_backward op and the gradients' accumulation ({n_bwd} ops)"


def test_rnn_dropout_between_layers_matches_local_with_the_same_seed():
    torch.manual_seed(0)
    m = nn.LSTM(4, 6, num_layers=3, dropout=0.5)
    rm = copy.deepcopy(m).cuda()
    x = torch.randn(5, 3, 4)
    torch.manual_seed(7)
    ref, _ = m(x)
    torch.manual_seed(7)  # also seeds the gateway's generator, which the same kernel draws from
    out, _ = rm(x.cuda())
    torch.testing.assert_close(out.detach().cpu(), ref.detach())
    m.eval()
    rm.eval()
    with torch.no_grad():
        torch.testing.assert_close(rm(x.cuda())[0].cpu(), m(x)[0])


def test_lstm_language_model_trains_as_locally():
    """Truncated backpropagation through time, as pytorch/examples' word_language_model does it."""
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.rnn, self.dec = nn.Embedding(50, 8), nn.LSTM(8, 16, 2), nn.Linear(16, 50)

        def forward(self, x, h):
            out, h = self.rnn(self.enc(x), h)
            return self.dec(out).view(-1, 50), h

    torch.manual_seed(0)
    data = torch.randint(0, 50, (31, 4))
    losses = {}
    for dev in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = LM().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        h = (torch.zeros(2, 4, 16, device=dev), torch.zeros(2, 4, 16, device=dev))
        losses[dev] = []
        for i in range(0, 30, 10):
            x, y = data[i:i + 10].to(dev), data[i + 1:i + 11].to(dev)
            h = tuple(t.detach() for t in h)
            opt.zero_grad()
            out, h = model(x, h)
            loss = F.cross_entropy(out, y.reshape(-1))
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            losses[dev].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["cuda"]), torch.tensor(losses["cpu"]))


def test_rnn_backward_twice_needs_retain_graph_as_locally():
    m = nn.GRU(3, 4).cuda()
    out, _ = m(torch.randn(6, 2, 3, device="cuda"))
    out.sum().backward(retain_graph=True)
    first = m.weight_hh_l0.grad.cpu().clone()
    out.sum().backward()
    torch.testing.assert_close(m.weight_hh_l0.grad.cpu(), 2 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


def test_rnn_under_cuda_autocast_runs_in_half_precision():
    """As cuDNN's RNN does under torch.autocast('cuda'): inputs and weights cast, gradients to the fp32 weights."""
    torch.manual_seed(0)
    m = nn.LSTM(4, 6).cuda()
    x = torch.randn(5, 3, 4, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, (h, c) = m(x)
    assert out.dtype == h.dtype == c.dtype == torch.bfloat16
    out.float().sum().backward()
    assert m.weight_ih_l0.grad.dtype == torch.float32
    ref = copy.deepcopy(m).cpu()
    ref_out, _ = ref.to(torch.bfloat16)(x.cpu().to(torch.bfloat16))
    torch.testing.assert_close(out.float().cpu(), ref_out.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_backend_is_chosen_as_for_the_clients_inputs(grad, masked):
    """The gateway picks the backend with q, k, v requiring grad as the client's do (its own
    tensors never do; a GPU picks differently for training and inference)."""
    q, k, v = (torch.randn(2, 4, 16, 32) for _ in range(3))
    mask = torch.rand(2, 1, 16, 16) > 0.3 if masked else None
    rq, rk, rv = (t.cuda() for t in (q, k, v))
    rmask = mask.cuda() if masked else None
    got = rq._s.request("rc::sdp_choice", [rq._h, rk._h, rv._h, rmask._h if masked else None,
                                            0.0, False, None, False, grad])
    want = torch.ops.aten._fused_sdp_choice(*(t.requires_grad_(grad) for t in (q, k, v)), mask, 0.0, False)
    assert got == int(want)
