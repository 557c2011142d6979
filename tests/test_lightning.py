"""PyTorch Lightning, Fabric and torchmetrics on 'cuda', compared with the same code on the CPU.

Lightning's batch-size finder raises its batch size until a step runs out of GPU memory, which
needs the out-of-memory error raised inside the trial that ran out, as a GPU raises it."""
from __future__ import annotations

import contextlib
import io

import pytest

from conftest import GatewayProcess, run_python

pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def quota_gw():
    gw = GatewayProcess("--spare", "1", "--session-memory", "64MiB")
    yield gw
    gw.stop()


FINDER = r'''
import os, tempfile, warnings
import torch, torch.nn.functional as F
import lightning as L
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset
warnings.filterwarnings("ignore")
torch.manual_seed(0)
X = torch.randn(4096, 64); Y = (X.sum(1) > 0).long()

class Net(L.LightningModule):
    def __init__(self, batch_size=4):
        super().__init__()
        self.batch_size = batch_size
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2))

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def train_dataloader(self):
        return DataLoader(TensorDataset(X, Y), batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

trainer = L.Trainer(accelerator="{acc}", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=tempfile.mkdtemp())
print("FOUND", Tuner(trainer).scale_batch_size(Net(), mode="power", init_val=256, max_trials=6, steps_per_trial=2))
'''


def test_the_batch_size_finder_stops_where_the_gpu_runs_out_of_memory(quota_gw):
    """A batch of 1024 needs two 16 MiB activations and their gradients past the 64 MiB quota; 512
    fits. The finder's trials share one optimizer, whose first step alone waited for the work
    before it: the out-of-memory error of the 1024 trial surfaced at the end, outside every
    trial, as "this tensor was never computed", and the finder failed. Every step that makes a
    tensor larger than any before now waits as the first did, so the error comes in its trial."""
    remote = run_python("import remotecuda; remotecuda.activate(fallback='error')\n" + FINDER.format(acc="cuda"),
                        env={"REMOTECUDA_SERVERS": quota_gw.address})
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert "FOUND 1024" in remote.stdout, remote.stdout
    local = io.StringIO()
    with contextlib.redirect_stdout(local), contextlib.redirect_stderr(io.StringIO()):
        exec(FINDER.format(acc="cpu").replace("init_val=256, max_trials=6", "init_val=2, max_trials=3"), {})
    assert "FOUND 8" in local.getvalue()  # (the same program on the CPU: 2, 4, 8)
