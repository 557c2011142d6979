"""Hugging Face vision-language and detection models, unchanged, on 'cuda' against the local CPU
(tiny configs, no hub): LLaVA's image features merged into the text by ``masked_scatter`` at the
image tokens of a left-padded batch, Qwen2-VL's patches of two image sizes and its 3-D rotary
positions (``grid_thw`` read in its vision tower and rope index), a ViT+GPT-2
``VisionEncoderDecoderModel`` trained with -100 labels and decoded by beam search, and DETR's
set loss (a Hungarian matching on the CPU) with a ResNet backbone built without timm. Each trains
one step (loss, gradients) and, where it decodes, generates greedily."""
from __future__ import annotations

import os

import pytest
import torch
from local_parity import assert_matches_local, registry
from local_parity import data as D

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()
IDS = torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(1))
TEXT = dict(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _step(model: torch.nn.Module, inputs: dict, generate: dict | None = None) -> list:
    out = model(**inputs)
    out.loss.backward()
    found = [out.loss, torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])]
    if generate is not None:
        model.eval()
        with torch.no_grad():
            found.append(model.generate(**generate, max_new_tokens=5, do_sample=False))
    return found


@case
def llava_left_padded(dev):
    torch.manual_seed(0)
    model = T.LlavaForConditionalGeneration(T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(**{k: v for k, v in VIT.items() if "dropout" not in k}),
        text_config=T.LlamaConfig(**TEXT), image_token_id=79, vision_feature_layer=-1)).to(dev)
    ids = torch.cat([IDS[:, :2], torch.full((2, 16), 79), IDS[:, 2:6]], 1)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    inputs = dict(pixel_values=D(2, 3, 32, 32).to(dev), input_ids=ids.to(dev), attention_mask=mask.to(dev))
    return _step(model, {**inputs, "labels": ids.to(dev)}, inputs)


@case
def qwen2_vl_two_image_sizes(dev):
    torch.manual_seed(0)
    model = T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
        text_config=dict(**TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, in_chans=3),
        image_token_id=79, video_token_id=78, vision_start_token_id=77, vision_end_token_id=76)).to(dev)
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])  # (4 and 8 merged image tokens)
    ids = torch.tensor([[5, 77] + [79] * 4 + [76, 9, 10, 11, 12, 13, 14, 15, 16, 17],
                        [0, 0, 7, 77] + [79] * 8 + [76, 9, 10, 11]])
    inputs = dict(input_ids=ids.to(dev), attention_mask=(ids != 0).long().to(dev),
                  pixel_values=D(48, 3 * 2 * 4 * 4, seed=4).to(dev), image_grid_thw=grid.to(dev),
                  mm_token_type_ids=(ids == 79).long().to(dev))
    return _step(model, {**inputs, "labels": ids.to(dev)}, inputs)


@case
def vision_encoder_decoder_beams(dev):
    torch.manual_seed(0)
    config = T.VisionEncoderDecoderConfig.from_encoder_decoder_configs(T.ViTConfig(**VIT), T.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 1, 0, 2
    model = T.VisionEncoderDecoderModel(config=config).to(dev)
    labels = IDS.clone()
    labels[1, 5:] = -100
    pixels = D(2, 3, 32, 32).to(dev)
    found = _step(model, dict(pixel_values=pixels, labels=labels.to(dev)))
    with torch.no_grad():
        found.append(model.generate(pixels, max_new_tokens=5, num_beams=3, early_stopping=True))
    return found


@case
def detr_set_loss(dev):
    torch.manual_seed(0)
    backbone = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1],
                              layer_type="basic", out_features=["stage4"])
    model = T.DetrForObjectDetection(T.DetrConfig(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, d_model=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=5, num_labels=3, dropout=0.0)).to(dev)
    boxes = [[[0.5, 0.5, 0.2, 0.3], [0.3, 0.6, 0.1, 0.1]], [[0.4, 0.4, 0.3, 0.3]]]
    labels = [{"class_labels": torch.tensor(c, device=dev), "boxes": torch.tensor(b, device=dev)}
              for c, b in zip([[1, 2], [0]], boxes)]
    return _step(model, dict(pixel_values=D(2, 3, 64, 64).to(dev), labels=labels))


@pytest.mark.parametrize("name", list(CASES))
def test_multimodal_model_matches_local(name):
    if name == "detr_set_loss":
        pytest.importorskip("scipy")  # (its Hungarian matcher)
    assert_matches_local(CASES[name])
