"""Decoding at gateway speed: ``generate(max_new_tokens=64)`` tokens/s through the delay proxy at
0 and 25 ms each way, in one run (remotecuda/decode.py).

    python benchmarks/bench_decode.py [--quick] [--json OUT] [--write]

A CPU gateway on 127.0.0.2 is reached only through benchmarks/delay_proxy.py (a separate
process), as in bench_transfer.py. GPT-2 and Llama (random weights, small configs: 4 layers,
width 256) decode a batch of 2 greedy; rounds alternate between the delays so that the
machine's load falls on each alike; figures are medians. For contrast, the plain path (what
``generate`` did before: a few value reads per token) decodes 16 tokens.
"""
from __future__ import annotations

import copy
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results_md  # noqa: E402
from bench_core import start_gateway  # noqa: E402
from bench_transfer import PROXIED_HOST, ProxyProcess  # noqa: E402

SECTION = "# Part 14: decoding at gateway speed (benchmarks/bench_decode.py)"
NEW = 64
DELAYS = (0.0, 25.0)


def _models():
    import torch
    import transformers as T
    torch.manual_seed(0)
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=1000, n_embd=256, n_layer=4, n_head=4, n_positions=256))
    llama = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256))
    return {"GPT-2": gpt2.eval(), "Llama": llama.eval()}


def run(quick: bool) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers as T

    import remotecuda
    models = _models()
    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    proc, address = start_gateway(host=PROXIED_HOST)
    proxy = ProxyProcess(int(address.rsplit(":", 1)[1]), target_host=PROXIED_HOST)
    rounds = 2 if quick else 5
    r: dict = {"tok_s": {}, "trips": {}, "plain_tok_s": {}, "plain_trips": {}}
    try:
        remotecuda.activate(proxy.address, fallback="error")
        remote = {name: copy.deepcopy(m).cuda() for name, m in models.items()}
        x, a = ids.cuda(), mask.cuda()
        samples: dict = {(name, d): [] for name in remote for d in DELAYS}
        for m in remote.values():  # warm up: every shape's metadata cached
            m.generate(x, attention_mask=a, max_new_tokens=NEW, do_sample=False, pad_token_id=0).cpu()
        for _ in range(rounds):
            for d in DELAYS:
                proxy.set_delay(d)
                for name, m in remote.items():
                    before = remotecuda.stats()["blocking_round_trips"]
                    t = time.perf_counter()
                    out = m.generate(x, attention_mask=a, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
                    trips = remotecuda.stats()["blocking_round_trips"] - before
                    out.cpu()  # (the tokens read back, outside the timed call's count)
                    samples[(name, d)].append(ids.shape[0] * NEW / (time.perf_counter() - t))
                    r["trips"][name] = trips
        for (name, d), v in samples.items():
            r["tok_s"].setdefault(name, {})[str(int(d))] = statistics.median(v)
        plain = T.StoppingCriteriaList()  # (a stopping_criteria argument: decode.py leaves the call alone)
        for d in DELAYS:
            proxy.set_delay(d)
            for name, m in remote.items():
                before = remotecuda.stats()["blocking_round_trips"]
                t = time.perf_counter()
                m.generate(x, attention_mask=a, max_new_tokens=16, do_sample=False, pad_token_id=0,
                           stopping_criteria=plain).cpu()
                r["plain_tok_s"].setdefault(name, {})[str(int(d))] = ids.shape[0] * 16 / (time.perf_counter() - t)
                r["plain_trips"][name] = remotecuda.stats()["blocking_round_trips"] - before - 1
        remotecuda.deactivate()
    finally:
        proxy.close()
        proc.terminate()
        proc.wait()
    r["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, " \
                   f"transformers {T.__version__}"
    r["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    r["rounds"] = rounds
    return r


def markdown(r: dict) -> str:
    rows = ""
    for name, by in r["tok_s"].items():
        rows += (f"| {name} | {by['0']:.0f} | {by['25']:.0f} | {by['25'] / by['0']:.2f} | {r['trips'][name]} | "
                 f"{r['plain_tok_s'][name]['0']:.0f} | {r['plain_tok_s'][name]['25']:.1f} | "
                 f"{r['plain_trips'][name]} |\n")
    return (f"{r['date']}, {r['machine']}; a CPU gateway behind the delay proxy (benchmarks/delay_proxy.py); "
            f"batch 2, greedy, `max_new_tokens={NEW}`, medians of {r['rounds']} alternating rounds.\n\n"
            "| model | tok/s at 0 ms | tok/s at 25 ms each way | ratio | blocking round trips per call | "
            "plain path tok/s at 0 ms | at 25 ms | its round trips (16 tokens) |\n"
            f"|---|---|---|---|---|---|---|---|\n{rows}\n"
            "`generate()` reads nothing until its end (remotecuda/decode.py): the client streams the steps "
            "and the gateway runs them as they come, so 50 ms of round trip is paid once per call, not per "
            "token. The plain path (forced here with a `stopping_criteria` argument) reads a few values per "
            "token.\n")


if __name__ == "__main__":
    results_md.main(SECTION, run, markdown, "2 rounds instead of 5")
