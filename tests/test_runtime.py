"""The runtime object (remotecuda/runtime.py): activate() makes it, deactivate() drops it, and
nothing of an old runtime survives into the next one. Each test runs in a fresh interpreter, as
it activates and deactivates."""
from __future__ import annotations

import textwrap

from conftest import run_python


def _run(gateway, code: str) -> str:
    r = run_python(textwrap.dedent(code), env={"REMOTECUDA_SERVERS": gateway.address, "REMOTECUDA_FALLBACK": "error"})
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-3000:]
    return r.stdout


def test_reactivation_starts_from_fresh_state(gateway):
    _run(gateway, """
        import os, torch, torch.nn.functional as F, remotecuda
        from remotecuda import runtime
        assert runtime.active() is None and not remotecuda.is_active()
        try:
            runtime.current()
        except runtime.NotActiveError:
            pass
        else:
            raise SystemExit('current() without a runtime')

        old = remotecuda.activate()
        assert runtime.current() is old and remotecuda.activate() is old
        x = torch.randn(2, 3, 4, 8, device='cuda')
        torch.cuda.set_stream(torch.cuda.Stream())
        F.scaled_dot_product_attention(x, x, x)
        torch.backends.cudnn.benchmark = True
        torch.cuda.manual_seed_all(5)
        (x + 1).sum().item()
        assert old.current_streams and old.sdpa_choices and old.flags == {'cudnn.benchmark': True}
        assert old.seed == 5 and len(old.dispatcher.cache) > 0 and old.pool.sessions
        assert remotecuda.stats()['ops'] > 0

        remotecuda.deactivate()
        assert runtime.active() is None and old.pool.sessions == {}
        assert remotecuda.stats()['ops'] == remotecuda.stats()['metadata_cache_hits'] == 0
        torch.backends.cudnn.benchmark = False  # (the local flag: set back while inactive)
        os.environ['REMOTECUDA_CODECS'] = 'zstd'  # read at activation, not at import

        new = remotecuda.activate()
        assert new is not old and runtime.current() is new
        assert new.dispatcher is not old.dispatcher and new.pool is not old.pool
        assert new.current_streams == {} and new.default_streams == {} and new.sdpa_choices == {}
        assert new.flags == {} and new.seed is None and new.current_device == 0
        assert len(new.dispatcher.cache) == 0 and new.dispatcher.ops == {}
        assert remotecuda.stats()['ops'] == 0 and remotecuda.stats()['metadata_cache_misses'] == 0
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        y = torch.randn(2, 3, 4, 8, device='cuda')
        F.scaled_dot_product_attention(y, y, y)  # asks the new gateway session again
        assert len(new.sdpa_choices) == 1
        assert new.codecs == new.session(0).offered == ('zstd',) and new.session(0).codecs == ('zstd',)
        remotecuda.deactivate()
        print('OK')
    """)


def test_nothing_keeps_an_old_runtime_alive(gateway):
    _run(gateway, """
        import gc, weakref, torch, remotecuda
        rt = remotecuda.activate()
        x = torch.ones(3, device='cuda')
        g = torch.Generator('cuda')
        assert (x * 2).sum().item() == 6
        refs = [weakref.ref(o) for o in (rt, rt.pool, rt.dispatcher, rt.interception)]
        session = weakref.ref(rt.session(0))
        del rt
        remotecuda.deactivate()

        try:
            x + 1  # a tensor of the old runtime: its session is closed
        except remotecuda.GatewayLostError as e:
            assert 'not active' in str(e), e
        else:
            raise SystemExit('an op on a tensor of a deactivated runtime did not raise')

        remotecuda.activate()
        for use in (lambda: x.cpu(), lambda: x + torch.ones(3, device='cuda')):  # (not a device mismatch)
            try:
                use()
            except remotecuda.GatewayLostError as e:
                assert 'session is closed (remotecuda was deactivated' in str(e), e
            else:
                raise SystemExit('a tensor of the old runtime was used')
        try:
            torch.rand(2, device='cuda', generator=g)
        except RuntimeError as e:
            assert 'session is closed' in str(e), e
        else:
            raise SystemExit("a generator of the old runtime was accepted")
        del x, g
        remotecuda.deactivate()
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        assert not alive, [type(o).__name__ for o in alive] + [gc.get_referrers(o) for o in alive]
        assert session() is None
        print('OK')
    """)


def test_a_forked_child_gets_plain_torch_and_not_the_runtime(gateway):
    """The child drops the parent's runtime; CUDA-wise it is a GPU's bad fork (forked_child.py):
    the parent's answers to is_available/device_count, and its tensors refused as CUDA refuses."""
    _run(gateway, """
        import os, torch, remotecuda
        from remotecuda import runtime
        rt = remotecuda.activate()
        x = torch.ones(2, device='cuda')
        pid = os.fork()
        if pid == 0:
            ok = runtime.active() is None and torch.cuda.is_available() and torch.cuda.device_count() == 1
            try:
                x + 1
                ok = False
            except RuntimeError as e:
                ok = ok and str(e).startswith("Cannot re-initialize CUDA in forked subprocess")
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        assert runtime.current() is rt and (x + 1).sum().item() == 4
        remotecuda.deactivate()
        print('OK')
    """)


def test_an_op_that_cannot_be_encoded_leaves_the_flush_thread_running(gateway):
    """A queued op whose arguments the wire cannot carry (here an object() put straight into the
    queue, as a missed conversion would): the background flush goes on (it died, and nothing
    flushed or kept the session alive after), the op fails alone with the encoding error at the
    next sync (it is sent as ``rc::refused``), and no sequence number is skipped (the gateway
    would refuse the next message)."""
    _run(gateway, """
        import time, torch, remotecuda
        from remotecuda import runtime
        remotecuda.activate()
        x = torch.ones(3, device="cuda")
        assert x.sum().item() == 3
        pool = runtime.current().pool
        s = x._s
        s.enqueue("aten::add.Tensor", [object()], None, None)
        time.sleep(1.0)  # a few batch windows: the flush thread tried it
        assert pool._flusher.is_alive()
        try:
            torch.cuda.synchronize()
        except TypeError as e:
            assert "aten::add.Tensor" in str(e), e
        else:
            raise SystemExit("the op's error was lost")
        assert (x * 2).sum().item() == 6
        print("OK")
    """)


def test_transformers_asked_before_activation_sees_the_devices_after(gateway):
    """transformers caches is_torch_cuda_available(): asked before activate() (or %load_ext
    remotecuda), it said False for good, and pipeline(device=0) ran on the CPU silently."""
    _run(gateway, """
        import remotecuda
        from transformers.utils import is_torch_cuda_available, is_torch_tf32_available
        assert not is_torch_cuda_available() and not is_torch_tf32_available()
        remotecuda.activate()
        assert is_torch_cuda_available()
        remotecuda.deactivate()
        assert not is_torch_cuda_available()
        print("OK")
    """)
