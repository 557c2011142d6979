"""Data loading and processes as training scripts use them, on 'cuda' through remotecuda, against
a local CPU run and against what torch does on a GPU machine: DataLoader workers (forked and
spawned), pinned memory, worker seeding, generators given to samplers, a default device of 'cuda',
and children forked after the program used 'cuda' (CUDA's "bad fork", remotecuda/forked_child.py)."""
from __future__ import annotations

import multiprocessing
import os
import random
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, random_split

import remotecuda

from conftest import harness_activate, private_discovery, run_python

pytestmark = pytest.mark.usefixtures("remote")

#: what a GPU's torch raises at a forked child's first CUDA use (torch/cuda/__init__.py, _lazy_init)
BAD_FORK = ("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
            "you must use the 'spawn' start method")


class Rows(Dataset):
    """A small map-style dataset whose items draw from torch's generator (as augmentations do),
    so that the batches show each worker's seeding."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.randn(3) + i, i


def _seed_libraries(worker_id: int) -> None:
    random.seed(torch.initial_seed() % 2**32)


def _to_cuda(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A collate_fn that moves the batch to 'cuda' (right with num_workers=0 only)."""
    return torch.stack([x for x, _ in batch]).to("cuda"), torch.tensor([i for _, i in batch], device="cuda")


def _epoch(device: str, **loader: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    out = []
    for x, i in DataLoader(Rows(), batch_size=4, shuffle=True, **loader):
        x, i = x.to(device, non_blocking=True), i.to(device, non_blocking=True)
        out.append((x * 2 + i[:, None]).cpu())
    return out


@pytest.mark.parametrize("loader", [
    lambda: {"num_workers": 2, "pin_memory": True},
    lambda: {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 3},
    lambda: {"num_workers": 2, "worker_init_fn": _seed_libraries, "generator": torch.Generator().manual_seed(5)},
], ids=["pinned", "persistent prefetch", "worker_init_fn generator"])
def test_worker_batches_reach_cuda_as_they_reach_the_cpu(loader):
    remote = _epoch("cuda", **loader())
    local = _epoch("cpu", **loader())
    assert len(remote) == 3 and all(torch.equal(r, c) for r, c in zip(remote, local))


def _loader_error(**loader: object) -> BaseException:
    with pytest.raises(BaseException) as info:
        for _ in DataLoader(Rows(), batch_size=4, **loader):
            pass
    return info.value


def test_a_collate_fn_moving_batches_to_cuda_in_forked_workers_raises_what_a_gpu_raises():
    """A forked worker's first CUDA use raised the CPU build's "PyTorch is not linked with support
    for cuda devices", as if remotecuda were broken; a GPU's torch says the worker cannot use CUDA
    (the program initialized CUDA before the workers were forked: tests/test_processes.py has the
    workers forked before)."""
    torch.ones(1, device="cuda")
    e = _loader_error(num_workers=2, collate_fn=_to_cuda)
    assert type(e) is RuntimeError and BAD_FORK in str(e), e
    x, i = next(iter(DataLoader(Rows(), batch_size=4, collate_fn=_to_cuda)))  # in the main process: fine
    assert x.device.type == i.device.type == "cuda" and i.tolist() == [0, 1, 2, 3]


def test_a_default_device_of_cuda_in_forked_workers_raises_what_a_gpu_raises():
    """``torch.set_default_device('cuda')`` before a DataLoader with workers: the worker's
    ``torch.randn`` raised NotImplementedError ("Could not run 'aten::randn' with arguments from
    the 'CUDA' backend"); a GPU's torch raises its bad-fork RuntimeError."""
    torch.set_default_device("cuda")
    try:
        e = _loader_error(num_workers=2)
        x, i = next(iter(DataLoader(Rows(), batch_size=4)))  # no workers: the batch is made on 'cuda'
    finally:
        torch.set_default_device(None)
    assert type(e) is RuntimeError and BAD_FORK in str(e), e
    assert x.device.type == i.device.type == "cuda"


def test_a_default_device_of_cuda_with_shuffle_raises_torchs_generator_error():
    """torch's known trap: RandomSampler's CPU generator meets randperm's default device."""
    torch.set_default_device("cuda")
    try:
        e = _loader_error(shuffle=True)
    finally:
        torch.set_default_device(None)
    assert type(e) is RuntimeError and str(e) == "Expected a 'cuda' device type for generator but found 'cpu'"


@pytest.mark.parametrize("use", [
    lambda g: random_split(range(10), [3, 7], generator=g),
    lambda g: list(RandomSampler(range(10), generator=g)),
    lambda g: list(DataLoader(range(8), batch_size=4, generator=g)),
], ids=["random_split", "RandomSampler", "DataLoader"])
def test_a_cuda_generator_given_to_data_loading_raises_torchs_error(use):
    """The classic GPU user error: samplers draw on the CPU and refuse a 'cuda' generator."""
    with pytest.raises(RuntimeError, match="^Expected a 'cpu' device type for generator but found 'cuda'$"):
        use(torch.Generator(device="cuda").manual_seed(1))


def _child(conn) -> None:
    """In a child forked after the parent used 'cuda': what it sees, then its own activation, which
    finds the gateways the parent named (the run's are not heard on multicast)."""
    seen: list = [torch.cuda.is_available(), torch.cuda.device_count()]
    torch.manual_seed(0)  # (leaves the CUDA generators alone, as in a bad fork)
    for use in (lambda: torch.zeros(2, device="cuda"), lambda: torch.ones(2).cuda(),
                lambda: torch.nn.Linear(2, 2).to("cuda"), lambda: torch.cuda.current_device()):
        try:
            use()
            seen.append("no error")
        except BaseException as e:  # noqa: BLE001  (the kind is what is compared)
            seen.append(f"{type(e).__name__}: {e}")
    remotecuda.activate(fallback="error")  # a child may activate itself: its own session
    torch.manual_seed(0)
    seen.append(torch.randn(3, device="cuda").tolist())
    remotecuda.deactivate()
    conn.send(seen)


def test_a_child_forked_after_cuda_use_is_a_bad_fork_until_it_activates():
    x = torch.ones(2, device="cuda") * 2
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send,))
    child.start()
    send.close()  # (the child's end only: a child that fails ends the pipe, not a 120 s wait)
    seen = receive.recv() if receive.poll(120) else "no answer"
    child.join(30)
    torch.manual_seed(0)
    assert seen == [True, torch.cuda.device_count(), *[f"RuntimeError: {BAD_FORK}"] * 4,
                    torch.randn(3, device="cuda").tolist()], seen
    assert x.sum().item() == 4.0 and os.getpid() != child.pid


