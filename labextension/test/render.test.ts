import { describe, expect, it } from 'vitest';

import { KernelStatus, PoolSnapshot } from '../src/model';
import { renderCell, renderFailover, renderKernel, renderPool, renderTrace } from '../src/render';

const pool: PoolSnapshot = {
  time: 0, error: null, history_seconds: 300, source: 'multicast 239.255.1.1:5000',
  gateways: [
    {
      id: 'a', address: 'tcp://127.0.0.1:5000', host: 'h1', gateway: '0.1.0', sessions: 1,
      gpus: [{ index: 0, name: 'Sim <A100>', simulated: true, total_memory: 1024, free_memory: 512, utilization: 0.5,
        queued: 3, sessions: 1, history: [[-10, 0.5, 0.5], [0, 0.2, 0.5]] }]
    },
    { id: 'b', address: 'tcp://127.0.0.1:5001', gpus: [{ index: 0, name: 'H200', simulated: false }] }
  ]
};

const status: KernelStatus = {
  type: 'status', version: '0.1.0', active: true, error: null, strategy: 'memory-aware', fallback_gateway: false,
  found_via: 'discovery',
  devices: [{ device: 'cuda:0', name: 'Sim <A100>', gateway: 'tcp://127.0.0.1:5000', gpu: 0, placed: true, simulated: true }],
  session: { cache_bytes_saved: 2048, compressed_bytes_saved: 0, bytes_up: 10 }, cache_hit_rate: 0.5
};

describe('render', () => {
  it('lists each gateway and GPU, marks the notebook\'s GPU, and escapes names', () => {
    const html = renderPool(pool, null, { state: 'remotecuda', kernelName: 'k', status, cell: null, live: null, error: null });
    expect(html.match(/data-rc="gateway"/g)).toHaveLength(2);
    expect(html).toContain('data-address="127.0.0.1:5000"');
    expect(html).toContain('Sim &lt;A100&gt;');
    expect(html).not.toContain('<A100>');
    expect(html).toContain('this notebook: cuda:0');
    expect(html.match(/data-rc="mine"/g)).toHaveLength(1);
    expect(html).toContain('>simulated<');
    expect(html).toContain('>real<');
    expect(html).toContain('width:50.0%');
    expect(html).toContain('<polyline');
  });

  it('says when no gateway announces itself, and when the pool is unreachable', () => {
    expect(renderPool({ ...pool, gateways: [] }, null, { state: 'none' })).toContain('data-rc="no-gateways"');
    expect(renderPool(null, 'Error: 403', { state: 'none' })).toContain('Pool unavailable');
  });

  it('offers %load_ext remotecuda for another kernel', () => {
    const html = renderKernel({ state: 'not-remotecuda', kernelName: 'Python 3' });
    expect(html).toContain('data-rc="load-ext"');
    expect(html).toContain('Python 3');
  });

  it('shows the strategy selected, the devices, the cache and the running cell', () => {
    const html = renderKernel({
      state: 'remotecuda', kernelName: 'k', status, cell: null, error: null,
      live: { type: 'live', seq: 7, running: { seconds: 12, ops: 40 } }
    });
    expect(html).toContain('<option value="memory-aware" selected>');
    expect(html).toContain('cuda:0 → Sim &lt;A100&gt; @ 127.0.0.1:5000 GPU 0');
    expect(html).toContain('50 % hits, 2.0 KiB not re-sent');
    expect(html).toContain('data-seq="7"');
    expect(html).toContain('a cell is running: 12 s, 40 ops so far');
  });

  it('shows the last cell\'s accounting', () => {
    const html = renderCell({ type: 'cell', execution_count: 4, ops: 69, bytes_up: 2048, bytes_down: 10,
      blocking_round_trips: 1, wait_seconds: 0.5, wall_seconds: 1 });
    expect(html).toContain('data-ops="69"');
    expect(html).toContain('2.0 KiB / 10 B');
    expect(renderCell(null)).toContain('No cell accounted yet');
  });

  it('links a traced cell to its trace, and offers tracing when it is off', () => {
    const traced = renderCell({ type: 'cell', execution_count: 12, ops: 3, traced: true }, true);
    expect(traced).toContain('data-rc="trace-link"');
    expect(traced).toContain('trace of cell [12]');
    expect(traced).toContain('ui.perfetto.dev');
    expect(traced).toContain('data-rc="trace-off"');
    const untraced = renderCell({ type: 'cell', execution_count: 13, ops: 3, traced: false }, false);
    expect(untraced).not.toContain('data-rc="trace-link"');
    expect(untraced).toContain('data-rc="trace-on"');
    // on, but the last cell ran before: the next one gets the link
    expect(renderTrace({ type: 'cell', execution_count: 13, traced: false }, true)).toContain('the next cell gets a trace link');
    expect(renderCell(null, false)).toContain('data-rc="trace-on"');
    const html = renderKernel({ state: 'remotecuda', kernelName: 'k', status: { ...status, tracing: true },
      cell: { type: 'cell', execution_count: 2, ops: 5, traced: true }, live: null, error: null });
    expect(html).toContain('data-rc="trace-link"');
    expect(renderTrace({ type: 'cell', execution_count: 3, ops: 0, traced: true }, true)).toContain('no remote op');
  });

  it('shows failover off, on with its replay log, and each device moved', () => {
    expect(renderFailover(status)).toContain('failover: off');
    expect(renderFailover(status)).toContain('data-enabled="false"');
    expect(renderFailover(status)).not.toContain('data-rc="failovers"');
    const moved = {
      ...status,
      replay_log: { enabled: true, ops: 120, bytes: 4096, bytes_spilled: 0, snapshots: 1 },
      failovers: [{ when: '2026-12-05T18:00:00', device: 'cuda:0', from: '127.0.0.1:5000 GPU 0', to: '127.0.0.1:5001 GPU 1',
        seconds: 1.234, ops_replayed: 57, cause: 'gateway <gone>' }]
    };
    const html = renderFailover(moved);
    expect(html).toContain('data-enabled="true"');
    expect(html).toContain('replay log 120 ops, 4.0 KiB; 1 snapshot(s)');
    expect(html.match(/data-rc="failover"/g)).toHaveLength(1);
    expect(html).toContain('2026-12-05T18:00:00: cuda:0 moved from 127.0.0.1:5000 GPU 0 to 127.0.0.1:5001 GPU 1 in 1.23 s, 57 ops replayed');
    expect(html).toContain('gateway &lt;gone&gt;');
    expect(renderKernel({ state: 'remotecuda', kernelName: 'k', status: moved, cell: null, live: null, error: null }))
      .toContain('data-rc="failovers"');
  });
});
