"""FlexAttention on 'cuda' (remotecuda/flex_attention.py): eager calls with a block mask and a
``score_mod`` that captures a tensor, gradients, GQA with the log-sum-exp, the user's
``torch.compile(flex_attention)``, and a Hugging Face model with ``attn_implementation=
"flex_attention"``, against the same attention written out on the CPU (torch's CPU flex_attention
has no backward) — without a warning a GPU would not give."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

pytestmark = pytest.mark.usefixtures("remote")
TOL = dict(atol=1e-5, rtol=1e-4)


def _qkv(heads_kv: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 16, 8, generator=g), torch.randn(2, heads_kv, 16, 8, generator=g),
            torch.randn(2, heads_kv, 16, 8, generator=g), torch.randn(16, 16, generator=g))


def _written_out(q, k, v, bias, mask: torch.Tensor) -> torch.Tensor:
    i = torch.arange(16)
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    s = q @ k.transpose(-1, -2) * 8 ** -0.5 + bias + (i[:, None] - i[None, :])
    return torch.where(mask, s, float("-inf")).softmax(-1) @ v


def _no_remotecuda_warning(caught: list) -> None:
    assert not [w for w in caught if "remotecuda" in str(w.message)], [str(w.message) for w in caught]


def test_flex_attention_with_a_block_mask_and_a_score_mod_trains_as_on_a_gpu():
    q, k, v, bias = _qkv(heads_kv=4)
    i = torch.arange(16)
    causal = i[:, None] >= i[None, :]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = _written_out(*leaves, bias, causal)
    expected.square().sum().backward()

    cq, ck, cv = (x.cuda().requires_grad_() for x in (q, k, v))
    cbias = bias.cuda()

    def relative(score, b, h, qi, ki):
        return score + cbias[qi, ki] + (qi - ki)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 16, 16, device="cuda")
        out = flex_attention(cq, ck, cv, score_mod=relative, block_mask=mask)
        out.square().sum().backward()
    _no_remotecuda_warning(caught)
    assert out.is_cuda and cq.grad.is_cuda
    torch.testing.assert_close(out.cpu(), expected.detach(), **TOL)
    for remote, local in zip((cq, ck, cv), leaves):
        torch.testing.assert_close(remote.grad.cpu(), local.grad, **TOL)


def test_compiled_flex_attention_with_gqa_returns_the_log_sum_exp():
    q, k, v, bias = _qkv()
    expected, expected_lse = flex_attention(q, k, v, enable_gqa=True, return_lse=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(flex_attention)
        out, lse = compiled(q.cuda(), k.cuda(), v.cuda(), enable_gqa=True, return_lse=True)
    _no_remotecuda_warning(caught)
    torch.testing.assert_close((out.cpu(), lse.cpu()), (expected, expected_lse), **TOL)


def test_a_hugging_face_model_with_flex_attention_matches_eager_attention():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.arange(16).view(1, 16) % 60 + 3

    def step(attn: str, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=attn).to(dev)
        out = m(input_ids=ids.to(dev), labels=ids.to(dev))
        out.loss.backward()
        return out.logits.detach().cpu(), m.model.layers[0].self_attn.q_proj.weight.grad.cpu()

    expected = step("eager", "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step("flex_attention", "cuda")
    _no_remotecuda_warning(caught)
    torch.testing.assert_close(got, expected, **TOL)


def test_higher_order_ops_run_on_cpu_tensors_while_active_and_say_so_on_cuda_ones():
    q = torch.randn(1, 2, 8, 4)
    assert flex_attention(q, q, q).shape == q.shape  # (torch's own op: the dispatch mode lets it by)
    torch.testing.assert_close(torch.cond(q.sum() > 0, lambda x: x + 1, lambda x: x - 1, (q,)),
                               q + 1 if q.sum() > 0 else q - 1)
    from torch._higher_order_ops.scan import scan
    x = q.cuda()
    with pytest.raises(NotImplementedError, match="remotecuda: torch's higher-order op scan is not supported"):
        scan(lambda c, x: (c + x, c * 2), x[0], x)
