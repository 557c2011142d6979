/**
 * The panel's HTML, from the pool and the kernel's view. Every value from the network is
 * escaped. Elements the end-to-end test and the widget find carry `data-rc` attributes.
 */
import {
  addressKey, CellRecord, compressionSavings, escapeHtml as e, fmtBytes, fmtPercent, KernelView,
  Failover, KernelStatus, memoryFraction, PoolGateway, PoolGpu, PoolSnapshot, sparklinePoints, STRATEGIES, usedGpus
} from './model';

const SPARK_W = 180;
const SPARK_H = 22;

export function renderPanel(pool: PoolSnapshot | null, poolError: string | null, kernel: KernelView): string {
  return `<div class="rc-panel">
  <h2 class="rc-title">GPU pool</h2>
  ${renderPool(pool, poolError, kernel)}
  ${renderKernel(kernel)}
</div>`;
}

export function renderPool(pool: PoolSnapshot | null, poolError: string | null, kernel: KernelView): string {
  if (poolError) {
    return `<div class="rc-error" data-rc="pool-error">Pool unavailable: ${e(poolError)}</div>`;
  }
  if (!pool) {
    return '<div class="rc-muted">Listening for gateways…</div>';
  }
  const used = usedGpus(kernel.state === 'remotecuda' ? kernel.status : null);
  const head = `<div class="rc-muted" data-rc="source">${pool.gateways.length} gateway${pool.gateways.length === 1 ? '' : 's'}`
    + `${pool.source ? ' via ' + e(pool.source) : ''}</div>`;
  if (pool.error) {
    return head + `<div class="rc-error">${e(pool.error)}</div>`;
  }
  if (pool.gateways.length === 0) {
    return head + '<div class="rc-muted" data-rc="no-gateways">No gateway is announcing itself.</div>';
  }
  return head + `<div class="rc-gateways">${pool.gateways.map(g => renderGateway(g, pool.history_seconds, used)).join('')}</div>`;
}

function renderGateway(g: PoolGateway, span: number, used: Map<string, string[]>): string {
  const addr = addressKey(g.address);
  return `<div class="rc-gateway" data-rc="gateway" data-address="${e(addr)}">
  <div class="rc-gateway-head"><b>${e(addr)}</b> <span class="rc-muted">${e(g.host ?? '')} · RemoteCUDA ${e(g.gateway ?? '?')}`
    + ` · ${e(g.sessions ?? 0)} session${g.sessions === 1 ? '' : 's'}</span></div>
  ${g.gpus.map(gpu => renderGpu(addr, gpu, span, used.get(`${addr}/${gpu.index}`))).join('')}
</div>`;
}

function renderGpu(addr: string, gpu: PoolGpu, span: number, mine: string[] | undefined): string {
  const mem = memoryFraction(gpu);
  const used = mem === null || !gpu.total_memory ? null : gpu.total_memory * mem;
  const memText = gpu.total_memory ? `${used === null ? '-' : fmtBytes(used)} / ${fmtBytes(gpu.total_memory)}` : '-';
  const points = sparklinePoints(gpu.history, span, SPARK_W, SPARK_H);
  return `<div class="rc-gpu${mine ? ' rc-mine' : ''}" data-rc="gpu" data-key="${e(addr)}/${e(gpu.index)}">
  <div class="rc-gpu-head">GPU ${e(gpu.index)}: <span data-rc="gpu-name">${e(gpu.name ?? '?')}</span>`
    + ` <span class="rc-tag">${gpu.simulated ? 'simulated' : 'real'}</span>`
    + (mine ? ` <span class="rc-tag rc-tag-mine" data-rc="mine">this notebook: ${e(mine.join(', '))}</span>` : '') + `</div>
  <div class="rc-bar" title="memory used"><div class="rc-bar-fill" style="width:${((mem ?? 0) * 100).toFixed(1)}%"></div></div>
  <div class="rc-gpu-figures rc-muted">memory ${memText} · util <span data-rc="util">${fmtPercent(gpu.utilization)}</span>`
    + ` · queued ${e(gpu.queued ?? '-')} · sessions ${e(gpu.sessions ?? '-')}</div>
  <div class="rc-spark-row"><span class="rc-muted">load, ${Math.round(span / 60)} min</span>
  <svg class="rc-spark" width="${SPARK_W}" height="${SPARK_H}" viewBox="0 0 ${SPARK_W} ${SPARK_H}" data-rc="spark">
    <title>utilization over the last ${Math.round(span / 60)} minutes</title>
    <rect x="0" y="0" width="${SPARK_W}" height="${SPARK_H}" class="rc-spark-bg"></rect>
    ${points ? `<polyline points="${points}" class="rc-spark-line"></polyline>` : ''}
  </svg></div>
</div>`;
}

