"""Hugging Face vision and audio task heads on 'cuda' against the local CPU, through to their
post-processing (tiny configs, no hub): the image processors' ``post_process_*`` given 'cuda'
outputs and 'cuda' ``target_sizes`` (DETR's boxes, RT-DETR's top-k with its denoising loss,
Mask2Former's semantic/instance/panoptic maps, SegFormer's resized argmax with an ignored label,
DPT's depth, SAM's upscaled masks, OWL-ViT's image-guided detection with its NMS), the deformable
attention of Grounding DINO and of a two-stage Deformable DETR over a padded batch, Wav2Vec2's
contrastive pre-training on masks and negatives drawn by numpy, Whisper's token timestamps (its
cross-attention aligned by dynamic time warping), SuperGlue's matching (a batch norm's output
laid out as on a GPU), and ``pipeline(..., device=0)`` for object
detection, panoptic segmentation and chunked CTC speech recognition. Each case returns what a
user reads: losses, gradient norms, the post-processed dicts."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
from local_parity import data as D

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

pytestmark = pytest.mark.usefixtures("remote")
CASES: dict = {}
#: what cases need beyond transformers: scipy's Hungarian solver (their losses, or Mask2Former's
#: model) and Pillow (transformers' image processors without torchvision)
_PIL, _SCIPY = ("PIL",), ("scipy",)
NEEDS = {"detr_boxes_at_cuda_sizes": _SCIPY + _PIL, "rt_detr_denoising_top_k": _SCIPY + _PIL,
         "deformable_detr_two_stage_padded": _SCIPY, "mask2former_three_subtasks": _SCIPY + _PIL,
         "segformer_ignored_label": _PIL, "dpt_depth_resized": _PIL, "sam_masks_at_cuda_sizes": _PIL,
         "owlvit_image_guided_nms": _PIL, "pipeline_object_detection": _PIL, "pipeline_panoptic_segmentation": _PIL}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _plain(x: object) -> object:
    """``x`` with its tensors (and PIL images, numpy arrays) as CPU tensors and its dicts kept."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy())
    if isinstance(x, np.generic):
        return x.item()
    if hasattr(x, "getdata"):  # a PIL image (a pipeline's mask or depth map)
        return torch.from_numpy(np.array(x))
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _assert_same(got: object, want: object, where: str = "result") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, (torch.Tensor, float)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True, msg=lambda m: f"{where}: {m}")
    else:
        assert got == want, (where, got, want)


def _trained(model: torch.nn.Module, out) -> list:
    """The loss of ``out`` and the gradient norms it gives ``model``'s parameters."""
    out.loss.backward()
    return [out.loss, torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])]


def _resnet(*stages: str) -> T.ResNetConfig:
    return T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], layer_type="basic",
                          out_features=list(stages))


DETR = dict(use_timm_backbone=False, use_pretrained_backbone=False, d_model=32, encoder_layers=1, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=5,
            num_labels=3, dropout=0.0)
SWIN = dict(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=2, image_size=64, drop_path_rate=0.0,
            out_features=["stage1", "stage2", "stage3", "stage4"])
W2V = dict(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
           conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8,
           num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
           feat_proj_dropout=0.0, layerdrop=0.0, final_dropout=0.0, pad_token_id=0)


def _boxes(dev: str) -> list[dict]:
    boxes = [[[0.5, 0.5, 0.2, 0.3], [0.3, 0.6, 0.1, 0.1]], [[0.4, 0.4, 0.3, 0.3]]]
    return [{"class_labels": torch.tensor(c, device=dev), "boxes": torch.tensor(b, device=dev)}
            for c, b in zip([[1, 2], [0]], boxes)]


def _sizes(dev: str) -> torch.Tensor:
    return torch.tensor([[64, 80], [48, 64]], device=dev)


