"""More Hugging Face architectures, from tiny seeded configs (no weights, no hub), unchanged on
'cuda' against the local CPU: forward logits and loss, backward, one AdamW step, and where the
model generates greedy, beam (3 beams, with scores) and seeded sampling. The variety this adds:
Reformer's reversible layers (the backward replays dropout and LSH rotations by reseeding from
``torch.cuda.default_generators[i].seed()``), XLNet's two-stream attention, BigBird's block-sparse
attention, LongT5's transient-global attention, Marian, GPT-J's rotary, RecurrentGemma's
recurrent blocks, FalconMamba and Jamba's hybrid scan, PatchTST and the time-series transformer's
distribution heads (their forecasts are sampled), EnCodec's codebooks, Perceiver; and
``generate()`` with a static cache, an assistant model, and a ``TextIteratorStreamer``. The
sweep that chose them also ran OPT, CodeGen, Cohere, StableLM, Granite, RWKV, Bamba, Zamba2,
Pegasus, BigBird-Pegasus, ConvNeXt(V2), DINOv2, SigLIP, HuBERT and SpeechT5 (all matched)."""
from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable

import pytest
import torch
from local_parity import assert_architecture_matches_local

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
T = transformers

pytestmark = pytest.mark.usefixtures("remote")

IDS = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(1))
LONG = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(2))
_g = torch.Generator().manual_seed(4)
PAST, FUTURE = torch.randn(2, 32, 3, generator=_g), torch.randn(2, 8, 3, generator=_g)
TS = dict(past_values=torch.randn(2, 19, generator=_g).abs(), past_time_features=torch.randn(2, 19, 2, generator=_g),
          past_observed_mask=torch.ones(2, 19), future_time_features=torch.randn(2, 4, 2, generator=_g))
TS_FUTURE = torch.randn(2, 4, generator=_g).abs()
AUDIO = torch.randn(2, 1, 320, generator=_g)
DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)

Step = Callable[[torch.nn.Module, str], object]


def _on(x: dict, dev: str) -> dict:
    return {k: v.to(dev) for k, v in x.items()}


def _causal(m: torch.nn.Module, dev: str) -> object:
    return m(input_ids=IDS.to(dev), labels=IDS.to(dev))


def _seq2seq(m: torch.nn.Module, dev: str) -> object:
    return m(input_ids=IDS.to(dev), labels=IDS[:, :6].contiguous().to(dev))


def _decodes(m: torch.nn.Module, dev: str) -> dict[str, torch.Tensor]:
    """Greedy, beam search with its scores, and seeded sampling, from a prompt (the whole input
    for an encoder-decoder)."""
    prompt = (IDS if m.config.is_encoder_decoder else IDS[:, :4]).to(dev)
    kw = dict(max_new_tokens=5, pad_token_id=0)
    beam = m.generate(prompt, num_beams=3, do_sample=False, output_scores=True, return_dict_in_generate=True, **kw)
    torch.manual_seed(3)
    sampled = m.generate(prompt, do_sample=True, top_k=10, **kw)
    return {"greedy": m.generate(prompt, do_sample=False, **kw), "beam": beam.sequences,
            "beam_scores": beam.sequences_scores, "sampled": sampled}


def _forecast(m: torch.nn.Module, dev: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    inputs = _on(TS, dev) if isinstance(m, T.TimeSeriesTransformerForPrediction) else {"past_values": PAST.to(dev)}
    return {"forecast": m.generate(**inputs).sequences}


def _reformer() -> torch.nn.Module:
    return T.ReformerModelWithLMHead(T.ReformerConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64,
        attn_layers=["lsh", "local"], axial_pos_embds=False, max_position_embeddings=64, lsh_attn_chunk_length=4,
        local_attn_chunk_length=4, num_buckets=4, num_hashes=2, is_decoder=True, hidden_dropout_prob=0.1,
        lsh_attention_probs_dropout_prob=0.1, local_attention_probs_dropout_prob=0.1, pad_token_id=0, eos_token_id=2))


