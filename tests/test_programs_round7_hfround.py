"""Hugging Face programs, round 7, shrunk (tiny configs, no hub, seeded synthetic data) and run
unchanged with plain ``python`` (the local CPU) and under ``remotecuda run`` on a CPU gateway;
the JSON each prints last must agree value by value (tests/test_corpus.py's rules). The programs
live in tests/corpus:

- hf_electra_pretrain: ELECTRA's replaced-token detection (a generator whose embeddings are the
  discriminator's, -100 labels off the masked positions, ``torch.where`` replacements, a
  checkpointed discriminator, transformers' warm-up schedule, ``clip_grad_norm_``), the
  vocabulary grown by ``resize_token_embeddings(pad_to_multiple_of=8)`` and the model saved and
  loaded back onto the device; then ALBERT's MLM + sentence-order pre-training with eager
  attention, ``output_attentions``/``output_hidden_states`` and mean-pooled sentence embeddings.

Beside it, in-process cases ('cuda' against the local CPU) for what no other test reaches:

- musicgen_guided_delay_pattern: MusicGen's codebooks decoded under its delay pattern with
  classifier-free guidance (the batch doubled with an unconditional half), then EnCodec's decoder
  turning the codes into audio;
- t5gemma_train_and_beams: T5Gemma (an encoder-decoder of Gemma 2 layers: sliding and full
  attention, soft-capping) trained on -100 labels and decoded by beam search;
- gemma2_static_cache_beams: a static cache with sliding-window layers, the prompt longer than the
  window, reordered by beam search, several sequences returned;
- trainer_token_classification: the ``Trainer`` on padded variable-length batches with
  ``batch_eval_metrics`` (the metric reads 'cuda' predictions batch by batch), the input tokens
  counted on the device, label smoothing, Adafactor, a cosine schedule with restarts, gradient
  clipping, and ``predict`` concatenating batches of different lengths."""
from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
from local_parity import assert_matches_local, registry
from test_corpus import F32, assert_program_matches

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("remote")

PROGRAMS = [  # (program in tests/corpus, tolerance)
    ("hf_electra_pretrain", F32),
]


@pytest.mark.parametrize("name,tol", PROGRAMS, ids=[name for name, _ in PROGRAMS])
def test_program_matches_local(gateway, name: str, tol: tuple[float, float]):
    """The program prints under ``remotecuda run`` what it prints with plain ``python``."""
    assert_program_matches(gateway, name, tol)


CASES, case = registry()
IDS = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(1))
MASK = torch.ones_like(IDS)
MASK[1, 8:] = 0  # the second row right-padded
ENC = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
GEMMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4,
             layer_types=["sliding_attention", "full_attention"])


def _grad_norms(model: torch.nn.Module) -> torch.Tensor:
    return torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])


@case
def musicgen_guided_delay_pattern(dev):
    torch.manual_seed(0)
    text = T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, dropout_rate=0.0)
    audio = T.EncodecConfig(codebook_size=32, hidden_size=8, num_filters=4, upsampling_ratios=[2, 2],
                            num_residual_layers=1, codebook_dim=8, sampling_rate=800, target_bandwidths=[2.0])
    decoder = T.MusicgenDecoderConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      ffn_dim=64, num_codebooks=2, pad_token_id=32, bos_token_id=32, dropout=0.0,
                                      max_position_embeddings=64)
    model = T.MusicgenForConditionalGeneration(T.MusicgenConfig(
        text_encoder=text.to_dict(), audio_encoder=audio.to_dict(), decoder=decoder.to_dict())).to(dev).eval()
    model.generation_config.pad_token_id = model.generation_config.decoder_start_token_id = 32  # (past the codes)
    with torch.no_grad():
        out = model.generate(input_ids=IDS.to(dev), attention_mask=MASK.to(dev), max_new_tokens=6, do_sample=False,
                             guidance_scale=3.0, return_dict_in_generate=True, output_scores=True)
    return [out.sequences, torch.stack(out.scores)]  # (the sequences are EnCodec's audio)


