"""torch.cuda.* and tensor behaviour through a real gateway, compared with local PyTorch."""
from __future__ import annotations

import textwrap

import pytest
import torch

import remotecuda

from conftest import GatewayProcess, run_python

pytestmark = pytest.mark.usefixtures("remote")


def test_device_queries(gateway):
    assert torch.cuda.is_available() and torch.cuda.is_initialized()
    assert torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
    name = torch.cuda.get_device_name(0)
    assert name == torch.cuda.get_device_name() and "CPU" in name  # a --device cpu gateway
    props = torch.cuda.get_device_properties(0)
    assert props.name == name and props.total_memory > 0 and gateway.address in repr(props)
    assert torch.cuda.get_device_capability(0) == (props.major, props.minor)
    assert torch.cuda.is_bf16_supported()
    torch.cuda.set_device(0)
    with torch.cuda.device(0):
        assert torch.cuda.current_device() == 0
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(3)
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        torch.cuda.set_device("cuda")  # (as torch refuses it; it was ignored, the current device kept)
    torch.cuda.set_device(torch.device("cuda:0"))


def test_memory_accounting():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    x = torch.empty(1 << 20, device="cuda")  # 4 MiB
    assert torch.cuda.memory_allocated() >= before + 4 * (1 << 20)
    assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
    assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
    del x
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == before  # freed on the gateway when the wrapper died
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total


def test_memory_stats_has_every_counter_a_cuda_allocator_reports():
    """A trainer's memory monitor (torchtitan's, Lightning's DeviceStatsMonitor) reads
    ``memory_stats()`` counters by name; torch's own summary reads the rest."""
    x = torch.empty(1 << 18, device="cuda")
    stats = torch.cuda.memory_stats()
    for key in ("active_bytes.all.peak", "reserved_bytes.all.peak", "num_alloc_retries", "num_ooms",
                "allocation.all.current", "inactive_split_bytes.all.current", "requested_bytes.large_pool.freed"):
        assert key in stats, key
    assert stats["allocated_bytes.all.current"] == torch.cuda.memory_allocated() >= x.nbytes
    assert torch.cuda.max_memory_reserved() >= torch.cuda.max_memory_allocated() >= x.nbytes
    nested = torch.cuda.memory_stats_as_nested_dict()
    assert nested["active_bytes"]["all"]["peak"] == stats["active_bytes.all.peak"]
    assert nested["num_ooms"] == 0


def test_streams_and_events():
    s = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s):
        assert torch.cuda.current_stream() == s
        start.record()
        a = torch.randn(256, 256, device="cuda")
        for _ in range(5):
            a = a @ a / 256
        end.record()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    end.synchronize()
    ms = start.elapsed_time(end)
    assert 0 < ms < 60_000
    s.synchronize()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.cuda.Event().elapsed_time(end)


