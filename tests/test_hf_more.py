"""More of what Hugging Face users run, unchanged, on 'cuda' against the local CPU (tiny configs,
no hub): mixture-of-experts models (transformers' own ``grouped_mm_fallback`` custom op and
``histc`` on int32, both chosen because the device is 'cuda'), architectures with unusual ops
(softcapping and sliding windows, ALiBi, a selective scan, relative attention, shifted windows,
CTC), generation beyond greedy (beam search with scores and several returned sequences,
repetition and n-gram penalties, forced and banned tokens, left-padded EOS), loading with
``device_map='cuda:0'`` (weights moved in a thread pool), and an Accelerate training loop with
gradient accumulation. tests/test_hf_architectures.py covers the plainer architectures.

Sampling draws from the gateway's generator, not the CPU's: sampled tokens are compared by
shape and repeatability under one seed, as on a GPU.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import interception_removed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
T = transformers

IDS = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(1))
PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
WAVE = torch.randn(2, 400, generator=torch.Generator().manual_seed(3))
DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)
PROMPTS = [[5, 9, 14, 3, 7], [7, 8], [21, 30, 40]]


def _causal(m: torch.nn.Module, dev: str, padded: bool = True) -> tuple:
    """A loss on a batch (its second row left-padded where ``padded``), and greedy decoding."""
    x = IDS.to(dev)
    mask = torch.ones_like(x)
    if padded:
        mask[1, :3] = 0
    out = m(input_ids=x, attention_mask=mask if padded else None, labels=x)
    return out, lambda: m.generate(x[:, :5], attention_mask=mask[:, :5], max_new_tokens=5, do_sample=False,
                                   pad_token_id=0)


def _moe(m: torch.nn.Module, dev: str) -> tuple:
    return _causal(m, dev, padded=False)  # (transformers' load-balancing loss refuses a mask here)


def _labels(dev: str) -> torch.Tensor:
    return torch.tensor([0, 2], device=dev)


MODELS: dict[str, tuple[Callable, Callable]] = {
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(
        **DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1)), _moe),
    "qwen2_moe": (lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **DECODER, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, output_router_logits=True, decoder_sparse_step=1)), _moe),
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
        **DECODER, num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, attn_implementation="eager")), _causal),
    "falcon_alibi": (lambda: T.FalconForCausalLM(T.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
        new_decoder_architecture=False, multi_query=True, parallel_attn=True)), _causal),
    "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        use_mambapy=False)), lambda m, dev: _causal(m, dev, padded=False)),
    "deberta_v2": (lambda: T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, relative_attention=True, position_buckets=8, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"])),
        lambda m, dev: (m(input_ids=IDS.to(dev), labels=IDS.to(dev)), None)),
    "swin": (lambda: T.SwinForImageClassification(T.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 2], num_heads=[2, 4], window_size=4, num_labels=3,
        drop_path_rate=0.0)),
        lambda m, dev: (m(pixel_values=PIXELS.to(dev), labels=_labels(dev)), None)),
    "wav2vec2_ctc": (lambda: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, layerdrop=0.0, mask_time_prob=0.0, attention_dropout=0.0,
        ctc_loss_reduction="mean", pad_token_id=0, do_stable_layer_norm=True, feat_extract_norm="layer")),
        lambda m, dev: (m(input_values=WAVE.to(dev), labels=torch.tensor([[3, 4, 5, 6], [7, 8, -100, -100]],
                                                                           device=dev)), None)),
}


def _train_step(make: Callable, step: Callable, dev: str) -> dict[str, torch.Tensor]:
    """Forward with a loss, backward, one AdamW step, the loss after it, then ``generate()``."""
    torch.manual_seed(0)
    model = make()
    for mod in model.modules():  # (configs name their dropouts differently; none is wanted here)
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out, generate = step(model, dev)
    out.loss.backward()
    found = {"loss": out.loss, "logits": out.logits,
             "grads": torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])}
    if getattr(out, "aux_loss", None) is not None:
        found["aux_loss"] = out.aux_loss
    opt.step()
    opt.zero_grad()
    found["loss_after"] = step(model, dev)[0].loss
    if generate is not None:
        model.eval()
        with torch.no_grad():
            found["tokens"] = generate()
    return {k: v.detach().cpu() for k, v in found.items()}


def _assert_same(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{what} {k}: {m}")


@pytest.mark.parametrize("name", list(MODELS))
def test_architecture_trains_and_generates_as_local(remote, name):
    make, step = MODELS[name]
    _assert_same(_train_step(make, step, "cuda"), _train_step(make, step, "cpu"), name)


# ---------------------------------------------------------------------------- generation

def _gpt2() -> torch.nn.Module:
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=0))


def _llama() -> torch.nn.Module:
    return T.LlamaForCausalLM(T.LlamaConfig(**DECODER, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                            pad_token_id=0))


def _t5() -> torch.nn.Module:
    return T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                                   eos_token_id=1))


GENERATIONS: dict[str, tuple[Callable, dict]] = {
    "gpt2_beams_scores": (_gpt2, dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, length_penalty=0.7,
                                      output_scores=True, return_dict_in_generate=True)),
    "gpt2_forced_and_banned": (_gpt2, dict(max_new_tokens=6, forced_eos_token_id=2, suppress_tokens=[40, 49, 7],
                                           begin_suppress_tokens=[8, 33], bad_words_ids=[[38], [20, 18]],
                                           sequence_bias={(12,): 5.0, (16,): -10.0})),
    "llama_penalties": (_llama, dict(max_new_tokens=8, repetition_penalty=1.5, no_repeat_ngram_size=2,
                                     min_new_tokens=6)),
    "llama_left_padded_eos": (_llama, dict(max_new_tokens=10, eos_token_id=[2, 7, 11, 20], pad_token_id=0)),
    "llama_beams_early_stop": (_llama, dict(max_new_tokens=10, num_beams=3, early_stopping=True,
                                            eos_token_id=[7, 11, 20])),
    "llama_logits": (_llama, dict(max_new_tokens=4, output_scores=True, output_logits=True,
                                  return_dict_in_generate=True, renormalize_logits=True)),
    "t5_beams": (_t5, dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, output_scores=True,
                           return_dict_in_generate=True, no_repeat_ngram_size=2, repetition_penalty=1.3)),
}


def _generate(make: Callable, dev: str, **kwargs: object) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    m = make().to(dev).eval()
    if m.config.is_encoder_decoder:
        ids = torch.tensor([p + [1] + [0] * (5 - len(p)) for p in PROMPTS])
    else:  # left-padded, as for batched decoding
        ids = torch.tensor([[0] * (5 - len(p)) + p for p in PROMPTS])
    ids = ids.to(dev)
    with torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=(ids != 0).long(), do_sample=kwargs.pop("do_sample", False),
                         **kwargs)
    if isinstance(out, torch.Tensor):
        return {"sequences": out.cpu()}
    found = {"sequences": out.sequences, "scores": torch.stack(out.scores)}
    for key in ("logits", "sequences_scores", "beam_indices"):
        if getattr(out, key, None) is not None:
            value = getattr(out, key)
            found[key] = torch.stack(value) if isinstance(value, tuple) else value
    return {k: v.cpu() for k, v in found.items()}


@pytest.mark.parametrize("name", list(GENERATIONS))
def test_generation_matches_local(remote, name):
    make, kwargs = GENERATIONS[name]
    _assert_same(_generate(make, "cuda", **kwargs), _generate(make, "cpu", **kwargs), name)


def test_static_cache_generation_matches_local(remote):
    """``cache_implementation='static'`` on 'cuda' makes transformers compile the decoding step;
    the cache is an object the trace would change (not a graph input), so it runs eagerly, saying
    so plainly."""
    kwargs = dict(max_new_tokens=4, cache_implementation="static")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _generate(_llama, "cuda", **kwargs)
    _assert_same(got, _generate(_llama, "cpu", **kwargs), "static cache")
    said = [str(w.message) for w in caught if "remotecuda" in str(w.message)]
    assert said and all("it takes a StaticCache, an object the trace would change" in m for m in said), said


@pytest.mark.parametrize("make", [_llama, _t5], ids=["llama", "t5"])
def test_sampling_repeats_under_one_seed(remote, make):
    """top-k / top-p / temperature and several sequences per prompt: the gateway's generator is
    not the CPU's, so the tokens are checked for shape, prompt, vocabulary and repeatability."""
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        runs.append(_generate(make, "cuda", do_sample=True, max_new_tokens=6, top_k=10, top_p=0.9,
                              temperature=0.7, num_return_sequences=2)["sequences"])
    local = _generate(make, "cpu", do_sample=True, max_new_tokens=6, top_k=10, top_p=0.9, temperature=0.7,
                      num_return_sequences=2)["sequences"]
    assert runs[0].shape == local.shape
    assert torch.equal(runs[0], runs[1])
    assert bool(((runs[0] >= 0) & (runs[0] < 64)).all())
    if not make().config.is_encoder_decoder:
        assert torch.equal(runs[0][:, :5], local[:, :5])


