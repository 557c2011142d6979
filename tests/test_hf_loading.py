"""Loading Hugging Face models onto 'cuda' as users write it, against the local CPU (tiny configs,
no hub): ``from_pretrained`` with every kind of ``device_map`` (``"auto"``, ``{"": 0}``, ``0``, an
offloading ``max_memory``), dtypes, and accelerate's ``dispatch_model``. These build devices from
bare indices (``torch.device(0)``, which a CPU-only torch's C++ refuses), rebuild parameters by
their class (``type(p)(data, requires_grad=...)``), and, by default, swap in compiled hub kernels
for a model on 'cuda'. Then what generation adds: the offloaded KV cache's ``torch.Stream()``, and a
``torch.compile``d forward handed the cache.
"""
from __future__ import annotations

import copyreg
import io
import os
import pickle

import pytest
import torch

from conftest import interception_removed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
T = transformers
accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.usefixtures("remote")

IDS = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(1))


def test_a_bare_index_is_a_cuda_device():
    """``torch.device(0)`` is 'cuda:0', as on a GPU machine; devices stay torch's own (isinstance,
    pickling, ``torch.save``), and deactivation gives torch its class back."""
    d = torch.device(0)
    assert d == torch.device("cuda", 0) and type(d) is torch._C.device
    assert isinstance(d, torch.device) and issubclass(type(d), torch.device)
    assert torch.device("cpu").type == "cpu" and torch.device("cuda", 1).index == 1
    assert pickle.loads(pickle.dumps([d, torch.device("cpu")])) == [d, torch.device("cpu")]
    buf = io.BytesIO()
    torch.save({"device": torch.device(1)}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == {"device": torch.device("cuda", 1)}
    assert torch.ones(2).to(torch.device(0)).device == d
    assert os.environ["USE_HUB_KERNELS"] == "NO"  # (the test environment sets none)
    with interception_removed():
        assert torch.device is torch._C.device and torch._C.device not in copyreg.dispatch_table
        assert "USE_HUB_KERNELS" not in os.environ
        assert pickle.loads(pickle.dumps(torch.device("cpu"))) == torch.device("cpu")
        with pytest.raises(RuntimeError, match="accelerator"):
            torch.device(0)


def test_parameter_rebuilt_by_its_class():
    """``type(p)(data, requires_grad=...)`` of a 'cuda' parameter is an ``nn.Parameter``, as on a GPU."""
    p = torch.nn.Parameter(torch.arange(3.0).cuda())
    q = type(p)(p.detach() * 2, requires_grad=False)
    assert isinstance(q, torch.nn.Parameter) and not q.requires_grad and q.device.type == "cuda"
    assert q.cpu().tolist() == [0.0, 2.0, 4.0]
    m = type(p)(p.detach().to("meta"))
    assert isinstance(m, torch.nn.Parameter) and m.is_meta and m.requires_grad


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    _llama().save_pretrained(path)
    return path


LOADS = {
    "auto": dict(device_map="auto"),
    "whole_model_on_0": dict(device_map={"": 0}),
    "int": dict(device_map=0),
    "cuda_float16": dict(device_map="cuda", dtype=torch.float16),
    "auto_bfloat16": dict(device_map="auto", dtype=torch.bfloat16),
    "dtype_auto_sequential": dict(device_map="sequential", dtype="auto"),
    "offloaded": dict(device_map="auto", max_memory={0: "60KB", "cpu": "1GiB"}),
}


@pytest.mark.parametrize("name", list(LOADS))
def test_from_pretrained_device_map_matches_local(checkpoint, name):
    kwargs = LOADS[name]
    local = T.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=kwargs.get("dtype"))
    model = T.AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
    devices = {p.device.type for p in model.parameters()}
    assert devices == ({"cuda", "meta"} if name == "offloaded" else {"cuda"}), devices
    assert next(model.parameters()).dtype == next(local.parameters()).dtype
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS.cuda()).logits.cpu(), local(input_ids=IDS).logits)


def test_dispatch_model_offloads_as_planned():
    """accelerate's ``infer_auto_device_map`` over the gateway's memory, then ``dispatch_model``:
    the blocks that do not fit stay on the CPU and are brought to 'cuda' for their forward."""
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=4, n_head=4)).eval()
    with torch.no_grad():
        expected = model(IDS).logits
    plan = accelerate.infer_auto_device_map(model, max_memory={0: "60KB", "cpu": "1GiB"},
                                            no_split_module_classes=["GPT2Block"])
    assert set(plan.values()) == {0, "cpu"}, plan
    model = accelerate.dispatch_model(model, device_map=plan)
    with torch.no_grad():
        got = model(IDS.to(0)).logits
    assert got.device == torch.device(0)
    torch.testing.assert_close(got.cpu(), expected)


def test_device_generic_stream_and_event_are_cuda_ones():
    """``torch.Stream()`` / ``torch.Event()`` with no device are the current accelerator's, as
    on a GPU machine: 'cuda' ones here; torch's own for the CPU."""
    s = torch.Stream()
    assert isinstance(s, torch.Stream) and isinstance(s, torch.cuda.Stream) and s.device == torch.device(0)
    assert s.device_type == 1 and s.device_index == 0  # c10's DeviceType::CUDA
    with s:
        assert torch.cuda.current_stream() == s
        e = torch.Event(enable_timing=True)
        e.record()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    s.wait_stream(torch.cuda.default_stream(0))
    e.synchronize()
    assert isinstance(torch.Stream("cuda:0"), torch.cuda.Stream) and isinstance(e, torch.Event)
    assert torch.Stream("cpu").device.type == torch.Event("cpu").device.type == "cpu"


def test_offloaded_kv_cache_generation_matches_local():
    """``cache_implementation='offloaded'`` keeps the KV cache on the CPU and prefetches each layer's
    on a ``torch.Stream()`` (it raised: a CPU stream cannot wait on a 'cuda' one)."""
    def generate(dev: str, **kwargs: object) -> torch.Tensor:
        model = _llama().to(dev).eval()
        ids = torch.tensor([[1, 5, 9, 14, 7], [0, 0, 8, 3, 11]], device=dev)
        return model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=5, do_sample=False,
                              pad_token_id=0, **kwargs).cpu()
    torch.testing.assert_close(generate("cuda", cache_implementation="offloaded"), generate("cpu"))


def test_compiled_forward_generates_as_local():
    """``model.forward = torch.compile(model.forward)`` then ``generate()``: the KV cache handed to
    the forward is an object the trace would fill with its stand-ins, so those calls run eagerly
    (the cache kept CPU stand-ins and the next step raised a device mismatch)."""
    def generate(dev: str) -> torch.Tensor:
        model = _llama().to(dev).eval()
        if dev == "cuda":
            model.forward = torch.compile(model.forward)
        ids = torch.tensor([[1, 5, 9, 14, 7]], device=dev)
        return model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0).cpu()
    with pytest.warns(UserWarning, match="remotecuda: torch.compile runs"):
        got = generate("cuda")
    torch.testing.assert_close(got, generate("cpu"))
