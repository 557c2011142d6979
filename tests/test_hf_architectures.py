"""Ten more Hugging Face architectures, built from tiny configs (no weights, no hub), unchanged:
forward with a loss, backward, and ``generate()`` (greedy, beam search for BART, Whisper's own)
on 'cuda' give the local CPU's logits, gradients and tokens. tests/corpus runs GPT-2, Llama,
BERT, T5 and the Trainer as whole programs; this covers the variety: vision (ViT, CLIP), audio
(Whisper), grouped-query and sliding-window attention (Qwen2, Mistral, Gemma), partial rotary
(Phi), encoder-decoders (BART), and tied MLM heads (RoBERTa); rotary scalings (YaRN, Llama 3),
QK-norm (Qwen3), data-dependent expert routing (OLMoE, DeepSeek-V3's grouped top-k and latent
attention), hybrid sliding/full layers (Gemma 3), ALiBi (BLOOM), Mamba-2's chunked scan, ModernBERT's
local attention and token labels, and UMT5's per-layer relative buckets with beam search; from the
registry sweep (tests/test_hf_zoo.py): Doge's dynamic mask and product-key experts (a transposed
softplus gradient), Kolibri's router (``mm(out_dtype=...)`` on 'cuda' under no_grad) and Qwen3-Next's
gated delta-rule linear attention."""
from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
T = transformers

IDS = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(1))
PIXELS = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
FEATURES = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)
SEQ2SEQ = dict(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0)


def _causal(m, dev):
    x = IDS.to(dev)
    out = m(input_ids=x, labels=x)
    return out, lambda: m.generate(x[:, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)


MODELS: dict[str, tuple[Callable, Callable]] = {
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=3)),
        lambda m, dev: (m(pixel_values=PIXELS.to(dev), labels=torch.tensor([0, 2], device=dev)), None)),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DECODER, num_key_value_heads=2)), _causal),
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**DECODER, num_key_value_heads=2, sliding_window=4)),
                _causal),
    "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(**DECODER, num_key_value_heads=1, head_dim=8)), _causal),
    "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(**DECODER)), _causal),
    "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(**SEQ2SEQ, max_position_embeddings=64)),
             lambda m, dev: (m(input_ids=IDS.to(dev), labels=IDS.to(dev)),
                             lambda: m.generate(IDS.to(dev), max_new_tokens=5, num_beams=2, do_sample=False))),
    "roberta": (lambda: T.RobertaForMaskedLM(T.RobertaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=70)),
        lambda m, dev: (m(input_ids=IDS.to(dev), labels=IDS.to(dev)), None)),
    "distilbert": (lambda: T.DistilBertForSequenceClassification(T.DistilBertConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)),
        lambda m, dev: (m(input_ids=IDS.to(dev), attention_mask=torch.ones_like(IDS).to(dev),
                          labels=torch.tensor([0, 1], device=dev)), None)),
    "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        **SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=32, decoder_start_token_id=1,
        pad_token_id=0, eos_token_id=2, bos_token_id=1, suppress_tokens=[], begin_suppress_tokens=[])),
        lambda m, dev: (m(input_features=FEATURES.to(dev), labels=IDS[:, :6].to(dev)),
                        lambda: m.generate(FEATURES.to(dev), max_new_tokens=4))),
    "clip": (lambda: T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=16),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4), projection_dim=16)),
        lambda m, dev: (m(input_ids=IDS.to(dev), pixel_values=PIXELS.to(dev), return_loss=True), None)),
    "llama_yarn": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER, num_key_value_heads=2, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16))), _causal),
    "llama3_rope": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))), _causal),
    "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**DECODER, num_key_value_heads=2, head_dim=8)), _causal),
    "olmoe": (lambda: T.OlmoeForCausalLM(T.OlmoeConfig(**DECODER, num_key_value_heads=2, num_experts=4,
                                                      num_experts_per_tok=2)), _causal),
    "deepseek_v3": (lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **DECODER, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8)), _causal),
    "gemma3_hybrid": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **DECODER, num_key_value_heads=2, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])), _causal),
    "bloom_alibi": (lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)),
                    _causal),
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**DECODER)), _causal),
    "mamba2": (lambda: T.Mamba2ForCausalLM(T.Mamba2Config(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, n_groups=1,
        num_heads=8, head_dim=8, chunk_size=4)), _causal),
    "modernbert_tokens": (lambda: T.ModernBertForTokenClassification(T.ModernBertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=3, local_attention=4, global_attn_every_n_layers=2, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1)),
        lambda m, dev: (m(input_ids=IDS.to(dev), labels=(IDS % 3).to(dev)), None)),
    "umt5": (lambda: T.UMT5ForConditionalGeneration(T.UMT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, feed_forward_proj="gated-gelu", dropout_rate=0.0)),
        lambda m, dev: (m(input_ids=IDS.to(dev), labels=IDS[:, :6].contiguous().to(dev)),
                        lambda: m.generate(IDS.to(dev), max_new_tokens=5, num_beams=2, do_sample=False))),
    "doge_dynamic_mask": (lambda: T.DogeForCausalLM(T.DogeConfig(
        **DECODER, num_key_value_heads=2, keep_window_size=4, is_moe=True, num_experts=16, num_experts_per_tok=4)),
        _causal),
    "kolibri1_router": (lambda: T.Kolibri1ForCausalLM(T.Kolibri1Config(
        **DECODER, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])), _causal),
    "qwen3_next_linear": (lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
        **DECODER, num_key_value_heads=2, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"])), _causal),
}


def _run(model: torch.nn.Module, step: Callable, dev: str) -> dict[str, torch.Tensor]:
    model.to(dev).train()
    out, generate = step(model, dev)
    out.loss.backward()
    logits = out.logits if hasattr(out, "logits") else out.logits_per_image
    found = {"logits": logits, "grads": torch.stack([p.grad.float().norm() for p in model.parameters()
                                                      if p.grad is not None])}
    model.zero_grad(set_to_none=True)
    if generate is not None:
        model.eval()
        with torch.no_grad():
            found["tokens"] = generate().float()
    return {k: v.detach().cpu().double() for k, v in found.items()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_architecture_matches_local(remote, name):
    make, step = MODELS[name]
    torch.manual_seed(0)
    model = make()
    for mod in model.modules():  # (configs' dropout differ in name; none is wanted here)
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    expected = _run(model, step, "cpu")
    got = _run(model, step, "cuda")
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{name} {k}: {m}")
