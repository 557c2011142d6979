"""What devices a gateway serves: CUDA GPUs probed in a child process, the CPU, or simulated GPUs.

The supervisor itself never initialises CUDA: a CUDA context costs hundreds of MB
per GPU and belongs in the session workers.

A simulated GPU (``--device cpu --gpus N``) runs its ops on the CPU, so its ``kind`` is
"cpu" (the client picks the fused ops a CPU runs), but it has a GPU's name, compute
capability and memory size, and the size is enforced (memory_account.py). It is marked
``simulated`` wherever it is reported, so nobody mistakes it for a GPU.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field

#: the other facts of torch's _CudaDeviceProperties a CUDA GPU reports (``torch.cuda.get_device_properties``)
MORE = ("L2_cache_size", "warp_size", "max_threads_per_block", "max_threads_per_multi_processor",
        "regs_per_multiprocessor", "shared_memory_per_block", "shared_memory_per_block_optin",
        "shared_memory_per_multiprocessor", "clock_rate", "memory_clock_rate", "memory_bus_width",
        "is_integrated", "is_multi_gpu_board", "pci_bus_id", "pci_device_id", "pci_domain_id")

_PROBE = r"""
import json, torch
out = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        # bfloat16 run natively, torch's rule (is_bf16_supported(including_emulation=False), which
        # older torch lacks): the client adds the emulation a T4's torch also answers yes to
        bf16 = p.major >= 8 or torch.version.hip is not None
        more = {k: getattr(p, k) for k in MORE if isinstance(getattr(p, k, None), (int, float, str, bool))}
        if hasattr(p, "uuid"):
            more["uuid"] = str(p.uuid)
        out.append(dict(index=i, kind="cuda", torch_device=f"cuda:{i}", name=p.name,
                        total_memory=p.total_memory, capability=[p.major, p.minor],
                        multi_processor_count=p.multi_processor_count, bf16=bf16,
                        cuda_version=torch.version.cuda, more=more))
print(json.dumps(out))
"""
_PROBE = _PROBE.replace("import json, torch\n", f"import json, torch\nMORE = {MORE!r}\n", 1)  # (in the child)

#: a simulated GPU's defaults
SIMULATED_NAME = "Simulated GPU"
SIMULATED_MEMORY = "16GiB"
SIMULATED_CAPABILITY = "8.0"
#: the CUDA runtime a simulated GPU reports (a client's ``torch.version.cuda``): code checks it to
#: tell a CUDA machine, e.g. transformers before it turns TF32 on
SIMULATED_CUDA_VERSION = "12.8"


@dataclass
class DeviceInfo:
    index: int  # its place on this gateway: what a HELLO names
    kind: str  # "cuda" or "cpu": the kernels that run its ops
    torch_device: str  # what the worker passes to torch.device
    name: str
    total_memory: int
    capability: list
    multi_processor_count: int
    bf16: bool = True
    simulated: bool = False
    cuda_version: str | None = None  # the gateway torch's CUDA runtime (None: the CPU)
    more: dict = field(default_factory=dict)  # a CUDA GPU's other properties (MORE, and its uuid)

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
    import platform

    import psutil
    return DeviceInfo(index=0, kind="cpu", torch_device="cpu",
                      name=f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
                      total_memory=psutil.virtual_memory().total, capability=[0, 0],
                      multi_processor_count=os.cpu_count() or 1, bf16=True)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """``24GB`` (10^9), ``24GiB`` (2^30), ``512MB``, ``1.5GiB`` or plain bytes → bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size (e.g. 24GB, 80GiB, 512MB, 1073741824)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return n


def _per_gpu(option: str, text: str, n: int) -> list[str]:
    """A comma-separated option: one value for every GPU, or one each."""
    values = [v.strip() for v in text.split(",")]
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"{option} gives {len(values)} values for {n} simulated GPUs (give one, or one each)")
    return values


