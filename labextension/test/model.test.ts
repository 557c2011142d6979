import { describe, expect, it, vi } from 'vitest';

import {
  addressKey, compressionSavings, escapeHtml, fmtBytes, fmtPercent, KernelStatus, memoryFraction, sparklinePoints,
  Throttle, traceFileName, usedGpus
} from '../src/model';

function status(devices: KernelStatus['devices']): KernelStatus {
  return {
    type: 'status', version: '0.1.0', active: true, error: null, strategy: 'adaptive', fallback_gateway: false,
    found_via: 'discovery', devices, session: {}, cache_hit_rate: null
  };
}

describe('model', () => {
  it('formats bytes as the magics do', () => {
    expect(fmtBytes(0)).toBe('0 B');
    expect(fmtBytes(1023)).toBe('1023 B');
    expect(fmtBytes(1536)).toBe('1.5 KiB');
    expect(fmtBytes(16 * 2 ** 30)).toBe('16.0 GiB');
    expect(fmtBytes(undefined)).toBe('-');
    expect(fmtPercent(0.333)).toBe('33 %');
    expect(fmtPercent(null)).toBe('n/a');
  });

  it('finds the GPUs the kernel uses, by gateway address and index', () => {
    const used = usedGpus(status([
      { device: 'cuda:0', name: 'A', gateway: 'tcp://127.0.0.1:5000', gpu: 1, placed: true },
      { device: 'cuda:1', name: 'A', gateway: 'tcp://127.0.0.1:5000', gpu: 1, placed: true },
      { device: 'cuda:2', name: null, gateway: null, gpu: null, placed: false }
    ]));
    expect([...used.entries()]).toEqual([['127.0.0.1:5000/1', ['cuda:0', 'cuda:1']]]);
    expect(usedGpus(null).size).toBe(0);
    expect(addressKey('tcp://h:1')).toBe('h:1');
  });

  it('reads memory use from the beacon figures', () => {
    expect(memoryFraction({ index: 0, total_memory: 100, free_memory: 25 })).toBe(0.75);
    expect(memoryFraction({ index: 0, total_memory: 100 })).toBeNull();
    expect(memoryFraction({ index: 0 })).toBeNull();
  });

  it('draws the load sparkline with now at the right and full load at the top', () => {
    expect(sparklinePoints([], 300, 100, 20)).toBe('');
    expect(sparklinePoints([[-300, 0, 0], [-150, 0.5, 0], [0, 1, 0]], 300, 100, 20)).toBe('0.0,20.0 50.0,10.0 100.0,0.0');
    // samples older than the span are left out; one sample is drawn as a flat line up to now
    expect(sparklinePoints([[-400, 1, 0], [-30, 0.25, 0]], 300, 100, 20)).toBe('90.0,15.0 100.0,15.0');
  });

  it('computes compression savings', () => {
    expect(compressionSavings({ compressed_bytes_saved: 300, bytes_up: 100 })).toBe(0.75);
    expect(compressionSavings({})).toBeNull();
  });

  it('escapes what comes from the network', () => {
    expect(escapeHtml('<img src=x onerror="a">&\'')).toBe('&lt;img src=x onerror=&quot;a&quot;&gt;&amp;&#39;');
  });

  it('throttles to one call per interval, folding the calls in between into one', () => {
    vi.useFakeTimers();
    let now = 0;
    const fn = vi.fn();
    const t = new Throttle(fn, 500, () => now);
    t.call();
    expect(fn).toHaveBeenCalledTimes(1);
    now = 100;
    t.call();
    t.call();
    t.call();
    expect(fn).toHaveBeenCalledTimes(1);
    now = 500;
    vi.advanceTimersByTime(400);
    expect(fn).toHaveBeenCalledTimes(2);
    t.dispose();
    vi.useRealTimers();
  });

  it('names a cell\'s trace file after the cell', () => {
    expect(traceFileName(12)).toBe('cell-12.trace.json');
    expect(traceFileName(null)).toBe('cell-unnumbered.trace.json');
  });
});
