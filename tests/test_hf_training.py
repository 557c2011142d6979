"""Hugging Face training stacks on 'cuda' as their users configure them (tiny configs, no hub):
the ``Trainer``'s mixed precision deciding from the device's capability answers."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

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