@case
def detr_boxes_at_cuda_sizes(dev):
    model = T.DetrForObjectDetection(T.DetrConfig(backbone_config=_resnet("stage4"), **DETR)).to(dev)
    out = model(pixel_values=D(2, 3, 64, 64).to(dev), labels=_boxes(dev))
    proc = T.DetrImageProcessorPil()
    return [*_trained(model, out), proc.post_process_object_detection(out, threshold=0.0, target_sizes=_sizes(dev))]


@case
def rt_detr_denoising_top_k(dev):
    backbone = T.RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1],
                                    layer_type="basic", out_features=["stage2", "stage3", "stage4"])
    model = T.RTDetrForObjectDetection(T.RTDetrConfig(
        backbone_config=backbone, encoder_hidden_dim=16, encoder_in_channels=[16, 16, 32], feat_strides=[8, 16, 32],
        d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, decoder_layers=1, encoder_layers=1, num_queries=10,
        num_labels=3, num_denoising=4, decoder_in_channels=[16, 16, 16], encoder_attention_heads=2,
        decoder_attention_heads=2, dropout=0.0, use_pretrained_backbone=False)).to(dev).eval()
    out = model(pixel_values=D(2, 3, 64, 64).to(dev), labels=_boxes(dev))
    proc = T.RTDetrImageProcessorPil()
    return [*_trained(model, out), proc.post_process_object_detection(out, threshold=0.0, target_sizes=_sizes(dev))]


@case
def mask2former_three_subtasks(dev):
    model = T.Mask2FormerForUniversalSegmentation(T.Mask2FormerConfig(
        backbone_config=T.SwinConfig(**SWIN), hidden_dim=32, mask_feature_size=32, feature_size=32, encoder_layers=1,
        decoder_layers=2, num_attention_heads=2, encoder_feedforward_dim=32, dim_feedforward=32, num_queries=5,
        num_labels=3, dropout=0.0, use_pretrained_backbone=False)).to(dev).eval()
    proc = T.Mask2FormerImageProcessorPil()
    with torch.no_grad():
        out = model(pixel_values=D(2, 3, 64, 64).to(dev))
    return [proc.post_process_semantic_segmentation(out, target_sizes=[(40, 50), (20, 30)]),
            proc.post_process_instance_segmentation(out, threshold=0.0, return_binary_maps=True),
            proc.post_process_panoptic_segmentation(out, threshold=0.0)]


@case
def segformer_ignored_label(dev):
    model = T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[7, 3],
        strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
        drop_path_rate=0.0)).to(dev)
    labels = torch.randint(0, 4, (2, 32, 32), generator=torch.Generator().manual_seed(3))
    labels[0, :4] = 255
    out = model(pixel_values=D(2, 3, 32, 32).to(dev), labels=labels.to(dev))
    proc = T.SegformerImageProcessorPil()
    return [*_trained(model, out), proc.post_process_semantic_segmentation(out, target_sizes=[(40, 50), (20, 30)])]


@case
def dpt_depth_resized(dev):
    model = T.DPTForDepthEstimation(T.DPTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
        backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 16, 32], fusion_hidden_size=16,
        reassemble_factors=[4, 2, 1, 0.5], head_in_index=-1)).to(dev).eval()
    out = model(pixel_values=D(2, 3, 32, 32).to(dev))
    out.predicted_depth.mean().backward()
    depth = T.DPTImageProcessorPil().post_process_depth_estimation(out, target_sizes=[(40, 50), (20, 30)])
    return [depth, torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])]


