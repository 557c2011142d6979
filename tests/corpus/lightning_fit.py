"""A Lightning program: LightningModule + Trainer(accelerator="auto"), a DataLoader, validation,
a scheduler, gradient clipping, and a checkpoint reloaded."""

import json
import os
import tempfile
import warnings

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
L.seed_everything(0, verbose=False)


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


g = torch.Generator().manual_seed(1)
ds = TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g))
model = LitModel()
with tempfile.TemporaryDirectory() as d:
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        max_epochs=2,
        gradient_clip_val=0.5,
        default_root_dir=d,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(ds, batch_size=16), DataLoader(ds, batch_size=24))
    path = os.path.join(d, "m.ckpt")
    trainer.save_checkpoint(path)
    back = LitModel.load_from_checkpoint(path)
print(
    json.dumps(
        {
            "device": str(trainer.strategy.root_device),
            "losses": model.losses,
            "val": trainer.callback_metrics["val_loss"].item(),
            "back_on": str(back.device),
            "w": back.net[0].weight.sum().item(),
        }
    )
)
