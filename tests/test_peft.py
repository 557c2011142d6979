"""peft on 'cuda' as its docs use it, on causal LMs built from tiny configs (no downloads):
LoRA training then merge_and_unload, save_pretrained / PeftModel.from_pretrained with
modules_to_save, generate() with and without the adapter, two adapters switched with
set_adapter, DoRA and PiSSA (a weight norm, an SVD of the base weight on the device), prompt
tuning, and LoRA on a Conv2d. Each runs on the local CPU and through the gateway and must give
the same values."""
from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from local_parity import assert_matches_local, registry  # noqa: E402
from local_parity import data as D  # noqa: E402
from peft import LoraConfig, PeftModel, PromptTuningConfig, get_peft_model  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("remote")
CASES, case = registry()
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
QV = ["q_proj", "v_proj"]


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        hidden_size=16, intermediate_size=32, vocab_size=64,
                                        max_position_embeddings=32))


def _train(model: nn.Module, dev: str, steps: int = 2) -> torch.Tensor:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=IDS.to(dev), labels=IDS.to(dev)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


@case
def lora_train_merge(dev):
    torch.manual_seed(1)
    m = get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=QV, lora_dropout=0.1,
                                            task_type="CAUSAL_LM")).to(dev)
    torch.manual_seed(2)  # (dropout draws from the device's generator: seeded right before them)
    losses = _train(m, dev)
    merged = m.merge_and_unload()
    with torch.no_grad():
        return losses, merged(IDS.to(dev)).logits


@case
def save_and_load_with_modules_to_save(dev):
    torch.manual_seed(1)
    m = get_peft_model(_llama(), LoraConfig(r=4, target_modules=QV, modules_to_save=["lm_head"])).to(dev)
    _train(m, dev)
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        loaded = PeftModel.from_pretrained(_llama().to(dev), d)
    with torch.no_grad():
        return m(IDS.to(dev)).logits, loaded(IDS.to(dev)).logits


@case
def generate_with_and_without_adapter(dev):
    torch.manual_seed(1)
    m = get_peft_model(_llama(), LoraConfig(r=4, target_modules=QV, init_lora_weights=False)).to(dev).eval()
    prompt = IDS[:1, :4].to(dev)
    out = m.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with m.disable_adapter():
        base = m.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return out, base


@case
def two_adapters_set_adapter(dev):
    torch.manual_seed(1)
    m = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False),
                       adapter_name="one")
    torch.manual_seed(2)
    m.add_adapter("two", LoraConfig(r=2, target_modules=["v_proj"], init_lora_weights=False))
    m.to(dev)
    out = []
    with torch.no_grad():
        for name in ("one", "two"):
            m.set_adapter(name)
            out.append(m(IDS.to(dev)).logits)
    return out


@case
def dora_and_pissa_on_the_device(dev):
    out = []
    for cfg in (LoraConfig(r=4, target_modules=QV, use_dora=True),
                LoraConfig(r=4, target_modules=QV, init_lora_weights="pissa")):
        torch.manual_seed(1)
        m = get_peft_model(_llama().to(dev), cfg)
        out += [_train(m, dev, steps=1), m.merge_and_unload().model.layers[0].self_attn.q_proj.weight]
    return out


@case
def prompt_tuning(dev):
    torch.manual_seed(1)
    m = get_peft_model(_llama(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).to(dev)
    return _train(m, dev)


@case
def lora_on_conv2d(dev):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 4))
    torch.manual_seed(1)
    cfg = LoraConfig(r=2, target_modules=["0"], modules_to_save=["4"], init_lora_weights=False)
    m = get_peft_model(net, cfg).to(dev)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    x, y = D(4, 3, 6, 6).to(dev), torch.tensor([0, 1, 2, 3]).to(dev)
    for _ in range(2):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.detach(), m.merge_and_unload()(x)


@pytest.mark.parametrize("name", sorted(CASES))
def test_program_matches_local(name):
    assert_matches_local(CASES[name])
