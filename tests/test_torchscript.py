"""TorchScript on 'cuda' against the local CPU: traced and scripted modules (whose graphs hold
scalar constants, which reach the dispatch mode as plain numbers), their archives loaded onto
'cuda' (by ``map_location``, or because a GPU machine saved them), and a save that is refused."""
from __future__ import annotations

import io
import math
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.usefixtures("remote"),
    pytest.mark.filterwarnings("ignore:`torch.jit.(script|trace|trace_method|freeze|save|load)` is deprecated"),
]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 3), nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)) * 0.5 + 1) / math.sqrt(3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Block().eval()


def _x() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def test_traced_and_scripted_modules_and_functions_match_the_cpu():
    """A traced graph holds ``0.5`` and ``1`` as constants; running it, checking the trace
    (``equal`` of constants) and printing its graph pass them to ops as numbers."""
    def run(dev: str) -> list[torch.Tensor]:
        m, x = _model().to(dev), _x().to(dev)
        traced = torch.jit.trace(m, x)  # (check_trace: runs the graph again and compares)
        scripted = torch.jit.script(m)
        fn = torch.jit.trace(lambda a: a * 2 + 1, x)
        assert "prim::Constant" in str(fn.graph)
        return [traced(x), scripted(x), fn(x), torch.jit.freeze(torch.jit.script(m))(x)]
    cuda, cpu = run("cuda"), run("cpu")
    assert all(t.device.type == "cuda" for t in cuda)
    torch.testing.assert_close([t.cpu() for t in cuda], cpu)


def test_traced_convolutions_are_in_the_graph():
    """The tracer leaves a convolution to ``aten::_convolution`` below it, which never runs under
    an active dispatch mode: without remotecuda recording it, every conv net's trace failed (a
    parameter "inserted as a constant", an output with no "data dependence" on the inputs), on
    'cuda' and on the CPU alike. Shapes no other test uses: the first trace computes their
    metadata (recorded ``size()`` calls, dropped), and its check must still see the same graph."""
    def run(dev: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 5, 3, stride=2, dilation=2, padding=1), nn.ReLU(), nn.Conv2d(5, 5, 1),
                          nn.ConvTranspose2d(5, 2, 3, stride=2, output_padding=1)).to(dev)
        conv1d = nn.Conv1d(3, 2, 3, padding=1, bias=False).to(dev)
        x, s = _x().reshape(1, 4, 5)[:, :3].reshape(1, 3, 5, 1).repeat(1, 1, 1, 7).to(dev), _x()[:3].to(dev)
        traced, traced1d = torch.jit.trace(m, x), torch.jit.trace(conv1d, s.unsqueeze(0))
        assert "aten::convolution" in str(traced1d.graph)
        return [traced(x), traced(x + 1), traced1d(s.unsqueeze(0) * 2)]
    cuda, cpu = run("cuda"), run("cpu")
    torch.testing.assert_close([t.cpu() for t in cuda], cpu)


def test_a_script_module_moved_to_cuda_keeps_its_gradients():
    """A TorchScript module's tensors are its C++ module's attributes, which no swap can make
    remote: ``.cuda()`` replaces each, and parameters still train."""
    m = torch.jit.script(_model().train())
    m.cuda()
    p = next(m.parameters())
    assert p.device.type == "cuda" and p.requires_grad
    m(_x().cuda()).sum().backward()
    assert p.grad is not None and p.grad.device.type == "cuda"


@pytest.mark.parametrize("map_location", ["cuda", "cuda:0", torch.device("cuda"), None, "cpu"])
def test_jit_load_with_map_location(tmp_path: Path, map_location):
    m = _model()
    torch.jit.save(torch.jit.script(m), tmp_path / "m.pt")
    loaded = torch.jit.load(tmp_path / "m.pt", map_location=map_location)
    device = next(loaded.parameters()).device
    assert device.type == ("cuda" if map_location not in (None, "cpu") else "cpu")
    torch.testing.assert_close(loaded(_x().to(device)).cpu(), m(_x()))


