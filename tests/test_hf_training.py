"""Hugging Face training stacks on 'cuda' as their users configure them (tiny configs, no hub):
a causal LM's ``Trainer`` with gradient accumulation counting the batch's label tokens on the device,
evaluation through ``preprocess_logits_for_metrics``, against the local CPU; and the ``Trainer``'s
mixed precision deciding from the device's capability answers."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
from local_parity import assert_matches_local

from conftest import GatewayProcess, active_over

os.environ.setdefault("HF_HUB_OFFLINE", "1")
T = pytest.importorskip("transformers")

IDS = torch.randint(1, 50, (16, 10), generator=torch.Generator().manual_seed(1))
LABELS = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2))


class _Rows(torch.utils.data.Dataset):
    """Examples as Python lists, as a ``datasets`` map would give them."""

    def __len__(self) -> int:
        return len(IDS)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": IDS[i].tolist(), "labels": int(LABELS[i])}


def _classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.BertForSequenceClassification(T.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _left_padded_lm_batch(rows: list) -> dict:
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([[0] * (n - len(r["input_ids"])) + r["input_ids"] for r in rows])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _causal_lm_trainer(dev: str) -> tuple:
    """Ragged rows: the loss of an accumulated step divides by the label tokens of all its batches
    (``num_items_in_batch``, counted on the device), the logits become argmaxes on the device."""
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    rows = [{"input_ids": IDS[i, :5 + i % 6].tolist()} for i in range(8)]

    def token_accuracy(p: object) -> dict:
        seen = p.label_ids[:, 1:] != -100
        return {"acc": float((p.predictions[:, :-1] == p.label_ids[:, 1:])[seen].mean())}
    with tempfile.TemporaryDirectory() as out:
        args = T.TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
            learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=1, eval_strategy="steps", eval_steps=2,
            per_device_eval_batch_size=5, seed=0, report_to=[], disable_tqdm=True, logging_steps=1,
            save_strategy="no", use_cpu=dev == "cpu")
        trainer = T.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows,
                            data_collator=_left_padded_lm_batch, compute_metrics=token_accuracy,
                            preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
        trainer.train()
    history = trainer.state.log_history
    return ([h["loss"] for h in history if "loss" in h], [h["grad_norm"] for h in history if "grad_norm" in h],
            [(h["eval_loss"], h["eval_acc"]) for h in history if "eval_loss" in h], model.lm_head.weight)


def test_causal_lm_trainer_accumulating_matches_local(remote):
    assert_matches_local(_causal_lm_trainer)


@pytest.fixture(scope="module")
def t4():
    """remotecuda active over one simulated T4 (compute capability 7.5: bfloat16 emulated, not native)."""
    gw = GatewayProcess("--gpus", "1", "--gpu-name", "Tesla T4", "--gpu-capability", "7.5")
    try:
        with active_over(gw.address):
            yield gw
    finally:
        gw.stop()


def test_bf16_trainer_on_a_gpu_without_native_bf16(t4):
    """On a T4 torch answers ``is_bf16_supported()`` yes (it makes a bfloat16 tensor there: emulated)
    and ``including_emulation=False`` no, so ``TrainingArguments(bf16=True)`` trains in bfloat16
    autocast; the gateway's native-only answer had it refuse ("Your setup doesn't support bf16/gpu")."""
    assert torch.cuda.get_device_capability() == (7, 5)
    assert torch.cuda.is_bf16_supported() and not torch.cuda.is_bf16_supported(including_emulation=False)
    with tempfile.TemporaryDirectory() as out:
        args = T.TrainingArguments(output_dir=out, bf16=True, max_steps=2, per_device_train_batch_size=4,
                                   learning_rate=1e-3, seed=0, report_to=[], disable_tqdm=True, logging_steps=1,
                                   save_strategy="no")
        trainer = T.Trainer(model=_classifier(), args=args, train_dataset=_Rows())
        trainer.train()
    assert (str(args.device), trainer.accelerator.mixed_precision) == ("cuda:0", "bf16")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(1.0 < x < 1.2 for x in losses), losses  # (ln 3 ≈ 1.1: three classes)
    assert next(trainer.model.parameters()).dtype == torch.float32