@case
def sam_masks_at_cuda_sizes(dev):
    model = T.SamModel(T.SamConfig(
        vision_config=T.SamVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                                        patch_size=16, output_channels=16, mlp_dim=32, window_size=2,
                                        global_attn_indexes=[1], num_pos_feats=8),
        prompt_encoder_config=T.SamPromptEncoderConfig(hidden_size=16, image_size=64, patch_size=16,
                                                       mask_input_channels=4),
        mask_decoder_config=T.SamMaskDecoderConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                   mlp_dim=32, iou_head_hidden_dim=16))).to(dev)
    points = torch.tensor([[[[10., 20.], [30., 40.]]]], device=dev)
    out = model(pixel_values=D(1, 3, 64, 64).to(dev), input_points=points)
    masks = T.SamImageProcessorPil().post_process_masks(
        out.pred_masks, original_sizes=torch.tensor([[50, 60]], device=dev),
        reshaped_input_sizes=torch.tensor([[64, 64]], device=dev))
    out.iou_scores.sum().backward()
    return [out.iou_scores, masks, torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])]


@case
def owlvit_image_guided_nms(dev):
    model = T.OwlViTForObjectDetection(T.OwlViTConfig(
        text_config=dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8), projection_dim=16)).to(dev).eval()
    proc = T.OwlViTImageProcessorPil()
    ids = torch.tensor([[1, 5, 6, 2, 0], [1, 7, 2, 0, 0], [1, 8, 9, 10, 2], [1, 3, 2, 0, 0]])
    with torch.no_grad():
        out = model(input_ids=ids.to(dev), attention_mask=(ids != 0).long().to(dev),
                    pixel_values=D(2, 3, 32, 32).to(dev))
        guided = model.image_guided_detection(pixel_values=D(2, 3, 32, 32).to(dev),
                                              query_pixel_values=D(2, 3, 32, 32, seed=2).to(dev))
    return [proc.post_process_object_detection(out, threshold=0.0, target_sizes=_sizes(dev)),
            proc.post_process_image_guided_detection(guided, threshold=0.0, nms_threshold=0.3,
                                                     target_sizes=_sizes(dev))]


@case
def grounding_dino_deformable(dev):
    model = T.GroundingDinoForObjectDetection(T.GroundingDinoConfig(
        backbone_config=_resnet("stage2", "stage3", "stage4"), use_timm_backbone=False, use_pretrained_backbone=False,
        text_config=dict(model_type="bert", vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32),
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=5, num_feature_levels=4, encoder_n_points=2,
        decoder_n_points=2, dropout=0.0, max_text_len=16, fusion_dropout=0.0, fusion_droppath=0.0)).to(dev).eval()
    ids = torch.tensor([[1, 5, 6, 3, 7, 3, 2, 0], [1, 8, 3, 2, 0, 0, 0, 0]])
    with torch.no_grad():
        out = model(pixel_values=D(2, 3, 64, 64).to(dev), input_ids=ids.to(dev),
                    attention_mask=(ids != 0).long().to(dev))
    return [out.logits, out.pred_boxes]


@case
def deformable_detr_two_stage_padded(dev):
    model = T.DeformableDetrForObjectDetection(T.DeformableDetrConfig(
        backbone_config=_resnet("stage2", "stage3", "stage4"), **DETR, num_feature_levels=4, encoder_n_points=2,
        decoder_n_points=2, with_box_refine=True, two_stage=True, two_stage_num_proposals=5)).to(dev)
    mask = torch.ones(2, 64, 64, dtype=torch.long)
    mask[1, :, 40:] = 0
    out = model(pixel_values=D(2, 3, 64, 64).to(dev), pixel_mask=mask.to(dev), labels=_boxes(dev))
    return _trained(model, out)


@case
def wav2vec2_contrastive_pretraining(dev):
    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices, _sample_negative_indices
    model = T.Wav2Vec2ForPreTraining(T.Wav2Vec2Config(
        **W2V, num_codevectors_per_group=8, num_codevector_groups=2, codevector_dim=16, proj_codevector_dim=16,
        num_negatives=5, mask_time_prob=0.3, mask_time_length=2)).to(dev).eval()
    frames = model._get_feat_extract_output_lengths(1600).item()
    np.random.seed(0)
    masked = _compute_mask_indices((2, frames), mask_prob=0.3, mask_length=2)
    negatives = _sample_negative_indices((2, frames), 5, mask_time_indices=masked)
    out = model(D(2, 1600).to(dev), mask_time_indices=torch.tensor(masked, device=dev),
                sampled_negative_indices=torch.tensor(negatives, device=dev))
    return [out.contrastive_loss, out.diversity_loss, *_trained(model, out)]