@pytest.fixture
def activated_as_a_program(gateway):
    """The run's activation made again as a program makes it, naming its gateway to the processes
    it starts (the harness's own activations do not: conftest.harness_activate)."""
    remotecuda.deactivate()
    remotecuda.activate(gateway.address, fallback="error")
    yield
    remotecuda.deactivate()
    harness_activate(gateway.address)


@pytest.mark.usefixtures("activated_as_a_program")
def test_a_started_process_that_activates_finds_the_gateways_the_program_named(gateway):
    """``activate("host:port")`` and then a spawned child (``mp.spawn``, a DataLoader's spawn
    workers, ``subprocess``) that calls ``remotecuda.activate()``, as the README says to: the child
    looked for gateways by multicast, which does not cross networks, and found none (or another
    one); it is told of the named ones, as ``remotecuda run --server`` tells it."""
    code = ("import torch, remotecuda\n"
            "remotecuda.activate(fallback='error')\n"
            "print(remotecuda.runtime.active().pool.devices[0].endpoint, torch.ones(2, device='cuda').sum().item())")
    unheard = {"REMOTECUDA_DISCOVERY": private_discovery()}  # (a network where no gateway announces itself)
    r = run_python(code, env=unheard, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == [gateway.endpoint, "2.0"], r.stderr[-2000:]


def _hf_rows(device: str) -> list:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"x": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "y": [0, 1, 2]})
    rows = ds.with_format("torch", device=device)
    seen = [rows[0]["x"], rows[:2]["y"]]
    seen += [x * 2 + y[:, None] for x, y in ((b["x"], b["y"]) for b in DataLoader(rows, batch_size=2))]
    assert all(t.device.type == device for t in seen)
    return [t.cpu() for t in seen]


def test_hugging_face_datasets_formatted_for_cuda_give_what_they_give_on_the_cpu():
    """``ds.with_format("torch", device="cuda")``: rows, slices and a DataLoader's batches on 'cuda'."""
    remote, local = _hf_rows("cuda"), _hf_rows("cpu")
    assert len(remote) == 4 and all(torch.equal(r, c) and r.dtype == c.dtype for r, c in zip(remote, local))


def test_a_cuda_storage_is_shared_as_torch_says_of_every_cuda_storage():
    """Hogwild-style code asks whether parameters are in shared memory before starting processes:
    torch answers True for every CUDA storage (StorageSharing.cpp, isShared), and ``share_memory_``
    leaves a CUDA tensor as it is. The tensor said True, but its storage said False."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (TypedStorage is deprecated)
        model = torch.nn.Linear(2, 2).cuda().share_memory()
        w = model.weight
        assert w.device.type == "cuda" and w.is_shared() and not w.is_pinned()
        assert w.untyped_storage().is_shared() and w.storage().is_shared()
        assert w.untyped_storage().share_memory_().is_shared()


class CudaRows(Dataset):
    """Items made on 'cuda' (in a spawned worker that activated remotecuda itself)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), float(i), device="cuda")


def _activate(worker_id: int) -> None:
    remotecuda.activate(fallback="error")


@pytest.mark.usefixtures("activated_as_a_program")
def test_spawned_workers_making_cuda_batches_say_cuda_tensors_cannot_cross_processes():
    """A GPU's spawned workers send 'cuda' batches by CUDA IPC, which remote devices lack (README's
    limits). default_collate makes a worker's batch in memory to share (``_new_shared``): it said
    "torch.UntypedStorage(): Storage device not recognized: cuda", as if 'cuda' were unknown there."""
    loader = DataLoader(CudaRows(), batch_size=2, num_workers=1, multiprocessing_context="spawn",
                        worker_init_fn=_activate, timeout=120)
    batches = iter(loader)
    try:
        with pytest.raises(NotImplementedError, match="a cuda tensor cannot be sent to another process"):
            next(batches)
    finally:
        batches._shutdown_workers()  # (now: the error's traceback keeps the iterator, and its worker, alive)