@case
def t5gemma_train_and_beams(dev):
    torch.manual_seed(0)
    module = T.T5GemmaModuleConfig(**GEMMA, attn_logit_softcapping=5.0)
    model = T.T5GemmaForConditionalGeneration(T.T5GemmaConfig(
        encoder=module, decoder=module, vocab_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        dropout_rate=0.0, attention_dropout=0.0)).to(dev)
    labels = IDS[:, :6].clone()
    labels[1, 4:] = -100
    out = model(input_ids=IDS.to(dev), attention_mask=MASK.to(dev), labels=labels.to(dev))
    out.loss.backward()
    model.eval()
    with torch.no_grad():
        beams = model.generate(input_ids=IDS.to(dev), attention_mask=MASK.to(dev), max_new_tokens=5, num_beams=3,
                               num_return_sequences=2, do_sample=False)
    return [out.loss, out.logits, _grad_norms(model), beams]


@case
def gemma2_static_cache_beams(dev):
    torch.manual_seed(0)
    model = T.Gemma2ForCausalLM(T.Gemma2Config(**GEMMA, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                               final_logit_softcapping=5.0, attn_logit_softcapping=3.0)).to(dev).eval()
    prompt = IDS[:, :9].clone()
    prompt[1, :3] = 0  # left-padded
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (remotecuda says the compiled step runs eagerly: tests/test_hf_more.py)
        return model.generate(prompt.to(dev), attention_mask=(prompt != 0).long().to(dev), max_new_tokens=6,
                              pad_token_id=0, do_sample=False, cache_implementation="static", num_beams=3,
                              num_return_sequences=2)


class _TokenAccuracy:
    """A ``batch_eval_metrics`` metric: fed each batch's predictions where the model ran."""

    def __init__(self):
        self.right = self.total = 0
        self.devices: set[str] = set()

    def __call__(self, p: object, compute_result: bool = False) -> dict:
        preds, labels = p.predictions.argmax(-1), p.label_ids
        self.devices.add(preds.device.type)
        keep = labels != -100
        self.right += (preds[keep] == labels[keep]).sum().item()
        self.total += keep.sum().item()
        if not compute_result:
            return {}
        result, self.right, self.total = {"accuracy": self.right / self.total}, 0, 0
        return result


def _padded(rows: list) -> dict:
    n = max(len(r["input_ids"]) for r in rows)
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * (n - len(r["input_ids"])) for r in rows]),
            "labels": torch.tensor([r["labels"] + [-100] * (n - len(r["labels"])) for r in rows])}


@case
def trainer_token_classification(dev):
    g = torch.Generator().manual_seed(5)
    rows = []
    for i in range(10):
        n = 4 + (i * 3) % 7
        rows.append({"input_ids": torch.randint(3, 60, (n,), generator=g).tolist(),
                     "labels": torch.randint(0, 3, (n,), generator=g).tolist()})
    torch.manual_seed(0)
    model = T.ElectraForTokenClassification(T.ElectraConfig(**ENC, embedding_size=16, num_labels=3,
                                                            classifier_dropout=0.0))
    metric = _TokenAccuracy()
    with tempfile.TemporaryDirectory() as out:
        args = T.TrainingArguments(
            out, per_device_train_batch_size=4, per_device_eval_batch_size=3, num_train_epochs=2, report_to=[],
            use_cpu=(dev == "cpu"), batch_eval_metrics=True, include_num_input_tokens_seen=True, eval_strategy="epoch",
            save_strategy="no", logging_steps=1, learning_rate=1e-2, label_smoothing_factor=0.1,
            lr_scheduler_type="cosine_with_restarts", warmup_steps=1, optim="adafactor", max_grad_norm=0.5)
        trainer = T.Trainer(model=model, args=args, data_collator=_padded, train_dataset=rows, eval_dataset=rows[:7],
                            compute_metrics=metric)
        trained = trainer.train()
        predicted = trainer.predict(rows[:7])
    assert trainer.model.device.type == dev and metric.devices == {dev}
    history = [[h.get(k) for k in ("loss", "grad_norm", "num_input_tokens_seen", "eval_accuracy", "eval_loss")]
               for h in trainer.state.log_history]
    return [trained.training_loss, torch.tensor([[float("nan") if v is None else v for v in h] for h in history]),
            torch.from_numpy(predicted.predictions), torch.from_numpy(predicted.label_ids),
            predicted.metrics["test_loss"], predicted.metrics["test_accuracy"]]


@pytest.mark.parametrize("name", list(CASES))
def test_hf_case_matches_local(name):
    assert_matches_local(CASES[name])