@case
def whisper_token_timestamps(dev):
    model = T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=60, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=20,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
        suppress_tokens=[], begin_suppress_tokens=[], dropout=0.0)).to(dev).eval()
    model.generation_config.forced_decoder_ids = None
    model.generation_config.alignment_heads = [[0, 0], [0, 1]]
    with torch.no_grad():
        out = model.generate(D(2, 8, 40).to(dev), max_new_tokens=5, do_sample=False, return_token_timestamps=True,
                             return_dict_in_generate=True)
    return [out["sequences"], out["token_timestamps"]]


@case
def superglue_matching(dev):
    """(SuperGlue's keypoint encoder runs a Linear on a BatchNorm1d's output of a transposed input:
    a view that holds only on the strides a GPU's batch norm gives, contiguous.)"""
    detector = T.SuperPointConfig(encoder_hidden_sizes=[8, 8, 16, 16], decoder_hidden_size=32,
                                  keypoint_decoder_dim=65, descriptor_decoder_dim=16, max_keypoints=20,
                                  keypoint_threshold=0.0)
    model = T.SuperGlueForKeypointMatching(T.SuperGlueConfig(
        keypoint_detector_config=detector, hidden_size=16, keypoint_encoder_sizes=[8, 16],
        gnn_layers_types=["self", "cross"], num_attention_heads=2, sinkhorn_iterations=5,
        matching_threshold=0.0)).to(dev).eval()
    with torch.no_grad():
        out = model(pixel_values=D(2, 2, 1, 64, 64).abs().to(dev))
    return [out.matches, out.matching_scores, out.keypoints, out.mask]


def _pipeline(task: str, model: torch.nn.Module, dev: str, **processors):
    return T.pipeline(task, model=model.eval(), device=0 if dev == "cuda" else "cpu", **processors)


def _images() -> list:
    from PIL import Image
    return [Image.fromarray((np.random.RandomState(i).rand(40 + 8 * i, 48, 3) * 255).astype("uint8")) for i in range(2)]


@case
def pipeline_object_detection(dev):
    model = T.DetrForObjectDetection(T.DetrConfig(backbone_config=_resnet("stage4"), **DETR))
    pipe = _pipeline("object-detection", model, dev,
                     image_processor=T.DetrImageProcessorPil(size={"shortest_edge": 32, "longest_edge": 64}))
    return pipe(_images(), threshold=0.0)


@case
def pipeline_panoptic_segmentation(dev):
    model = T.Mask2FormerForUniversalSegmentation(T.Mask2FormerConfig(
        backbone_config=T.SwinConfig(**SWIN), hidden_dim=32, mask_feature_size=32, feature_size=32, encoder_layers=1,
        decoder_layers=2, num_attention_heads=2, encoder_feedforward_dim=32, dim_feedforward=32, num_queries=5,
        num_labels=3, dropout=0.0, use_pretrained_backbone=False))
    pipe = _pipeline("image-segmentation", model, dev,
                     image_processor=T.Mask2FormerImageProcessorPil(size={"height": 64, "width": 64}))
    return pipe(_images(), subtask="panoptic", threshold=0.0)