def test_factories_and_device_spellings():
    for dev in ("cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0):
        t = torch.zeros(2, 3, device=dev)
        assert t.is_cuda and t.device == torch.device("cuda", 0) and t.shape == (2, 3)
    assert torch.arange(5, device="cuda").cpu().tolist() == [0, 1, 2, 3, 4]
    assert torch.eye(2, device="cuda").cpu().tolist() == [[1, 0], [0, 1]]
    assert torch.full((2,), 7, device="cuda").cpu().tolist() == [7, 7]
    assert torch.linspace(0, 1, 3, device="cuda").cpu().tolist() == [0, 0.5, 1]
    t = torch.tensor([[1, 2], [3, 4]], device="cuda", dtype=torch.float64, requires_grad=True)
    assert t.is_leaf and t.requires_grad and t.dtype == torch.float64
    like = torch.ones_like(t)
    assert like.is_cuda and like.dtype == torch.float64
    with torch.device("cuda"):
        assert torch.ones(1).is_cuda
    assert torch.as_tensor([1, 2], device="cuda").is_cuda


def test_code_written_for_pinned_memory_runs_unchanged():
    """A CPU-only torch has no page-locked allocator and raises for pin_memory=True; a loop written
    for a local GPU (pinned buffers, DataLoader(pin_memory=True), non_blocking copies) must run."""
    import warnings
    buf = torch.empty(2, 3, pin_memory=True)
    assert buf.device.type == "cpu" and torch.zeros(3, pin_memory=True).tolist() == [0, 0, 0]
    assert torch.tensor([1.0, 2.0], pin_memory=True).pin_memory().tolist() == [1.0, 2.0]
    buf.copy_(torch.arange(6.0).view(2, 3))
    assert torch.equal(buf.cuda(non_blocking=True).cpu(), torch.arange(6.0).view(2, 3))
    ds = torch.utils.data.TensorDataset(torch.arange(12.0).view(6, 2), torch.arange(6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own: "no accelerator is found"
        got = [(x.cuda(non_blocking=True) * 2).sum().item() + y.cuda(non_blocking=True).sum().item()
               for x, y in torch.utils.data.DataLoader(ds, batch_size=4, pin_memory=True)]
    assert got == [2 * 28.0 + 6, 2 * 38.0 + 9]


def test_transfers_and_conversions():
    cpu = torch.arange(6.).reshape(2, 3)
    x = cpu.cuda()
    assert x.cuda() is x and x.to("cuda") is x and x.to("cuda:0", torch.float32) is x
    assert x.to(torch.float64).dtype == torch.float64
    assert torch.equal(x.cpu(), cpu) and torch.equal(x.to("cpu", torch.int64), cpu.long())
    assert torch.equal(cpu.to(x).cpu(), cpu) and cpu.to(x).is_cuda
    y = cpu.to("cuda", non_blocking=True)
    assert torch.equal(y.cpu(), cpu)
    assert x.tolist() == cpu.tolist() and x[1, 2].item() == 5.0 and bool(x[0, 1]) is True
    assert repr(x) == repr(cpu).replace(")", ", device='cuda:0')")
    cpu_t = torch.empty(2, 3)
    cpu_t.copy_(x)  # device-to-host copy_
    assert torch.equal(cpu_t, cpu)
    z = torch.zeros(2, 3, device="cuda")
    z.copy_(cpu)  # host-to-device copy_
    assert torch.equal(z.cpu(), cpu)


def test_printing_a_large_tensor_fetches_only_what_is_shown():
    """print(x) of a tensor too large to show whole shows its edge items: only they cross the
    network, in one round trip, and the text is what the whole tensor would print."""
    from torch._tensor_str import _str, _tensor_str
    g = torch.Generator().manual_seed(3)
    big = torch.randn(1000, 1000, generator=g)
    big[0, 0], big[-1, -1], big[500, 500] = float("nan"), float("inf"), 1e30  # (the middle is never shown)
    cases = [big, torch.randn(3, 400, 5, generator=g), torch.randn(40, 40, dtype=torch.complex64, generator=g),
             torch.randint(-5, 10**6, (30, 40), generator=g), torch.rand(2000, generator=g) > 0.5]
    try:
        for opts in ({}, {"edgeitems": 1, "threshold": 10}):
            torch.set_printoptions(**opts)
            for c in cases:
                r = c.cuda()
                torch.cuda.synchronize()
                remotecuda.stats(reset=True)
                text = repr(r)
                st = remotecuda.stats()
                assert text == _str(r, tensor_contents=_tensor_str(c, 7)).replace("Tensor(", "tensor(", 1)
                assert st["blocking_round_trips"] == 1 and st["bytes_down"] < 8192, (c.shape, st)
    finally:
        torch.set_printoptions(profile="default")
    assert "device='cuda:0'" in str(big[:2].cuda()) and f"{big[:3, 0].cuda()}" == str(big[:3, 0].cuda())
    # a view far larger than this machine's memory (4 TB) prints as the CPU's does, without a CPU copy of it
    huge, view = torch.arange(1000.), (10**9, 1000)
    r = huge.cuda().expand(view)
    assert repr(r) == _str(r, tensor_contents=_tensor_str(huge.expand(view), 7)).replace("Tensor(", "tensor(", 1)


def test_views_and_inplace_on_views_match_local():
    ref = torch.arange(24.).reshape(4, 6)
    x = ref.cuda()
    for t in (ref, x):
        t[0].add_(1)
        t[:, 1] += 2
        t.t()[2].mul_(10)
        v = t.view(2, 12)
        v[1, 3:5] = -1
        t.narrow(1, 4, 2).zero_()
        t.diagonal().fill_(9)
        t.unsqueeze_(0)
        t.squeeze_(0)
        t.transpose_(0, 1)
    assert x.shape == ref.shape and x.stride() == ref.stride()
    assert torch.equal(x.cpu(), ref)
    assert x.is_contiguous() == ref.is_contiguous()


def test_state_dict_round_trip():
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).cuda()
    model.load_state_dict(cpu_model.state_dict())  # cpu state dict → cuda model
    sd = model.state_dict()
    assert all(v.is_cuda for v in sd.values())
    back = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    back.load_state_dict({k: v.cpu() for k, v in sd.items()})
    for a, b in zip(back.state_dict().values(), cpu_model.state_dict().values()):
        assert torch.equal(a, b)
    model.load_state_dict(sd, assign=True)
    assert model[0].weight.is_cuda


def test_data_dependent_ops():
    ref = torch.tensor([[0.5, -1.0, 2.0], [0.0, 3.0, -0.5]])
    x = ref.cuda()
    assert torch.equal(torch.nonzero(x).cpu(), torch.nonzero(ref))
    assert torch.equal(torch.masked_select(x, x > 0).cpu(), torch.masked_select(ref, ref > 0))
    assert torch.equal(x[x > 0].cpu(), ref[ref > 0])
    u, inv, counts = torch.unique(x.round(), return_inverse=True, return_counts=True)
    ur, invr, cr = torch.unique(ref.round(), return_inverse=True, return_counts=True)
    assert torch.equal(u.cpu(), ur) and torch.equal(inv.cpu(), invr) and torch.equal(counts.cpu(), cr)
    n = 0
    if (x > 2.5).any():
        n += 1
    if (x > 5).any():
        n += 10
    assert n == 1
    r = x[x > 0] * 2  # the described output is usable afterwards
    assert torch.equal(r.cpu(), ref[ref > 0] * 2)


def test_a_cuda_generator_given_to_a_cpu_op_is_refused_as_on_a_gpu():
    """``DataLoader(shuffle=True, generator=torch.Generator('cuda'))`` draws its permutation on the
    CPU, which a GPU's torch refuses; here the generator's client-side carrier, a CPU generator,
    drew it silently, from a seed of its own, not the user's."""
    g = torch.Generator("cuda").manual_seed(0)
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'cuda'"):
        list(torch.utils.data.DataLoader(range(6), batch_size=2, shuffle=True, generator=g))
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator"):
        torch.empty(3).normal_(generator=g)
    assert sorted(torch.randperm(5, device="cuda", generator=g).tolist()) == [0, 1, 2, 3, 4]


def test_seeded_randomness_repeats():
    torch.manual_seed(1234)
    a = torch.randn(5, device="cuda")
    d = torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)
    torch.manual_seed(1234)
    b = torch.randn(5, device="cuda")
    d2 = torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)
    assert torch.equal(a.cpu(), b.cpu()) and torch.equal(d.cpu(), d2.cpu())
    torch.cuda.manual_seed(5)
    c = torch.rand(3, device="cuda")
    torch.cuda.manual_seed_all(5)
    assert torch.equal(torch.rand(3, device="cuda").cpu(), c.cpu())
    torch.cuda.seed()
    assert torch.cuda.initial_seed() != 5


