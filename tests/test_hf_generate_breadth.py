"""``generate()`` as programs beyond tests/test_decode.py use it, on 'cuda' against the local CPU
(tiny configs, no hub): what the program's own code sees of the decoding steps — its forward
hooks, its ``prefix_allowed_tokens_fn`` — is eager's, however far the client's loop runs ahead
of the gateway."""
from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("remote")

MASKED = torch.tensor([[False] * 5, [True, True, False, False, False]])
PROMPT = torch.tensor([[5, 9, 14, 3, 7], [0, 0, 21, 30, 40]])  # the second row left-padded


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()


def _early_eos() -> list[int]:
    """EOS tokens that stop both rows early: the ones greedy decoding picks at steps 3 and 4."""
    free = _llama().generate(PROMPT, attention_mask=(PROMPT != 0).long(), max_new_tokens=16, do_sample=False,
                             pad_token_id=0)
    return [int(free[0, 5 + 2]), int(free[1, 5 + 3])]


def _decode(dev: str, eos: list[int], watch: Callable[[torch.nn.Module, list], dict]) -> tuple[torch.Tensor, list]:
    """Greedy decoding stopped early by EOS, with what ``watch(model, seen)`` installs keeping what
    the program's code saw at each step."""
    model, seen = _llama().to(dev), []
    ids = PROMPT.to(dev)
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=16, do_sample=False,
                                pad_token_id=0, eos_token_id=eos, **watch(model, seen))
    return tokens.cpu(), [s.cpu() if isinstance(s, torch.Tensor) else s for s in seen]


def _assert_eager_steps(watch: Callable[[torch.nn.Module, list], dict]) -> None:
    eos = _early_eos()
    want_tokens, want_seen = _decode("cpu", eos, watch)
    got_tokens, got_seen = _decode("cuda", eos, watch)
    assert want_tokens.shape[1] < 5 + 16
    assert torch.equal(got_tokens, want_tokens)
    assert len(got_seen) == len(want_seen)
    for got, want in zip(got_seen, want_seen):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_forward_hooks_see_only_eager_steps():
    """A forward hook of the program's own (activation logging, steering) runs once per step eager
    decoding takes: a call decoded ahead of the gateway (decode.py) ran the steps after EOS too,
    undone in the tokens but not in what the hook had kept (7 steps more here, more on a slower
    link). Such a call takes the plain path, as a logits processor of the user's does."""
    def watch(model: torch.nn.Module, seen: list) -> dict:
        model.model.layers[-1].register_forward_hook(lambda mod, args, out: seen.append(out[:, -1].detach()))
        return {}
    _assert_eager_steps(watch)


def test_prefix_allowed_tokens_fn_sees_only_eager_steps():
    """``prefix_allowed_tokens_fn`` (constrained decoding: a trie walked from each row's tokens) is
    the program's function, called by transformers' processor at every step for every row: it was
    called for the undone steps too (three times as often here)."""
    def watch(model: torch.nn.Module, seen: list) -> dict:
        def allowed(row: int, tokens: torch.Tensor) -> list[int]:
            seen.append(tokens.shape[0])
            return list(range(64))
        return {"prefix_allowed_tokens_fn": allowed}
    _assert_eager_steps(watch)


def test_a_mask_given_new_data_between_calls_is_read_anew():
    """``mask.data = new`` between two calls (code that edits tensors in place through ``.data``):
    the first call kept a CPU copy of the mask (known.py) and ``set_data`` keeps the tensor's
    version counter, so the second call took the old copy for its values and decoded the row
    now left-padded as if it were not (other tokens, silently)."""
    def run(dev: str) -> list[torch.Tensor]:
        model, ids = _llama().to(dev), torch.tensor([[5, 9, 14, 3, 7], [8, 4, 21, 30, 40]], device=dev)
        mask = torch.ones_like(ids)
        first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        mask.data = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], device=dev)
        second = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        return [first.cpu(), second.cpu()]
    for got, want in zip(run("cuda"), run("cpu")):
        assert torch.equal(got, want)


@pytest.mark.parametrize("write", [
    lambda mask: mask.data[1, :2].zero_(),
    lambda mask: mask[1].data[:2].zero_(),  # (a view's .data: the mask's copy goes too)
    lambda mask: mask.untyped_storage().copy_(mask.masked_fill(MASKED.to(mask.device), 0).untyped_storage()),
], ids=["data", "view_data", "storage"])
def test_a_mask_written_through_data_between_calls_is_read_anew(write: Callable[[torch.Tensor], None]):
    """``mask.data[1, :2] = 0`` between two calls: a write through ``.data`` is kept from the
    tensor's version counter (PyTorch gives ``.data`` a counter of its own; a write through the
    storage bumps none), so the CPU copy the first call kept (known.py) still passed for the
    mask's values in the second call."""
    def run(dev: str) -> list[torch.Tensor]:
        model, ids = _llama().to(dev), torch.tensor([[5, 9, 14, 3, 7], [8, 4, 21, 30, 40]], device=dev)
        mask = torch.ones_like(ids)
        first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        write(mask)
        second = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        return [first.cpu(), second.cpu()]
    for got, want in zip(run("cuda"), run("cpu")):
        assert torch.equal(got, want)


def test_a_model_moved_to_cuda_under_inference_mode_generates():
    """Serving code that loads and moves its model inside ``torch.inference_mode()``: Module._apply
    asks ``torch._has_compatible_shallow_copy_type(param, moved)``, which autograd answers
    otherwise; with it off the question reached the dispatcher, went to the gateway with the CPU
    parameter and failed ('Expected all tensors to be on the same device'). On a GPU it is False,
    and the model moves."""
    def run(dev: str) -> tuple[torch.Tensor, set[str]]:
        with torch.inference_mode():
            model = _llama().to(dev)
            ids = PROMPT.to(dev)
            out = model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=4, do_sample=False,
                                 pad_token_id=0)
        return out.cpu(), {p.device.type for p in model.parameters()}
    (got, got_devices), (want, _) = run("cuda"), run("cpu")
    assert got_devices == {"cuda"}
    assert torch.equal(got, want)
