/**
 * The panel's data: the pool as the Jupyter server hears it (GET /remotecuda/pool) and the
 * notebook kernel's own view (messages on the "remotecuda" comm), both documented in
 * docs/JUPYTER.md. Pure functions only, so they are unit-tested without a browser.
 */

export const STRATEGIES = ['adaptive', 'load-balancing', 'memory-aware', 'latency-optimized'];

/** One GPU of a gateway, as its beacon describes it, with the server's recent samples. */
export interface PoolGpu {
  index: number;
  name?: string;
  kind?: string;
  simulated?: boolean;
  total_memory?: number;
  free_memory?: number;
  utilization?: number;
  queued?: number;
  sessions?: number;
  latency_ms?: number | null;
  /** [seconds before now (negative), utilization 0..1, memory used 0..1] */
  history?: [number, number, number][];
}

export interface PoolGateway {
  id: string;
  address: string;
  host?: string;
  gateway?: string;
  sessions?: number;
  age_s?: number;
  gpus: PoolGpu[];
}

export interface PoolSnapshot {
  time: number;
  error: string | null;
  history_seconds: number;
  source: string | null;
  gateways: PoolGateway[];
}

export interface KernelDevice {
  device: string;
  name: string | null;
  gateway: string | null;
  gpu: number | null;
  placed: boolean;
  simulated?: boolean;
  strategy?: string | null;
  reason?: string | null;
}

export interface KernelStatus {
  type: 'status';
  version: string;
  active: boolean;
  error: string | null;
  strategy: string;
  fallback_gateway: boolean;
  found_via: string | null;
  devices: KernelDevice[];
  session: Record<string, number>;
  cache_hit_rate: number | null;
  /** %remotecuda trace on: the cells run from now on are traced (absent from older kernels) */
  tracing?: boolean;
  /** each device moved off a failed gateway, oldest first (remotecuda/failover.py) */
  failovers?: Failover[];
  /** the replay log failover rebuilds a device from; absent or not enabled: failover is off */
  replay_log?: ReplayLog | null;
}

export interface Failover {
  when: string;
  device: string;
  from: string;
  to: string;
  seconds: number;
  ops_replayed: number;
  cause?: string;
}

export interface ReplayLog {
  enabled: boolean;
  ops?: number;
  bytes?: number;
  bytes_spilled?: number;
  snapshots?: number;
}

/** The last traced cell's trace (the answer to a "last_trace" request). */
export interface TraceRecord {
  type: 'trace';
  execution_count: number | null;
  bytes: number;
  trace: { traceEvents: unknown[] };
}

/** The file name a cell's trace downloads as. */
export function traceFileName(executionCount: number | null): string {
  return `cell-${executionCount ?? 'unnumbered'}.trace.json`;
}

export interface CellRecord {
  type: 'cell';
  execution_count: number | null;
  status?: string;
  error?: string | null;
  ops?: number;
  messages?: number;
  bytes_up?: number;
  bytes_down?: number;
  blocking_round_trips?: number;
  wait_seconds?: number;
  wall_seconds?: number;
  /** recorded while tracing: its trace can be asked for ("last_trace") */
  traced?: boolean;
}

export interface LiveRecord {
  type: 'live';
  seq: number;
  running: { seconds: number; ops?: number; bytes_up?: number; bytes_down?: number } | null;
}

/** What the panel knows of the active notebook's kernel. */
export type KernelView =
  | { state: 'none' } // no notebook is active
  | { state: 'connecting'; kernelName: string }
  | { state: 'not-remotecuda'; kernelName: string }
  | { state: 'remotecuda'; kernelName: string; status: KernelStatus | null; cell: CellRecord | null; live: LiveRecord | null; error: string | null };

/** "tcp://127.0.0.1:5555" and "127.0.0.1:5555" name the same gateway. */
export function addressKey(address: string | null | undefined): string {
  return (address ?? '').replace(/^tcp:\/\//, '');
}

/** "address/gpu" of every GPU the kernel's devices are placed on, each with the devices on it. */
export function usedGpus(status: KernelStatus | null): Map<string, string[]> {
  const used = new Map<string, string[]>();
  for (const d of status?.devices ?? []) {
    if (!d.placed || d.gateway === null || d.gpu === null) {
      continue;
    }
    const key = `${addressKey(d.gateway)}/${d.gpu}`;
    used.set(key, [...(used.get(key) ?? []), d.device]);
  }
  return used;
}

export function fmtBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !isFinite(n)) {
    return '-';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = n;
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return i === 0 ? `${v.toFixed(0)} B` : `${v.toFixed(1)} ${units[i]}`;
}

export function fmtPercent(x: number | null | undefined): string {
  return x === null || x === undefined || !isFinite(x) ? 'n/a' : `${Math.round(x * 100)} %`;
}

/** Used memory as a fraction of the total, or null when the beacon does not say. */
export function memoryFraction(gpu: PoolGpu): number | null {
  if (!gpu.total_memory || gpu.free_memory === undefined || gpu.free_memory === null) {
    return null;
  }
  return Math.min(1, Math.max(0, (gpu.total_memory - gpu.free_memory) / gpu.total_memory));
}

/**
 * An SVG polyline's points for utilization samples over the last `span` seconds, in a
 * `width` x `height` box: x is time (now at the right), y is 0..1 (1 at the top).
 */
export function sparklinePoints(history: [number, number, number][] | undefined, span: number,
  width: number, height: number): string {
  if (!history || history.length === 0 || span <= 0) {
    return '';
  }
  const pts = history
    .filter(([t]) => t >= -span)
    .map(([t, u]) => {
      const x = width * (1 + t / span);
      const y = height * (1 - Math.min(1, Math.max(0, u)));
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
  if (pts.length === 1) {
    // one sample: a flat segment up to now, so it is visible
    pts.push(`${width.toFixed(1)},${pts[0].split(',')[1]}`);
  }
  return pts.join(' ');
}

/** Compression savings: bytes saved by compression over the bytes that would have gone. */
export function compressionSavings(session: Record<string, number> | undefined): number | null {
  if (!session) {
    return null;
  }
  const saved = session.compressed_bytes_saved ?? 0;
  const sent = session.bytes_up ?? 0;
  return saved + sent > 0 ? saved / (saved + sent) : null;
}

export function escapeHtml(s: unknown): string {
  return String(s ?? '').replace(/[&<>"']/g, c => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' })[c] as string);
}

/** Calls `fn` at most once per `interval` ms: a call meanwhile is folded into one at the end. */
export class Throttle {
  private last = -Infinity;
  private timer: ReturnType<typeof setTimeout> | null = null;

  constructor(private fn: () => void, private interval: number, private now: () => number = Date.now) {}

  call(): void {
    const wait = this.last + this.interval - this.now();
    if (wait <= 0 && this.timer === null) {
      this.last = this.now();
      this.fn();
    } else if (this.timer === null) {
      this.timer = setTimeout(() => {
        this.timer = null;
        this.last = this.now();
        this.fn();
      }, Math.max(0, wait));
    }
  }

  dispose(): void {
    if (this.timer !== null) {
      clearTimeout(this.timer);
      this.timer = null;
    }
  }
}