def test_remote_errors_have_torch_types_and_the_session_survives():
    x = torch.randn(3, device="cuda")
    keep = x * 2
    bad = x[torch.tensor([7], device="cuda")]  # an async error: nothing raised yet
    with pytest.raises(IndexError, match="out of bounds") as info:
        torch.cuda.synchronize()
    assert "aten::index.Tensor" in "".join(info.value.__notes__)  # the message is the device's own
    with pytest.raises(RuntimeError, match="never computed"):
        bad.cpu()  # the failed op's output is invalid, with a clear reason
    assert torch.equal(keep.cpu(), x.cpu() * 2)  # tensors from before are intact
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(1 << 45, dtype=torch.uint8, device="cuda").sum().item()
    assert (x + 1).sum().item() == pytest.approx(x.sum().item() + 3, rel=1e-5)
    with pytest.raises(RuntimeError, match="broadcast|size of tensor"):  # shape errors stay synchronous
        torch.ones(2, device="cuda") + torch.ones(3, device="cuda")


def test_allocation_larger_than_the_gpu_raises_at_the_call():
    """As CUDA's allocator does: at the line that asked, not at the next sync."""
    total = torch.cuda.get_device_properties(0).total_memory
    n = total // 4 + 1
    keep = torch.arange(3.0, device="cuda")
    for make in (lambda: torch.empty(n, device="cuda"), lambda: torch.zeros(2, n // 2 + 1, device="cuda"),
                 lambda: torch.ones(n, 1, device="cuda").expand(n, 4).contiguous()):
        with pytest.raises(torch.cuda.OutOfMemoryError, match=r"CUDA out of memory. Tried to allocate .* GiB"):
            make()
    torch.cuda.synchronize()  # nothing was sent: no error left pending
    assert torch.ones(1, device="cuda").expand(n).shape == (n,)  # a view allocates nothing
    assert keep.sum().item() == 3.0


def test_sync_with_nothing_sent_since_is_free():
    """An idle GPU's synchronize returns in microseconds; torch.utils.benchmark's timer syncs at
    each reading and sizes its blocks by what an empty one costs (a round trip made
    blocked_autorange time a thousand runs a block where a GPU times a few)."""
    x = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    before = remotecuda.stats()["blocking_round_trips"]
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda.current_stream().synchronize()
    assert remotecuda.stats()["blocking_round_trips"] == before
    y = x * 2  # work sent since: waited for
    torch.cuda.synchronize()
    torch.cuda.synchronize()
    assert remotecuda.stats()["blocking_round_trips"] == before + 1
    used = torch.cuda.memory_allocated()
    del x  # a tensor freed since: freed on the gateway by the sync
    torch.cuda.synchronize()
    assert remotecuda.stats()["blocking_round_trips"] == before + 3
    assert torch.cuda.memory_allocated() == used - 16
    x = torch.ones(4, device="cuda")
    bad = x[torch.tensor([9], device="cuda")]  # an asynchronous error is still raised at the sync
    with pytest.raises(IndexError, match="out of bounds"):
        torch.cuda.synchronize()
    torch.cuda.synchronize()  # once
    del bad
    assert y.sum().item() == 8.0


def test_async_round_trips():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 1, device="cuda")
    for _ in range(2):  # warm the metadata cache
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    remotecuda.stats(reset=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert remotecuda.stats()["blocking_round_trips"] == 0, "a step that reads no value must not wait"
    loss.item()
    st = remotecuda.stats()
    assert st["blocking_round_trips"] == 1 and st["ops"] > 10 and st["metadata_cache_misses"] == 0


def test_sync_mode_raises_at_the_call_site(gateway):
    code = textwrap.dedent("""
        import torch, remotecuda
        remotecuda.activate()
        x = torch.randn(3, device='cuda')
        try:
            x[torch.tensor([9], device='cuda')]
        except IndexError as e:
            print('RAISED AT CALL SITE')
    """)
    r = run_python(code, env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_SYNC": "1",
                              "REMOTECUDA_FALLBACK": "error"})
    assert "RAISED AT CALL SITE" in r.stdout, r.stderr[-2000:]