# ---------------------------------------------------------------------------- what MoE models needed

def test_library_custom_op_runs_its_kernel_on_the_client(remote):
    """A ``torch.library.custom_op`` (transformers' MoE ``grouped_mm_fallback``; a user's own) is
    no op a gateway knows: its kernel runs on the client, with its factories and ops remote, and
    its registered autograd formula gives the gradients."""
    ns = "rc_test_hf_more"
    if not hasattr(torch.ops, ns) or not hasattr(getattr(torch.ops, ns), "scaled_rows"):
        @torch.library.custom_op(f"{ns}::scaled_rows", mutates_args=())
        def scaled_rows(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(x.shape, device=x.device, dtype=x.dtype)  # a factory on x's device
            start = 0
            for i, n in enumerate(counts.tolist()):
                out[start:start + n] = x[start:start + n] * (i + 1)
                start += n
            return out

        @scaled_rows.register_fake
        def _(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(x)

        def backward(ctx, grad):  # noqa: ANN001, ANN202 - torch's signature
            return torch.ops.rc_test_hf_more.scaled_rows(grad, ctx.counts), None

        def setup(ctx, inputs, output):  # noqa: ANN001, ANN202
            ctx.counts = inputs[1]
        scaled_rows.register_autograd(backward, setup_context=setup)

    def run(dev: str) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.arange(12.0).reshape(6, 2).to(dev).requires_grad_()
        y = torch.ops.rc_test_hf_more.scaled_rows(x, torch.tensor([2, 3, 1], device=dev))
        (y * y).sum().backward()
        return y.detach().cpu(), x.grad.cpu()

    for got, expected in zip(run("cuda"), run("cpu")):
        torch.testing.assert_close(got, expected)


def test_histc_on_integers_as_cuda_computes_it(remote):
    """CUDA's histc takes integer tensors (transformers counts tokens per expert with int32 on
    'cuda'); a gateway serving with its CPU, whose kernel takes only floats, gives CUDA's counts."""
    t = torch.tensor([0, 3, 1, 3, 2, 9, -1, 3, 5], dtype=torch.int32)
    got = torch.histc(t.cuda(), bins=4, min=0, max=3)
    assert got.dtype == torch.int32
    assert got.cpu().tolist() == [1, 1, 1, 3]
    every = torch.histc(t.to(torch.int64).cuda(), bins=5)  # min == max: the values' own range, [-1, 9]
    assert every.cpu().tolist() == torch.histc(t.double(), bins=5).long().tolist()
    floats = torch.histc(t.float().cuda(), bins=4, min=0, max=3)
    assert floats.dtype == torch.float32 and floats.cpu().tolist() == [1.0, 1.0, 1.0, 3.0]


# ---------------------------------------------------------------------------- threads, loading, Accelerate

def test_threads_started_while_active_use_cuda(remote):
    """A GPU is the whole process's: a thread pool started from the active thread makes and
    moves 'cuda' tensors as that thread does."""
    x = torch.arange(6.0)

    def work() -> torch.Tensor:
        y = x.to("cuda") + torch.ones(6, device="cuda")
        return y.cuda() * torch.tensor(2.0, device="cuda")

    with ThreadPoolExecutor(2) as pool:
        got = [f.result() for f in [pool.submit(work) for _ in range(3)]]
        # as deactivate() leaves them: plain PyTorch, whose CPU build refuses 'cuda'
        with interception_removed(), pytest.raises((AssertionError, RuntimeError), match="cuda|CUDA"):
            pool.submit(lambda: torch.ones(2).to("cuda")).result()
    for y in got:
        assert y.device.type == "cuda"
        torch.testing.assert_close(y.cpu(), (x + 1) * 2)


def test_to_an_int_device_means_cuda(remote):
    """``model.to(local_rank)``, ``x.to(0)``: an int is the accelerator, 'cuda:N' here (a CPU-only
    torch's C++ says there is none)."""
    lin = torch.nn.Linear(2, 3).to(0)
    x = torch.arange(4.0).reshape(2, 2)
    for y in (x.to(0), x.to(0, torch.float64), x.to(device=0, non_blocking=True), lin(x.to(0))):
        assert y.device == torch.device("cuda", 0)
    assert lin.weight.device.type == "cuda"
    torch.testing.assert_close(x.to(0, torch.float64).cpu(), x.double())


def test_from_pretrained_with_device_map_cuda(remote, tmp_path):
    """transformers loads a checkpoint's weights onto ``device_map``'s device in a thread pool."""
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path)
    local = T.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = T.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda:0", use_kernels=False)
    assert all(p.device.type == "cuda" for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS.cuda()).logits.cpu(), local(input_ids=IDS).logits,
                                   rtol=1e-4, atol=1e-5)