def test_an_archive_saved_on_a_gpu_machine_loads_onto_cuda(tmp_path: Path):
    """Its storages are located on 'cuda:0', which a CPU-only torch's loader would make as
    empty tensors: it loads onto the CPU and moves, as a GPU's torch restores it."""
    m = _model()
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(m), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(tmp_path / "gpu.pt", "w") as dst:
        for name in src.namelist():
            data = src.read(name)
            if name.endswith("data.pkl"):
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            dst.writestr(name, data)
    with open(tmp_path / "gpu.pt", "rb") as f:
        loaded = torch.jit.load(f)
    assert next(loaded.parameters()).device == torch.device("cuda", 0)
    torch.testing.assert_close(loaded(_x().cuda()).cpu(), m(_x()))
    assert next(torch.jit.load(tmp_path / "gpu.pt", map_location="cpu").parameters()).device.type == "cpu"


def test_saving_a_script_module_on_cuda_is_refused_with_the_remedy(tmp_path: Path):
    m = _model().cuda()
    for module in (torch.jit.script(m), torch.jit.trace(m, _x().cuda())):
        with pytest.raises(NotImplementedError, match=r"module.cpu\(\)"):
            torch.jit.save(module, tmp_path / "m.pt")
        with pytest.raises(NotImplementedError, match="map_location='cuda'"):
            torch.jit.save(module, io.BytesIO())


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_traced_recurrent_layers_hold_the_aten_op_and_match_the_cpu(cls):
    """``torch.jit.trace`` of an ``nn.LSTM``/``GRU``/``RNN`` on 'cuda' raised "remotecuda cannot send a
    Tensor to the gateway" (its sizes are tensors while tracing, and the one gateway op that runs
    the layer put them in its arguments), and left that message queued: every later op of the
    session failed the same way. The graph holds the one ``aten::lstm`` a GPU's trace holds."""
    def run(dev: str) -> tuple[list[torch.Tensor], list[str]]:
        torch.manual_seed(0)
        m, x = cls(4, 3, num_layers=2, batch_first=True).to(dev), torch.randn(2, 5, 4).to(dev)
        traced = torch.jit.trace(m, x)
        out, h = traced(x * 2)
        kinds = [n.kind() for n in traced.graph.nodes() if n.kind().startswith("aten::")]
        return [out, *(h if isinstance(h, tuple) else (h,)), m(x)[0]], kinds
    (cuda, cuda_graph), (cpu, cpu_graph) = run("cuda"), run("cpu")
    assert cuda_graph == cpu_graph and cuda_graph[-1] in ("aten::lstm", "aten::gru", "aten::rnn_tanh")
    torch.testing.assert_close([t.cpu() for t in cuda], cpu)


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_a_cuda_storage_reads_and_writes_its_tensors_bytes():
    """A 'cuda' tensor's ``storage()`` said its device, but every read of its bytes (``cpu()``,
    ``tolist()``, ``s[i]``, ``float()``, ``clone()``, ``copy.deepcopy``) and ``Tensor.set_(storage)``
    raised "cannot send an argument of type RemoteStorage": torch reaches a storage's bytes by
    ``set_`` of a tensor onto it, which now goes to the storage's gateway tensor."""
    import copy

    def run(dev: str) -> list:
        x = torch.arange(6.0).to(dev)
        s = x[1:].storage()
        s[1] = 7.0
        view = torch.empty(0, device=dev).set_(s, 2, (2,), (2,))
        view.add_(1)  # (writes x: one storage)
        u = torch.UntypedStorage(24)
        u.copy_(x.untyped_storage())
        clone = s.clone()
        s[0] = -1.0  # (not in the copies)
        return [s.cpu().tolist(), s.tolist(), s[3], s.double().tolist(), clone.tolist(), copy.deepcopy(s).tolist(),
                x.tolist(), list(u), s.cpu().device.type, s.is_pinned(), view.tolist(),
                s.cuda().device.type if dev == "cuda" else "cuda", clone.device.type == dev]
    cuda = run("cuda")
    assert cuda == run("cpu")
    x = torch.ones(3, device="cuda")
    assert x.storage().cuda()._untyped_storage is x.untyped_storage()
    with pytest.raises(RuntimeError, match='tensor on device "cuda:0" to a storage on different device "cpu"'):
        torch.empty(0, device="cuda").set_(torch.ones(2).untyped_storage())


