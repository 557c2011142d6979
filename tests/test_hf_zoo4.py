"""Hugging Face architectures and idioms the other zoo files do not reach, from tiny seeded configs
(no weights, no hub), unchanged on 'cuda' against the local CPU: forward logits and loss, backward,
one AdamW step and, for the decoders, greedy ``generate()``. The variety: MoE routers of
today's releases (Qwen3-MoE, GPT-OSS with attention sinks, Llama 4's chunked attention, NLLB-MoE's
capacity-bounded top-2, Switch Transformers' jittered top-1), Gemma 3n's AltUp and per-layer
inputs, Phi-3's LongRoPE, Longformer's global attention, ViT-MAE's masking by the argsort of noise,
SigLIP's sigmoid contrastive loss, Gemma 3's bidirectional image-token mask, Qwen2.5-VL's windowed
vision attention, Whisper's long-form (sequential) decoding with timestamps; and ``generate()``
with watermarking (green lists seeded per token, SynthID's keyed g-values), classifier-free
guidance and min-p sampling, and padding-free training on packed sequences (position ids that
restart). The sweep that chose them also ran OLMo-2, SmolLM3, LFM2, LED, FNet, ESM, Funnel, CANINE,
Speech2Text, Moonshine, WavLM, Wav2Vec2-BERT/-Conformer, CLAP, Autoformer, PatchTSMixer, VITS,
BEiT, VideoMAE, TimeSformer, ViViT, Swin2SR, UperNet, Conditional/DAB-DETR, D-FINE, PaliGemma,
BLIP, Idefics3, and bf16/fp16 training of Llama, Gemma 3, Qwen3-MoE, GPT-OSS, Mamba-2 and T5
(all matched). A model whose forward draws from both generators (Informer's ``torch.randint``
without a device, VITS' noise) or uses dropout cannot match a GPU's draws and is left out."""
from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from local_parity import assert_architecture_matches_local

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
T = transformers

pytestmark = pytest.mark.usefixtures("remote")

_g = torch.Generator().manual_seed(1)
IDS = torch.randint(3, 60, (2, 12), generator=_g)
PIXELS = torch.randn(2, 3, 32, 32, generator=_g)
DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
SEQ2SEQ = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=2,
               pad_token_id=0, eos_token_id=1)
IMAGE = 60  # the image token of the vision-language cases

Inputs = Callable[[], dict]


def _causal() -> dict:
    return dict(input_ids=IDS, labels=IDS)


def _seq2seq() -> dict:
    return dict(input_ids=IDS, labels=IDS[:, :6].contiguous())


def _decodes(m: torch.nn.Module, dev: str) -> dict[str, torch.Tensor]:
    prompt = (IDS if m.config.is_encoder_decoder else IDS[:, :4]).to(dev)
    return {"greedy": m.generate(prompt, do_sample=False, max_new_tokens=5, pad_token_id=0)}


def _gemma3_image_text() -> dict:
    """Four image tokens (16 patches pooled to 4) in a left-padded batch; ``token_type_ids`` mark
    them, which Gemma 3 attends bidirectionally."""
    ids = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    ids[:, 2:6] = IMAGE
    ids[1, :2] = 0
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=(ids == IMAGE).long(),
                pixel_values=PIXELS[:, :, :28, :28], labels=ids.masked_fill(ids == IMAGE, -100))


def _qwen25_vl_image_text() -> dict:
    ids = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    ids[:, 1], ids[:, 2:6], ids[:, 6] = 61, IMAGE, 62
    patches = torch.randn(32, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(5))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=patches,
                image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]), labels=ids.masked_fill(ids == IMAGE, -100))


def _vision_language_decodes(inputs: Inputs) -> Callable:
    def decodes(m: torch.nn.Module, dev: str) -> dict[str, torch.Tensor]:
        given = {k: v.to(dev) for k, v in inputs().items() if k != "labels"}
        return {"greedy": m.generate(**given, max_new_tokens=4, do_sample=False)}
    return decodes


_TEXT = dict(**DECODER, head_dim=8)
_SIGLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=7)

MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Inputs, Callable | None]] = {
    "qwen3_moe": (lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        **_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True)),
        _causal, _decodes),
    "gpt_oss_sinks": (lambda: T.GptOssForCausalLM(T.GptOssConfig(
        **_TEXT, **SLIDING, num_local_experts=4, num_experts_per_tok=2)), _causal, _decodes),
    "llama4_chunked_moe": (lambda: T.Llama4ForCausalLM(T.Llama4TextConfig(
        **_TEXT, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=4,
        interleave_moe_layer_step=1)), _causal, _decodes),
    "gemma3n_altup": (lambda: T.Gemma3nForCausalLM(T.Gemma3nTextConfig(
        **_TEXT, **SLIDING, vocab_size_per_layer_input=64, hidden_size_per_layer_input=8, num_kv_shared_layers=0,
        altup_num_inputs=2, laurel_rank=4, activation_sparsity_pattern=[0.95, 0.0])), _causal, _decodes),
    "phi3_longrope": (lambda: T.Phi3ForCausalLM(T.Phi3Config(
        **DECODER, original_max_position_embeddings=16,
        rope_scaling=dict(type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4))), _causal, _decodes),
    "nllb_moe_top2": (lambda: T.NllbMoeForConditionalGeneration(T.NllbMoeConfig(
        **SEQ2SEQ, num_experts=4, expert_capacity=8, encoder_sparse_step=2, decoder_sparse_step=2)),
        _seq2seq, _decodes),
    "switch_transformers": (lambda: T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, expert_capacity=8, num_layers=2, num_sparse_encoder_layers=1,
        num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=4, num_experts=4, router_jitter_noise=0.01,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)), _seq2seq, _decodes),
    "longformer_global": (lambda: T.LongformerForMaskedLM(T.LongformerConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        attention_window=[4, 4], max_position_embeddings=80, pad_token_id=1)),
        lambda: dict(input_ids=IDS, labels=IDS, global_attention_mask=(torch.arange(12) < 1).long().expand(2, 12)),
        None),
    "vit_mae_pretraining": (lambda: T.ViTMAEForPreTraining(T.ViTMAEConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
        decoder_intermediate_size=64)), lambda: dict(pixel_values=PIXELS), None),
    "siglip_contrastive": (lambda: T.SiglipModel(T.SiglipConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=2, eos_token_id=1,
                         pad_token_id=0),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4))),
        lambda: dict(input_ids=IDS, pixel_values=PIXELS, return_loss=True), None),
    "gemma3_image_tokens": (lambda: T.Gemma3ForConditionalGeneration(T.Gemma3Config(
        text_config=dict(**_TEXT, **SLIDING), vision_config=_SIGLIP, mm_tokens_per_image=4, image_token_index=IMAGE,
        boi_token_index=61, eoi_token_index=62)),
        _gemma3_image_text, _vision_language_decodes(_gemma3_image_text)),
    "qwen2_5_vl_windows": (lambda: T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(
        text_config=dict(**DECODER, rope_scaling=dict(type="mrope", mrope_section=[1, 1, 2])),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, in_chans=3, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, window_size=8,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE, vision_start_token_id=61, vision_end_token_id=62)),
        _qwen25_vl_image_text, _vision_language_decodes(_qwen25_vl_image_text)),
}


def _forward(inputs: Inputs) -> Callable[[torch.nn.Module, str], object]:
    return lambda model, dev: model(**{k: v.to(dev) if isinstance(v, torch.Tensor) else v
                                       for k, v in inputs().items()})


def _outputs(out: object) -> dict[str, torch.Tensor]:
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k != "loss"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_architecture_matches_local(name):
    make, inputs, decodes = MODELS[name]
    torch.manual_seed(0)
    assert_architecture_matches_local(name, make(), _forward(inputs), lambda out: out.loss, _outputs, decodes)


def _llama(dev: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(**DECODER)).to(dev).eval()


GENERATIONS: dict[str, Callable[[str], dict]] = {
    "watermark_selfhash": lambda dev: dict(do_sample=False, watermarking_config=T.WatermarkingConfig(
        bias=2.5, seeding_scheme="selfhash")),
    "watermark_sampled": lambda dev: dict(do_sample=True, watermarking_config=T.WatermarkingConfig(bias=2.5)),
    "synthid": lambda dev: dict(do_sample=True, top_k=20, watermarking_config=T.SynthIDTextWatermarkingConfig(
        keys=[654, 400, 836, 123], ngram_len=3)),
    "min_p": lambda dev: dict(do_sample=True, min_p=0.05),
    "guidance": lambda dev: dict(do_sample=False, guidance_scale=1.5, negative_prompt_ids=IDS[:, 6:9].to(dev)),
}


@pytest.mark.parametrize("name", sorted(GENERATIONS))
def test_generation_matches_local(name):
    """Tokens and scores; the watermarks seed a generator of the device's from the last tokens."""
    def generate(dev: str) -> dict[str, torch.Tensor]:
        model = _llama(dev)
        torch.manual_seed(3)
        with torch.no_grad():
            out = model.generate(IDS[:, :4].to(dev), max_new_tokens=6, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True, **GENERATIONS[name](dev))
        return {"sequences": out.sequences.cpu(), "scores": torch.stack(out.scores).cpu()}
    expected, got = generate("cpu"), generate("cuda")
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def test_whisper_long_form_matches_local():
    """Audio longer than one window is decoded window by window, each seeking past the last
    timestamp the previous one gave (the seek read on the host)."""
    def transcribe(dev: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = T.WhisperForConditionalGeneration(T.WhisperConfig(
            vocab_size=60, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=20,
            max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
            suppress_tokens=[], begin_suppress_tokens=[], dropout=0.0)).to(dev).eval()
        config = model.generation_config
        config.forced_decoder_ids, config.no_timestamps_token_id, config.max_initial_timestamp_index = None, 40, 5
        config.is_multilingual, config.prev_sot_token_id = False, 5
        features = torch.randn(1, 8, 130, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            out = model.generate(features.to(dev), attention_mask=torch.ones(1, 130, dtype=torch.long).to(dev),
                                 return_timestamps=True, max_new_tokens=6, return_dict_in_generate=True)
        return out["sequences"].cpu()
    torch.testing.assert_close(transcribe("cuda"), transcribe("cpu"))


def test_padding_free_packed_training_matches_local():
    """Three sequences packed in one row, told apart by position ids that restart at 0 (what
    ``DataCollatorWithFlattening`` gives): the mask is found from the position ids on the device."""
    def step(dev: str) -> dict[str, torch.Tensor]:
        model = _llama(dev).train()
        ids = IDS.reshape(1, 24)
        positions = torch.cat([torch.arange(10), torch.arange(8), torch.arange(6)]).unsqueeze(0)
        labels = ids.clone()
        labels[0, [0, 10, 18]] = -100
        out = model(input_ids=ids.to(dev), position_ids=positions.to(dev), labels=labels.to(dev))
        out.loss.backward()
        return {"loss": out.loss.detach().cpu(), "logits": out.logits.detach().cpu(),
                "grads": torch.stack([p.grad.norm() for p in model.parameters()]).cpu()}
    expected, got = step("cpu"), step("cuda")
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