export function renderKernel(k: KernelView): string {
  if (k.state === 'none') {
    return '<div class="rc-section rc-muted" data-rc="kernel-none">Open a notebook to see its RemoteCUDA session.</div>';
  }
  if (k.state === 'connecting') {
    return `<div class="rc-section rc-muted" data-rc="kernel-connecting">Asking kernel ${e(k.kernelName)}…</div>`;
  }
  if (k.state === 'not-remotecuda') {
    return `<div class="rc-section" data-rc="not-remotecuda">This notebook's kernel (${e(k.kernelName)}) is not a RemoteCUDA one:
  its <code>cuda</code> is local. Choose the “Python (RemoteCUDA)” kernel, or
  <button class="jp-mod-styled jp-mod-accept" data-rc="load-ext">run %load_ext remotecuda</button></div>`;
  }
  const st = k.status;
  if (!st) {
    return '<div class="rc-section rc-muted" data-rc="kernel-connecting">Waiting for the kernel…</div>';
  }
  const options = STRATEGIES.map(s => `<option value="${s}"${s === st.strategy ? ' selected' : ''}>${s}</option>`).join('');
  const devices = st.devices.map(d => `<li>${e(d.device)} → ${d.placed
    ? `${e(d.name)} @ ${e(addressKey(d.gateway))} GPU ${e(d.gpu)}${d.simulated ? ' (simulated)' : ''}`
    : 'not placed yet'}</li>`).join('');
  const s = st.session ?? {};
  const running = k.live?.running;
  return `<div class="rc-section" data-rc="kernel" data-strategy="${e(st.strategy)}">
  <h3>This notebook</h3>
  ${st.active ? '' : `<div class="rc-error">Not active${st.error ? ': ' + e(st.error) : ''}</div>`}
  ${st.fallback_gateway ? '<div class="rc-error">Running on the local CPU fallback</div>' : ''}
  ${k.error ? `<div class="rc-error" data-rc="kernel-error">${e(k.error)}</div>` : ''}
  <label>Strategy <select data-rc="strategy">${options}</select></label>
  <span class="rc-muted">(for devices placed from now on)</span>
  <ul class="rc-devices" data-rc="devices">${devices || '<li class="rc-muted">no device yet</li>'}</ul>
  <div data-rc="cache">upload cache: ${fmtPercent(st.cache_hit_rate)} hits, ${fmtBytes(s.cache_bytes_saved)} not re-sent;`
    + ` compression saved ${fmtBytes(s.compressed_bytes_saved)} (${fmtPercent(compressionSavings(s))})</div>
  <div data-rc="live" data-seq="${e(k.live?.seq ?? 0)}">${running
    ? `a cell is running: ${e(running.seconds)} s, ${e(running.ops ?? 0)} ops so far`
    : 'idle'}</div>
  ${renderFailover(st)}
  ${renderCell(k.cell, st.tracing ?? false)}
</div>`;
}

/** Failover on/off with the replay log it rebuilds from, and each device it moved. */
export function renderFailover(st: KernelStatus): string {
  const log = st.replay_log;
  const state = log?.enabled
    ? `failover: on <span class="rc-muted">(replay log ${e(log.ops ?? 0)} ops, ${fmtBytes(log.bytes)}`
      + `${log.bytes_spilled ? `, ${fmtBytes(log.bytes_spilled)} spilled` : ''}; ${e(log.snapshots ?? 0)} snapshot(s))</span>`
    : 'failover: off <span class="rc-muted">(REMOTECUDA_FAILOVER=off)</span>';
  const moves = (st.failovers ?? []).map((f: Failover) => `<li data-rc="failover">${e(f.when)}: ${e(f.device)} moved from`
    + ` ${e(addressKey(f.from))} to ${e(addressKey(f.to))} in ${Number(f.seconds ?? 0).toFixed(2)} s,`
    + ` ${e(f.ops_replayed ?? 0)} ops replayed${f.cause ? ` <span class="rc-muted">(${e(f.cause)})</span>` : ''}</li>`).join('');
  return `<div data-rc="failover-state" data-enabled="${log?.enabled ? 'true' : 'false'}">${state}</div>`
    + (moves ? `<ul class="rc-failovers" data-rc="failovers">${moves}</ul>` : '');
}

/** The trace link of a traced cell, or the control that turns tracing on (for the next cell). */
export function renderTrace(c: CellRecord | null, tracing: boolean): string {
  const hint = '<span class="rc-muted">(opens in <a href="https://ui.perfetto.dev" target="_blank" rel="noopener">ui.perfetto.dev</a>'
    + ' or chrome://tracing)</span>';
  if (c?.traced && c.execution_count !== null && !(c.ops ?? 0)) {
    return '<div data-rc="trace-row" class="rc-muted">traced: no remote op in this cell'
      + ' <button class="jp-mod-styled" data-rc="trace-off">stop tracing</button></div>';
  }
  if (c?.traced && c.execution_count !== null) {
    return `<div data-rc="trace-row"><a href="#" data-rc="trace-link">trace of cell [${e(c.execution_count)}]</a> ${hint}`
      + ` <button class="jp-mod-styled" data-rc="trace-off">stop tracing</button></div>`;
  }
  if (tracing) {
    return '<div data-rc="trace-row" class="rc-muted">tracing: the next cell gets a trace link'
      + ' <button class="jp-mod-styled" data-rc="trace-off">stop tracing</button></div>';
  }
  return '<div data-rc="trace-row"><button class="jp-mod-styled" data-rc="trace-on">trace the next cells</button>'
    + ' <span class="rc-muted">(%remotecuda trace on)</span></div>';
}

export function renderCell(c: CellRecord | null, tracing = false): string {
  if (!c || c.execution_count === null) {
    return '<div class="rc-muted" data-rc="cell">No cell accounted yet.</div>' + renderTrace(null, tracing);
  }
  return `<div data-rc="cell" data-ops="${e(c.ops ?? 0)}"><b>Last cell [${e(c.execution_count)}]</b>`
    + ` ${c.status === 'error' ? `<span class="rc-error">${e(c.error ?? 'error')}</span>` : ''}
  <table class="rc-table">
    <tr><td>ops</td><td data-rc="cell-ops">${e(c.ops ?? 0)}</td></tr>
    <tr><td>up / down</td><td>${fmtBytes(c.bytes_up)} / ${fmtBytes(c.bytes_down)}</td></tr>
    <tr><td>round trips</td><td>${e(c.blocking_round_trips ?? 0)}</td></tr>
    <tr><td>remote wait</td><td>${(c.wait_seconds ?? 0).toFixed(3)} s of ${(c.wall_seconds ?? 0).toFixed(3)} s</td></tr>
  </table>${renderTrace(c, tracing)}</div>`;
}
