"""A long fuzzing campaign against a gateway with a token: issue 15's ≥ 100,000 hostile frames (120,000).

    python benchmarks/bench_fuzz.py [--quick] [--json OUT] [--write]

The fuzzer of tests/test_hostile_load.py (tests/fuzzing.py): mutated, truncated, replayed and
oversized messages, made from valid ones and sealed with the session's key where the connection
authenticated, 20,000 on each connection kind (the front port in a session, the session's data
port and its bulk connection, a stranger on that data port, the front port authenticated without a
session, a stranger on the front port), while
a well-behaved client on a session of its own checks every result against local PyTorch. Reports
frames per second, what the gateway answered (by reason), the refusals the gateway counted
(STATUS), the supervisor's memory before and after, and every crash: the gateway's exit, a
traceback in its log, a session lost, a fuzzed connection that stopped answering, a wrong result.
``--write`` puts its section into benchmarks/RESULTS.md.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import results_md  # noqa: E402

SECTION = "# Part 12: hostile peers, a fuzzing campaign (benchmarks/bench_fuzz.py)"
TOKEN = "benchmark-fuzz-token-" + "0123456789abcdef" * 2


def _gateway(token_file: str, log) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMOTECUDA_TOKEN")}
    cmd = [sys.executable, "-m", "remotecuda", "start", "--device", "cpu", "--port", "0", "--no-discovery",
           "--quiet", "--spare", "2", "--token-file", token_file]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                            cwd=ROOT, env=env)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"gateway did not start: {line!r}")
    return proc, line.split()[1]


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run(quick: bool) -> dict:
    import psutil
    import zmq

    from remotecuda.session import gateway_status
    from remotecuda_wire import auth

    from fuzzing import Campaign, GoodClient
    per_kind = 2_000 if quick else 20_000
    os.environ[auth.TOKEN_ENV] = TOKEN
    os.environ.pop(auth.TOKEN_FILE_ENV, None)
    crashes: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        token_file = os.path.join(d, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN)
        log_path = os.path.join(d, "gateway.log")
        with open(log_path, "w") as log:
            proc, endpoint = _gateway(token_file, log)
        supervisor = psutil.Process(proc.pid)
        good = GoodClient(endpoint)
        good.start()
        ctx = zmq.Context()
        kinds: dict[str, dict] = {}
        try:
            campaign = Campaign(endpoint, ctx, seed=100)
            good.progresses()
            rss_before = supervisor.memory_info().rss
            rss_peak = rss_before
            started = time.perf_counter()
            mark = [started]

            def after(kind: str) -> None:
                nonlocal rss_peak
                now = time.perf_counter()
                rss_peak = max(rss_peak, supervisor.memory_info().rss)
                kinds[kind] = {"frames": campaign.kinds[kind].frames, "s": now - mark[0]}
                mark[0] = now
                if proc.poll() is not None:
                    crashes.append(f"the gateway exited ({proc.returncode}) after {kind}")
                try:
                    good.progresses()
                except AssertionError as e:
                    crashes.append(f"the well-behaved client, after {kind}: {e}")
            try:
                campaign.run(per_kind, after)
                campaign.check_session()
            except AssertionError as e:
                crashes.append(f"a fuzzed connection: {e}")
            elapsed = time.perf_counter() - started
            rss_after = supervisor.memory_info().rss
            workers = len(supervisor.children())
            status = gateway_status(ctx, endpoint, 30)
            answers = campaign.answers()
            campaign.close()
        finally:
            good.stop.set()
            good.join(60)
            ctx.destroy(linger=0)  # (sockets a failure left open too)
            alive = proc.poll() is None
            proc.terminate()
            proc.wait(20)
        with open(log_path) as f:
            tracebacks = f.read().count("Traceback")
    if not alive:
        crashes.append("the gateway was not running at the end")
    if good.failure is not None:
        crashes.append(f"the well-behaved client: {good.failure!r}")
    if tracebacks:
        crashes.append(f"{tracebacks} tracebacks in the gateway's log")
    lost = sum(n for why, n in answers.items() if "session_lost" in why)
    if lost:
        crashes.append(f"{lost} sessions lost")
    frames = sum(k["frames"] for k in kinds.values())
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": _cpu(), "cores": os.cpu_count(),
            "load": os.getloadavg()[0], "per_kind": per_kind, "frames": frames, "seconds": elapsed,
            "kinds": kinds, "answers": dict(answers.most_common()),
            "refused": status.get("totals", {}).get("refused", {}), "rss_before": rss_before,
            "rss_after": rss_after, "rss_peak": rss_peak, "workers": workers, "good_round_trips": good.done,
            "crashes": crashes}


def markdown(r: dict) -> str:
    mib = 1 << 20
    rows = "\n".join(f"| {name} | {k['frames']:,} | {k['s']:.1f} | {k['frames'] / k['s']:,.0f} |"
                     for name, k in r["kinds"].items())
    answers = sorted(r["answers"].items(), key=lambda kv: -kv[1])
    shown = "\n".join(f"| {why} | {n:,} |" for why, n in answers[:25])
    rest = sum(n for _, n in answers[25:])
    refused = ", ".join(f"{k} {v:,}" for k, v in sorted(r["refused"].items())) or "none"
    crashes = "none" if not r["crashes"] else "; ".join(r["crashes"])
    return f"""{r['date']}, {r['cpu']} ({r['cores']} cores, shared; load average {r['load']:.2f} at the end).
One `--device cpu` gateway with a token on 127.0.0.1; tests/fuzzing.py sends {r['per_kind']:,} hostile
messages on each connection kind (mutated, truncated, replayed, oversized; sealed with the session's key
where the connection authenticated, so most reach the parsers and the executor), reading the answers as
it goes, while a well-behaved client on its own session checks every result against local PyTorch
({r['good_round_trips']:,} round trips, all correct). After each kind a PING on the fuzzed connection
(a stranger's PULL on the data port) must be answered; at the end the fuzzed session must still compute right.

| connection kind | messages | s | messages/s |
| --- | --- | --- | --- |
{rows}
| all | {r['frames']:,} | {r['seconds']:.1f} | {r['frames'] / r['seconds']:,.0f} |

Crashes: **{crashes}** (the gateway's exit, a traceback in its log, a session lost, a fuzzed connection
that stopped answering, a wrong result of the second client). Supervisor RSS {r['rss_before'] / mib:.0f} MiB
before, {r['rss_peak'] / mib:.0f} MiB at most, {r['rss_after'] / mib:.0f} MiB after; {r['workers']} worker
processes at the end (the sessions and the 2 spares). Refusals the gateway counted (STATUS `refused`): {refused}.

What the gateway answered the fuzzed connections, by reason (numbers in messages elided): the 25
most frequent of {sum(r['answers'].values()):,} answers; the other reasons account for {rest:,}.

| answer | count |
| --- | --- |
{shown}
"""


if __name__ == "__main__":
    results_md.main(SECTION, run, markdown, "2,000 messages per connection kind, not 20,000")