class _MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.randn(1, 1, 6, 6))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_traced_attention_holds_the_composite_op_as_on_a_gpu():
    """A traced ``F.scaled_dot_product_attention`` on 'cuda' recorded the op of the backend the
    gateway picked (``_scaled_dot_product_flash_attention_for_cpu``; on a GPU gateway an
    ``_efficient_attention``: a graph that runs on that device only), where a GPU's trace holds
    ``aten::scaled_dot_product_attention``; and as the pick depends on whether the mask needs a
    gradient, a T5's trace (a learned position bias) failed "Graphs differed across invocations"."""
    from transformers import T5Config, T5ForConditionalGeneration

    def run(dev: str) -> tuple[list[torch.Tensor], list[str]]:
        torch.manual_seed(0)
        m, (q, k, v) = _MaskedAttention().to(dev), (torch.randn(1, 2, 6, 8).to(dev) for _ in range(3))
        traced = torch.jit.trace(m, (q, k, v))
        t5 = T5ForConditionalGeneration(T5Config(vocab_size=30, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                 num_heads=2, use_cache=False, decoder_start_token_id=0,
                                                 attn_implementation="sdpa")).eval().to(dev)
        ids = torch.tensor([[1, 5, 7, 9, 2, 0]]).to(dev)
        logits = torch.jit.trace(t5, (ids, torch.ones_like(ids), ids), strict=False)(ids, torch.ones_like(ids), ids)
        kinds = [n.kind() for n in traced.graph.nodes() if "attention" in n.kind()]
        return [traced(q, k * 2, v), logits["logits"]], kinds
    (cuda, cuda_graph), (cpu, cpu_graph) = run("cuda"), run("cpu")
    assert cuda_graph == cpu_graph == ["aten::scaled_dot_product_attention"]
    torch.testing.assert_close([t.cpu() for t in cuda], cpu)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.gru = nn.LSTM(4, 3, batch_first=True), nn.GRU(3, 2)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(self.drop(self.lstm(x)[0]))[0]


def test_scripted_modules_calling_routed_torch_functions_match_the_cpu():
    """While active, ``torch.jit.script`` of an ``nn.LSTM``/``GRU`` or an ``nn.Dropout`` (their
    ``torch._VF`` functions are routed, and ``_VF``'s names come from its ``__getattr__``, so the
    route was not known to TorchScript as ``aten::lstm``) failed "module, class, method, function...
    was expected, got builtin_function_or_method", CPU modules too; an ``nn.TransformerEncoder``
    (its routed ``forward`` compiled with remotecuda's globals) failed "undefined value F"."""
    def run(dev: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        rec = _Recurrent().eval()
        enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                    enable_nested_tensor=False).eval()
        x, y = torch.randn(2, 5, 4), torch.randn(2, 5, 8)
        cpu_scripted = torch.jit.script(rec)(x)
        return [torch.jit.script(rec.to(dev))(x.to(dev)), torch.jit.script(enc.to(dev))(y.to(dev)), cpu_scripted]
    cuda, cpu = run("cuda"), run("cpu")
    assert [t.device.type for t in cuda] == ["cuda", "cuda", "cpu"]
    torch.testing.assert_close([t.cpu() for t in cuda], cpu)
