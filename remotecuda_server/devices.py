"""What devices a gateway serves, probed in a child process.

The supervisor itself never initialises CUDA: a CUDA context costs hundreds of MB
per GPU and belongs in the session workers.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass

_PROBE = r"""
import json, torch
out = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(dict(index=i, kind="cuda", torch_device=f"cuda:{i}", name=p.name,
                        total_memory=p.total_memory, capability=[p.major, p.minor],
                        multi_processor_count=p.multi_processor_count,
                        bf16=bool(torch.cuda.is_bf16_supported())))
print(json.dumps(out))
"""


@dataclass
class DeviceInfo:
    index: int
    kind: str  # "cuda" or "cpu"
    torch_device: str  # what the worker passes to torch.device
    name: str
    total_memory: int
    capability: list
    multi_processor_count: int
    bf16: bool = True
    simulated: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def cuda_devices() -> list[DeviceInfo]:
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        return [DeviceInfo(**d) for d in json.loads(out.strip().splitlines()[-1])]
    except (subprocess.SubprocessError, ValueError, IndexError):
        return []


def cpu_device() -> DeviceInfo:
    import os
    import platform

    import psutil
    return DeviceInfo(index=0, kind="cpu", torch_device="cpu",
                      name=f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
                      total_memory=psutil.virtual_memory().total, capability=[0, 0],
                      multi_processor_count=os.cpu_count() or 1, bf16=True)


def detect(device: str) -> tuple[list[DeviceInfo], str]:
    """Devices for ``--device auto|cuda|cpu`` and a note on the choice for the banner."""
    if device == "cpu":
        return [cpu_device()], "serving on the CPU (--device cpu)"
    gpus = cuda_devices()
    if gpus:
        return gpus, f"serving {len(gpus)} CUDA device(s)"
    if device == "cuda":
        raise SystemExit("remotecuda start --device cuda: no CUDA device is visible to this machine's torch")
    return [cpu_device()], "no CUDA device found: serving on the CPU"