def _reformer_step(m: torch.nn.Module, dev: str) -> object:
    """Each layer's seeds come from ``torch.cuda.default_generators[i].seed()`` (Python's
    ``random`` here, on either device: CUDA is available), so both runs draw the same."""
    random.seed(0)
    return _causal(m, dev)


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Step, Callable | None]] = {
    "reformer_reversible_lsh": (_reformer, _reformer_step, None),
    "xlnet": (lambda: T.XLNetLMHeadModel(T.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_inner=64)),
              _causal, _decodes),
    "bigbird_block_sparse": (lambda: T.BigBirdForMaskedLM(T.BigBirdConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, attention_type="block_sparse", block_size=2, num_random_blocks=1)),
        lambda m, dev: m(input_ids=LONG.to(dev), labels=LONG.to(dev)), None),
    "longt5_transient_global": (lambda: T.LongT5ForConditionalGeneration(T.LongT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, local_radius=2, global_block_size=4,
        encoder_attention_type="transient-global", decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
        _seq2seq, _decodes),
    "marian": (lambda: T.MarianMTModel(T.MarianConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)), _seq2seq, _decodes),
    "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                    rotary_dim=4)), _causal, _decodes),
    "recurrent_gemma": (lambda: T.RecurrentGemmaForCausalLM(T.RecurrentGemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, lru_width=32, attention_window_size=8, conv1d_width=4,
        block_types=["recurrent", "attention"], head_dim=8)), _causal, _decodes),
    "falcon_mamba": (lambda: T.FalconMambaForCausalLM(T.FalconMambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)),
        _causal, _decodes),
    "jamba_hybrid": (lambda: T.JambaForCausalLM(T.JambaConfig(
        **DECODER, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False)), _causal, _decodes),
    "patchtst_student_t": (lambda: T.PatchTSTForPrediction(T.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, prediction_length=8, d_model=16,
        num_attention_heads=2, num_hidden_layers=1, ffn_dim=32, distribution_output="student_t", loss="nll",
        num_parallel_samples=4)),
        lambda m, dev: m(past_values=PAST.to(dev), future_values=FUTURE.to(dev)), _forecast),
    "time_series_transformer": (lambda: T.TimeSeriesTransformerForPrediction(T.TimeSeriesTransformerConfig(
        prediction_length=4, context_length=16, lags_sequence=[1, 2, 3], num_time_features=2, d_model=16,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, num_parallel_samples=3)),
        lambda m, dev: m(**_on(TS, dev), future_values=TS_FUTURE.to(dev)), _forecast),
    "encodec": (lambda: T.EncodecModel(T.EncodecConfig(
        audio_channels=1, hidden_size=16, num_filters=4, num_residual_layers=1, upsampling_ratios=[4, 2],
        codebook_size=16, codebook_dim=16, target_bandwidths=[1.5, 3.0], sampling_rate=2000, num_lstm_layers=1)),
        lambda m, dev: m(input_values=AUDIO.to(dev)),
        lambda m, dev: {"codes": m.encode(AUDIO.to(dev)).audio_codes}),
    "perceiver": (lambda: T.PerceiverForMaskedLM(T.PerceiverConfig(
        vocab_size=64, d_model=32, d_latents=32, num_latents=8, num_blocks=1, num_self_attends_per_block=1,
        num_self_attention_heads=2, num_cross_attention_heads=2, max_position_embeddings=24)),
        lambda m, dev: m(input_ids=LONG.to(dev), labels=LONG.to(dev)), None),
}


def _loss(out: object) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    return out.audio_values.square().mean()  # (EnCodec returns no loss: its reconstruction's energy)


def _logits(out: object) -> dict[str, torch.Tensor]:
    return {"logits": out.logits} if getattr(out, "logits", None) is not None else {}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_architecture_matches_local(name):
    make, step, decodes = MODELS[name]
    torch.manual_seed(0)
    assert_architecture_matches_local(name, make(), step, _loss, _logits, decodes)


class _Digits:
    """The tokenizer a streamer decodes with: token ids as words."""

    def decode(self, ids: list[int], **kw: object) -> str:
        return " ".join(str(int(i)) for i in ids) + " "


def _streamed(model: torch.nn.Module, prompt: torch.Tensor) -> str:
    streamer = T.TextIteratorStreamer(_Digits(), skip_prompt=True)
    worker = threading.Thread(target=model.generate, args=(prompt,),
                              kwargs=dict(max_new_tokens=6, do_sample=False, pad_token_id=0, streamer=streamer))
    worker.start()
    text = "".join(streamer)
    worker.join()
    return text


def _generations(dev: str) -> dict[str, object]:
    torch.manual_seed(0)
    config = dict(**DECODER, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = T.LlamaForCausalLM(T.LlamaConfig(**config)).to(dev).eval()
    draft = T.LlamaForCausalLM(T.LlamaConfig(**{**config, "num_hidden_layers": 1})).to(dev).eval()
    prompt = IDS[:, :4].to(dev)
    kw = dict(max_new_tokens=6, pad_token_id=0)
    found: dict[str, object] = {}
    with torch.no_grad():
        found["static"] = model.generate(prompt, do_sample=False, cache_implementation="static", **kw)
        torch.manual_seed(4)
        scored = model.generate(prompt, do_sample=True, temperature=0.7, top_p=0.9, cache_implementation="static",
                                output_scores=True, output_logits=True, return_dict_in_generate=True, **kw)
        found["static_sampled"] = scored.sequences
        found["scores"] = torch.stack(scored.scores)
        found["logits"] = torch.stack(scored.logits)
        found["assisted"] = model.generate(prompt[:1], do_sample=False, assistant_model=draft, **kw)
        torch.manual_seed(5)
        found["assisted_sampled"] = model.generate(prompt[:1], do_sample=True, assistant_model=draft, **kw)
        found["streamed"] = _streamed(model, prompt[:1])
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in found.items()}


def test_generation_features_match_local():
    """A static cache (sampled, with scores and logits), assisted generation with a draft model,
    greedy and sampled, and a ``TextIteratorStreamer`` read from another thread."""
    expected = _generations("cpu")
    got = _generations("cuda")
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
        else:
            assert got[key] == value, key