def test_two_gateways_are_two_devices(gateway):
    other = GatewayProcess()
    try:
        code = textwrap.dedent("""
            import torch, remotecuda
            remotecuda.activate()
            assert torch.cuda.device_count() == 2
            a = torch.ones(3, device='cuda:0'); b = torch.ones(3, device='cuda:1')
            assert a.device.index == 0 and b.device.index == 1
            try:
                a + b
            except RuntimeError as e:
                assert 'cuda:0 and cuda:1' in str(e)
            else:
                raise SystemExit('mixing devices did not raise')
            c = a.to('cuda:1') + b
            with torch.cuda.device(1):
                d = torch.full((3,), 2.0, device='cuda')
            assert c.device.index == 1 and d.device.index == 1 and c.cpu().tolist() == [2.0] * 3
            print('OK')
        """)
        r = run_python(code, env={"REMOTECUDA_SERVERS": f"{gateway.address},{other.address}",
                                  "REMOTECUDA_FALLBACK": "error"})
        assert r.stdout.strip().endswith("OK"), r.stderr[-3000:]
    finally:
        other.stop()


def test_deactivate_restores_torch(gateway):
    code = textwrap.dedent("""
        import sys, torch, remotecuda
        assert 'torch._dynamo' not in sys.modules
        remotecuda.activate()
        remotecuda.deactivate()
        # activation does not import torch._dynamo (~1 s; its meta kernels do without, see
        # remotecuda/lazydynamo.py); its import wraps torch.manual_seed: torch's own doing, which stays
        assert 'torch._dynamo' not in sys.modules
        import torch._dynamo
        before = (torch.cuda.is_available, torch.manual_seed, torch.load, torch.Generator,
                  torch.cuda.device_count, torch.__future__.get_swap_module_params_on_conversion())
        remotecuda.activate()
        x = torch.ones(2, device='cuda')
        assert torch.cuda.is_available()
        remotecuda.deactivate()
        after = (torch.cuda.is_available, torch.manual_seed, torch.load, torch.Generator,
                 torch.cuda.device_count, torch.__future__.get_swap_module_params_on_conversion())
        assert before == after, (before, after)
        assert not torch.cuda.is_available()
        try:
            torch.ones(1, device='cuda')
        except (RuntimeError, AssertionError) as e:
            print('CUDA OFF:', type(e).__name__)
        print(torch.ones(2).cuda if False else 'OK')
    """)
    r = run_python(code, env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    assert "CUDA OFF" in r.stdout and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]


def test_a_gateway_that_dies_gives_a_clear_error_and_no_hang():
    gw = GatewayProcess()
    code = textwrap.dedent(f"""
        import os, signal, time, torch, remotecuda
        remotecuda.activate({gw.address!r}, fallback='error')
        x = torch.ones(3, device='cuda')
        assert x.sum().item() == 3
        os.kill({gw.proc.pid}, signal.SIGKILL)
        time.sleep(0.5)
        t = time.monotonic()
        try:
            (x * 2).sum().item()
        except remotecuda.GatewayLostError as e:
            print('LOST', round(time.monotonic() - t))
        t = time.monotonic()
        remotecuda.deactivate()
        print('CLOSED', round(time.monotonic() - t))
    """)
    try:
        r = run_python(code, timeout=120)
    finally:
        gw.stop()
    assert "LOST" in r.stdout and "CLOSED" in r.stdout, r.stdout + r.stderr[-2000:]
    assert int(r.stdout.split("CLOSED")[1].split()[0]) <= 3