def _accelerate_loop(dev: str, checkpoint: str) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    acc = Accelerator(gradient_accumulation_steps=2, cpu=dev == "cpu")
    torch.manual_seed(0)
    model = _gpt2()
    data = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=8)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    losses, norms = [], []
    for _ in range(2):
        for (x,) in loader:
            with acc.accumulate(model):
                out = model(input_ids=x, labels=x)
                acc.backward(out.loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), 1.0))
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(acc.gather(out.loss.detach()))
    assert acc.device.type == ("cpu" if dev == "cpu" else "cuda")
    params = torch.stack([p.detach().sum() for p in acc.unwrap_model(model).parameters()])
    # a checkpoint (safetensors: tied tensors found by storage pointer) restores every weight
    acc.save_state(checkpoint)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(checkpoint)
    restored = torch.stack([p.detach().sum() for p in acc.unwrap_model(model).parameters()])
    AcceleratorState._reset_state(True)
    return {"losses": torch.stack(losses).cpu(), "norms": torch.stack(norms).cpu(), "params": params.cpu(),
            "restored": restored.cpu()}


def test_accelerate_gradient_accumulation_matches_local(remote, tmp_path):
    got = _accelerate_loop("cuda", str(tmp_path / "cuda"))
    _assert_same(got, _accelerate_loop("cpu", str(tmp_path / "cpu")), "accelerate")
    torch.testing.assert_close(got["restored"], got["params"])
