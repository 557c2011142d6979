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


def _fit_and_resume(accelerator: str, root: str) -> dict:
    """A LightningModule trained in bf16-mixed with gradient clipping, accumulation, a scheduler
    and checkpoints, resumed from its last checkpoint, validated, and loaded onto the device."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = DataLoader(TensorDataset(x, (x.sum(1) > 0).long()), batch_size=8)

    class Net(L.LightningModule):
        def __init__(self, lr: float = 0.05):
            super().__init__()
            self.save_hyperparameters()
            self.lin = torch.nn.Linear(8, 2)

        def training_step(self, batch, i):
            loss = F.cross_entropy(self.lin(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, i):
            self.log("val_loss", F.cross_entropy(self.lin(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}

    common = dict(accelerator=accelerator, devices=1, precision="bf16-mixed", limit_train_batches=4,
                  limit_val_batches=2, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=root)
    ckpt = ModelCheckpoint(dirpath=f"{root}/checkpoints", save_last=True)
    torch.manual_seed(0)
    net = Net()
    trainer = L.Trainer(max_epochs=2, gradient_clip_val=0.5, accumulate_grad_batches=2, logger=CSVLogger(root),
                        callbacks=[ckpt, LearningRateMonitor()], **common)
    trainer.fit(net, data, data)
    out = {"fit": {k: float(v) for k, v in trainer.callback_metrics.items()},
           "weight": net.lin.weight.detach().cpu().clone()}
    resumed = Net()
    trainer = L.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, **common)
    trainer.fit(resumed, data, data, ckpt_path=ckpt.last_model_path)
    out["resumed"] = resumed.lin.weight.detach().cpu().clone()
    out["validate"] = trainer.validate(resumed, data, verbose=False)
    loaded = Net.load_from_checkpoint(ckpt.last_model_path, map_location=accelerator)
    out["loaded"] = (str(loaded.lin.weight.device), loaded.lin.weight.detach().cpu().clone())
    return out


@pytest.mark.usefixtures("remote")
def test_a_trainer_fits_resumes_and_loads_as_on_the_cpu(tmp_path):
    import torch
    local = _fit_and_resume("cpu", str(tmp_path / "cpu"))
    remote = _fit_and_resume("cuda", str(tmp_path / "cuda"))
    assert remote["fit"] == pytest.approx(local["fit"], rel=1e-5)
    assert remote["validate"][0] == pytest.approx(local["validate"][0], rel=1e-5)
    for key in ("weight", "resumed"):
        torch.testing.assert_close(remote[key], local[key])
    assert remote["loaded"][0] == "cuda:0" and local["loaded"][0] == "cpu"
    torch.testing.assert_close(remote["loaded"][1], local["loaded"][1])


def _metrics(device: str) -> dict:
    """torchmetrics' classification and regression metrics, forward (a batch's value) and
    accumulated over batches, in a MetricCollection, then reset."""
    import torch
    tm = pytest.importorskip("torchmetrics")
    from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score
    from torchmetrics.regression import MeanSquaredError, PearsonCorrCoef

    torch.manual_seed(0)
    probs, target = torch.randn(4, 16, 3).softmax(-1), torch.randint(0, 3, (4, 16))
    pred, truth = torch.randn(4, 16), torch.randn(4, 16)
    classes = tm.MetricCollection({"acc": MulticlassAccuracy(3), "f1": MulticlassF1Score(3),
                                   "auroc": MulticlassAUROC(3)}).to(device)
    regression = tm.MetricCollection([MeanSquaredError(), PearsonCorrCoef()]).to(device)
    steps = []
    for i in range(4):
        steps.append(classes(probs[i].to(device), target[i].to(device)))
        regression.update(pred[i].to(device), truth[i].to(device))
    out = {"step": {k: v.cpu() for k, v in steps[-1].items()},
           "epoch": {k: v.cpu() for k, v in {**classes.compute(), **regression.compute()}.items()}}
    classes.reset()
    classes.update(probs[0].to(device), target[0].to(device))
    out["after_reset"] = {k: v.cpu() for k, v in classes.compute().items()}
    out["device"] = str(classes["acc"].tp.device)
    return out


@pytest.mark.usefixtures("remote")
def test_torchmetrics_on_cuda_give_the_cpu_values():
    import torch
    local, remote = _metrics("cpu"), _metrics("cuda")
    assert (local.pop("device"), remote.pop("device")) == ("cpu", "cuda:0")
    torch.testing.assert_close(remote, local)


DDP_FIT = r'''
import torch, lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

if __name__ == "__main__":
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = L.Trainer(accelerator=accelerator, devices=2, strategy="ddp", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    trainer.fit(model, DataLoader(data, batch_size=8))
    if trainer.global_rank == 0:
        print("RESULT", trainer.strategy.root_device, [p.detach().cpu().tolist() for p in model.parameters()],
              float(trainer.callback_metrics["loss"]))
'''


def test_a_trainer_on_two_devices_trains_by_ddp_as_on_the_cpu(tmp_path):
    """``Trainer(devices=2, strategy="ddp")`` under ``remotecuda run``: Lightning starts the second
    rank as a subprocess (activated: remotecuda/children.py), asks for nccl (run as gloo) and
    wraps the model in DistributedDataParallel (remotecuda/ddp.py); the weights and the synced
    loss are the CPU's (gloo, two processes)."""
    gw = GatewayProcess("--spare", "2", "--gpus", "2")
    try:
        script = tmp_path / "fit.py"
        script.write_text(DDP_FIT)
        remote = ["-m", "remotecuda", "run", "--server", gw.address, "python", str(script)]
        runs = [run_python("", args=[str(script)], timeout=300), run_python("", args=remote, timeout=300)]
    finally:
        gw.stop()
    results = []
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
        results.append(next(line for line in r.stdout.splitlines() if line.startswith("RESULT")).split(" ", 2))
    assert [device for _, device, _ in results] == ["cpu", "cuda:0"]
    assert results[0][2] == results[1][2]
