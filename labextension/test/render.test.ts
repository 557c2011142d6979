import { describe, expect, it } from 'vitest';

import { KernelStatus, PoolSnapshot } from '../src/model';
import { renderCell, renderKernel, renderPool } from '../src/render';

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
});