@case
def pipeline_chunked_ctc(dev):
    import json
    vocab = os.path.join(tempfile.mkdtemp(), "vocab.json")
    with open(vocab, "w") as f:
        json.dump({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4,
                   **{c: i + 5 for i, c in enumerate("abcdefg")}}, f)
    model = T.Wav2Vec2ForCTC(T.Wav2Vec2Config(**{**W2V, "num_hidden_layers": 2}))
    pipe = _pipeline("automatic-speech-recognition", model, dev, tokenizer=T.Wav2Vec2CTCTokenizer(vocab),
                     feature_extractor=T.Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000,
                                                                  return_attention_mask=True))
    wave = np.random.RandomState(0).randn(16000).astype(np.float32)
    return [pipe([wave, wave[:5000]], chunk_length_s=0.4, stride_length_s=0.1, batch_size=3),
            pipe(wave[:4000], return_timestamps="word")]


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_of_a_transposed_input_is_laid_out_as_on_a_gpu(train):
    """cuDNN (and the CPU's kernel) give a batch norm's output, and the input's gradient, in the
    input's suggested memory format, where the meta kernel keeps its strides: a Linear after it
    (a matmul's view) and the strides a program reads must be the GPU's."""
    found = []
    for dev in ("cuda", "cpu"):
        torch.manual_seed(0)
        bn, linear = torch.nn.BatchNorm1d(8).to(dev).train(train), torch.nn.Linear(8, 4).to(dev)
        x = D(2, 20, 8).to(dev).requires_grad_()
        y = bn(x.transpose(1, 2))
        out = linear(torch.relu(y.transpose(1, 2)))
        out.square().sum().backward()
        seen = [y.stride(), out.detach().cpu(), x.grad.stride(), x.grad.cpu(), bn.weight.grad.cpu().clone()]
        bn(D(2, 20, 8).to(dev).transpose(1, 2)).square().sum().backward()  # (an input that needs no gradient)
        found.append([*seen, bn.weight.grad.cpu()])
    _assert_same(*(_plain(f) for f in found))


#: ops whose CPU kernel lays a channels-last (or transposed) input's output out otherwise than
#: CUDA's, as super-resolution upsamplers and padded vision backbones run them
LAID_OUT = {
    "pixel_shuffle": lambda x: torch.nn.functional.pixel_shuffle(x, 2),
    "pixel_unshuffle": lambda x: torch.nn.functional.pixel_unshuffle(x, 2),
    "channel_shuffle": lambda x: torch.nn.functional.channel_shuffle(x, 2),
    "reflection_pad": lambda x: torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect"),
    "replication_pad": lambda x: torch.nn.functional.pad(x, (1, 1, 1, 1), mode="replicate"),
    "log_sigmoid": lambda x: torch.nn.functional.logsigmoid(x.flatten(2)),
    "rrelu_eval": lambda x: torch.nn.functional.rrelu(x.flatten(2), training=False),
    "glu": lambda x: torch.nn.functional.glu(x, 1),
}


@pytest.mark.parametrize("name", list(LAID_OUT))
def test_output_storage_is_laid_out_as_the_client_was_told(name):
    """The gateway's storage is in the strides the client's metadata gives (CUDA's), so what is
    planned on them (a view, ``as_strided``, a reshape) reads the values in the right order."""
    op = LAID_OUT[name]
    x = D(2, 8, 6, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    want = op(x)
    want.backward(D(*want.shape, seed=1))
    xc = x.detach().cuda().contiguous(memory_format=torch.channels_last).requires_grad_()
    got = op(xc)
    got.backward(D(*got.shape, seed=1).cuda())
    for y, expected in ((got, want), (xc.grad, x.grad)):
        torch.testing.assert_close(y.as_strided(y.shape, y.stride()).cpu(), expected.detach())
        torch.testing.assert_close(y.reshape(-1).cpu(), expected.detach().reshape(-1))


@pytest.mark.parametrize("name", list(CASES))
def test_vision_audio_head_matches_local(name):
    for module in NEEDS.get(name, ()):
        pytest.importorskip(module)
    results = []
    for dev in ("cuda", "cpu"):
        torch.manual_seed(0)
        results.append(_plain(CASES[name](dev)))
    _assert_same(*results)
