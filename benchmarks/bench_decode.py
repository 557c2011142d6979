"""Decoding at gateway speed: ``generate(max_new_tokens=64)`` tokens/s through the delay proxy at
0 and 25 ms each way, in one run (remotecuda/decode.py).

    python benchmarks/bench_decode.py [--quick] [--json OUT] [--write]

A CPU gateway on 127.0.0.2 is reached only through benchmarks/delay_proxy.py (a separate
process), as in bench_transfer.py. GPT-2 and Llama (random weights, small configs: 6 layers,
width 512) decode a batch of 2 greedy; each round makes a pair of calls per model, one at
each delay (in turn first), so that the machine's load falls on both alike; the ratio is the
median of the pairs' ratios, tok/s the medians of the calls. For contrast, the plain path (what
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

SECTION = "# Part 15: decoding at gateway speed (benchmarks/bench_decode.py)"
NEW = 64
DELAYS = (0.0, 25.0)


def _models():
    import torch
    import transformers as T
    torch.manual_seed(0)
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=1000, n_embd=512, n_layer=6, n_head=8, n_positions=256))
    llama = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                                             num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
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
    rounds = 2 if quick else 9
    r: dict = {"tok_s": {}, "ratio": {}, "ratio_read": {}, "trips": {}, "plain_tok_s": {}, "plain_trips": {},
               "load": os.getloadavg()[0]}
    try:
        remotecuda.activate(proxy.address, fallback="error")
        remote = {name: copy.deepcopy(m).cuda() for name, m in models.items()}
        x, a = ids.cuda(), mask.cuda()

        def call(m) -> tuple[float, float, float]:
            """(tok/s of generate(), tok/s with the tokens read back, its blocking round trips)"""
            before = remotecuda.stats()["blocking_round_trips"]
            t = time.perf_counter()
            out = m.generate(x, attention_mask=a, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            t_call = time.perf_counter() - t
            trips = remotecuda.stats()["blocking_round_trips"] - before
            out.cpu()
            t_read = time.perf_counter() - t
            return ids.shape[0] * NEW / t_call, ids.shape[0] * NEW / t_read, trips

        for m in remote.values():  # warm up: every shape's metadata cached
            call(m)
        samples: dict = {(name, d): [] for name in remote for d in DELAYS}
        ratios: dict = {name: [] for name in remote}
        ratios_read: dict = {name: [] for name in remote}
        for i in range(rounds):
            for name, m in remote.items():  # a pair of calls, one at each delay, in turn first
                pair = {}
                for d in (DELAYS if i % 2 == 0 else DELAYS[::-1]):
                    proxy.set_delay(d)
                    pair[d] = call(m)
                    samples[(name, d)].append(pair[d][0])
                    r["trips"][name] = pair[d][2]
                ratios[name].append(pair[DELAYS[1]][0] / pair[DELAYS[0]][0])
                ratios_read[name].append(pair[DELAYS[1]][1] / pair[DELAYS[0]][1])
        for (name, d), v in samples.items():
            r["tok_s"].setdefault(name, {})[str(int(d))] = statistics.median(v)
        for name in remote:
            r["ratio"][name] = statistics.median(ratios[name])
            r["ratio_read"][name] = statistics.median(ratios_read[name])
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
        rows += (f"| {name} | {by['0']:.0f} | {by['25']:.0f} | {r['ratio'][name]:.2f} | "
                 f"{r['ratio_read'][name]:.2f} | {r['trips'][name]} | "
                 f"{r['plain_tok_s'][name]['0']:.0f} | {r['plain_tok_s'][name]['25']:.1f} | "
                 f"{r['plain_trips'][name]} |\n")
    return (f"{r['date']}, {r['machine']}; a CPU gateway behind the delay proxy (benchmarks/delay_proxy.py); "
            f"batch 2, greedy, `max_new_tokens={NEW}`; {r['rounds']} rounds of a pair of calls per model, one at "
            f"each delay, in turn first (load average {r['load']:.1f} at the start: a shared machine, so the ratio "
            "is the median of the pairs' ratios).\n\n| model | tok/s at 0 ms | tok/s at 25 ms each way | "
            "ratio 25/0 ms | ratio with the tokens read back (`.cpu()`, one more round trip) | "
            "blocking round trips per call | plain path tok/s at 0 ms | at 25 ms | its round trips (16 tokens) |\n"
            f"|---|---|---|---|---|---|---|---|---|\n{rows}\n"
            "`generate()` reads nothing until its end (remotecuda/decode.py): the client streams the steps "
            "and the gateway runs them as they come, so the delay is paid once per call, not per token: the "
            "gateway gets the last step 25 ms late and its answer takes 25 ms more (on this 2-core machine, "
            "where client, proxy and gateway share the cores, a call at 25 ms takes about 0.1 s longer). The "
            "ratio therefore depends on how long a call is: with these models a call takes about 1 s; with "
            "4 layers of width 256 (0.6 s calls) it was 0.80-0.82. The plain path (forced here with a "
            "`stopping_criteria` argument) reads a few values per token.\n")


if __name__ == "__main__":
    results_md.main(SECTION, run, markdown, "2 rounds instead of 9")