def _capability(text: str) -> list[int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not m:
        raise ValueError(f"a compute capability is MAJOR.MINOR (e.g. 8.0), got {text!r}")
    return [int(m.group(1)), int(m.group(2))]


def simulated_devices(n: int, memory: str | None = None, name: str | None = None,
                      capability: str | None = None) -> list[DeviceInfo]:
    """``n`` simulated GPUs; each option is one value for all, or a comma-separated value each.
    bfloat16 follows the capability, as on CUDA (native from 8.0, Ampere)."""
    if n < 1:
        raise ValueError(f"--gpus N needs at least one simulated GPU, got {n}")
    try:
        sizes = [parse_size(v) for v in _per_gpu("--gpu-memory", memory or SIMULATED_MEMORY, n)]
    except ValueError as e:  # name the option: --session-memory takes sizes too
        raise ValueError(f"--gpu-memory: {e}") from None
    names = _per_gpu("--gpu-name", name or SIMULATED_NAME, n)
    caps = [_capability(v) for v in _per_gpu("--gpu-capability", capability or SIMULATED_CAPABILITY, n)]
    return [DeviceInfo(index=i, kind="cpu", torch_device="cpu", name=names[i], total_memory=sizes[i],
                       capability=caps[i], multi_processor_count=os.cpu_count() or 1,
                       bf16=tuple(caps[i]) >= (8, 0), simulated=True, cuda_version=SIMULATED_CUDA_VERSION)
            for i in range(n)]


def _select(gpus: list[DeviceInfo], wanted: str) -> list[DeviceInfo]:
    """The CUDA devices ``--gpus 0,2`` names, renumbered 0..k-1 as the gateway's (as CUDA_VISIBLE_DEVICES does)."""
    try:
        indices = [int(v) for v in wanted.split(",")]
    except ValueError:
        raise ValueError(f"--gpus selects CUDA devices by index (e.g. 0,1), got {wanted!r}") from None
    have = {d.index: d for d in gpus}
    missing = [i for i in indices if i not in have]
    if missing or len(set(indices)) != len(indices):
        raise ValueError(f"--gpus {wanted}: this machine has CUDA devices {sorted(have)}")
    return [DeviceInfo(**dict(have[i].as_dict(), index=k)) for k, i in enumerate(indices)]


def detect(device: str, gpus: str | None = None, memory: str | None = None, name: str | None = None,
           capability: str | None = None) -> tuple[list[DeviceInfo], str]:
    """Devices for ``--device auto|cuda|cpu`` and ``--gpus`` (CUDA: which; CPU: how many simulated
    GPUs, sized by ``memory``, ``name``, ``capability``), and a note on the choice for the banner.
    A ValueError says what in the options is wrong."""
    shaped = [opt for opt, v in (("--gpu-memory", memory), ("--gpu-name", name),
                                 ("--gpu-capability", capability)) if v is not None]
    if device == "cpu":
        if gpus is None:
            if shaped:
                raise ValueError(f"{', '.join(shaped)} describe simulated GPUs: add --gpus N")
            return [cpu_device()], "serving on the CPU (--device cpu)"
        if not gpus.strip().isdigit():
            raise ValueError(f"with --device cpu, --gpus is how many simulated GPUs to serve, got {gpus!r}")
        sims = simulated_devices(int(gpus), memory, name, capability)
        return sims, f"serving {len(sims)} simulated GPU(s) on the CPU (--device cpu --gpus {gpus})"
    if shaped:
        raise ValueError(f"{', '.join(shaped)} describe simulated GPUs: use them with --device cpu --gpus N")
    found = cuda_devices()
    if found:
        chosen = found if gpus is None else _select(found, gpus)
        return chosen, f"serving {len(chosen)} CUDA device(s)"
    if device == "cuda":
        raise SystemExit("remotecuda start --device cuda: no CUDA device is visible to this machine's torch")
    if gpus is not None:
        raise ValueError(f"--gpus {gpus}: no CUDA device is visible; simulated GPUs are "
                         "--device cpu --gpus N")
    return [cpu_device()], "no CUDA device found: serving on the CPU"
