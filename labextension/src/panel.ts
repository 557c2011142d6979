/**
 * The "GPU pool" sidebar: polls the server's pool (GET /remotecuda/pool, once a second) and
 * talks to the active notebook's kernel on the "remotecuda" comm (docs/JUPYTER.md).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage, ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

import { CellRecord, KernelStatus, KernelView, LiveRecord, PoolSnapshot, Throttle, traceFileName, TraceRecord } from './model';
import { renderKernel, renderPool } from './render';

export const COMM_TARGET = 'remotecuda';
const POLL_MS = 1000;
const RENDER_MS = 500; // at most two renders a second

export class PoolPanel extends Widget {
  private pool: PoolSnapshot | null = null;
  private poolError: string | null = null;
  private kernelView: KernelView = { state: 'none' };
  private notebook: NotebookPanel | null = null;
  private comm: Kernel.IComm | null = null;
  private poolNode: HTMLElement;
  private kernelNode: HTMLElement;
  private timer: ReturnType<typeof setInterval>;
  private render: Throttle;
  private restarting = false;

  constructor(tracker: INotebookTracker, private settings = ServerConnection.makeSettings()) {
    super();
    this.id = 'remotecuda-gpu-pool';
    this.addClass('rc-panel');
    this.title.label = 'GPU pool';
    this.title.caption = 'RemoteCUDA: the GPU pool and this notebook\'s session';
    this.node.innerHTML = '<h2 class="rc-title">GPU pool</h2><div data-rc="pool"></div><div data-rc="kernel-section"></div>';
    this.poolNode = this.node.querySelector('[data-rc="pool"]') as HTMLElement;
    this.kernelNode = this.node.querySelector('[data-rc="kernel-section"]') as HTMLElement;
    this.render = new Throttle(() => this.draw(), RENDER_MS);
    this.node.addEventListener('change', ev => this.onChange(ev));
    this.node.addEventListener('click', ev => this.onClick(ev));
    tracker.currentChanged.connect((_, panel) => this.follow(panel), this);
    NotebookActions.executed.connect((_, args) => {
      // a %load_ext remotecuda typed into a cell: ask again
      if (args.notebook === this.notebook?.content && this.kernelView.state === 'not-remotecuda') {
        this.probe();
      }
    }, this);
    this.follow(tracker.currentWidget);
    this.timer = setInterval(() => void this.fetchPool(), POLL_MS);
    void this.fetchPool();
  }

  dispose(): void {
    clearInterval(this.timer);
    this.render.dispose();
    this.closeComm();
    super.dispose();
  }

  private async fetchPool(): Promise<void> {
    try {
      const url = URLExt.join(this.settings.baseUrl, 'remotecuda', 'pool');
      const resp = await ServerConnection.makeRequest(url, {}, this.settings);
      if (!resp.ok) {
        throw new Error(`${resp.status} ${resp.statusText}`);
      }
      this.pool = (await resp.json()) as PoolSnapshot;
      this.poolError = null;
    } catch (err) {
      this.poolError = String(err);
    }
    this.render.call();
  }

  private draw(): void {
    this.poolNode.innerHTML = renderPool(this.pool, this.poolError, this.kernelView);
    // not while the user holds the strategy menu open
    if (document.activeElement?.getAttribute('data-rc') !== 'strategy') {
      this.kernelNode.innerHTML = renderKernel(this.kernelView);
    }
  }

  private follow(panel: NotebookPanel | null): void {
    if (panel === this.notebook) {
      return;
    }
    if (this.notebook) {
      this.notebook.sessionContext.kernelChanged.disconnect(this.probe, this);
      this.notebook.sessionContext.statusChanged.disconnect(this.onStatus, this);
    }
    this.closeComm();
    this.notebook = panel;
    if (!panel) {
      this.setView({ state: 'none' });
      return;
    }
    panel.sessionContext.kernelChanged.connect(this.probe, this);
    panel.sessionContext.statusChanged.connect(this.onStatus, this);
    void panel.sessionContext.ready.then(() => {
      if (this.notebook === panel) {
        this.probe();
      }
    });
  }

  private onStatus(_: unknown, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting') {
      this.restarting = true;
    } else if (status === 'idle' && this.restarting) {
      this.restarting = false;
      this.probe();
    }
  }

  /** Open the comm: a RemoteCUDA kernel answers with its status; any other closes it. */
  private probe(): void {
    this.closeComm();
    const kernel = this.notebook?.sessionContext.session?.kernel;
    if (!kernel) {
      this.setView({ state: 'none' });
      return;
    }
    const kernelName = this.notebook?.sessionContext.kernelDisplayName ?? kernel.name;
    this.setView({ state: 'connecting', kernelName });
    let comm: Kernel.IComm;
    try {
      comm = kernel.createComm(COMM_TARGET);
    } catch (err) {
      this.setView({ state: 'not-remotecuda', kernelName });
      return;
    }
    this.comm = comm;
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => this.onMessage(kernelName, msg.content.data as any);
    comm.onClose = () => {
      if (this.comm === comm) {
        this.comm = null;
        this.setView(this.kernelView.state === 'remotecuda'
          ? { ...this.kernelView, error: 'the kernel closed the connection (%unload_ext?)' }
          : { state: 'not-remotecuda', kernelName });
      }
    };
    comm.open({});
  }

  private onMessage(kernelName: string, data: { type?: string;[k: string]: unknown }): void {
    const prev = this.kernelView.state === 'remotecuda' ? this.kernelView
      : { state: 'remotecuda' as const, kernelName, status: null, cell: null, live: null, error: null };
    if (data.type === 'status') {
      if (this.kernelView.state !== 'remotecuda') {
        this.useSubshell();
      }
      this.setView({ ...prev, status: data as unknown as KernelStatus, error: null });
    } else if (data.type === 'cell') {
      this.setView({ ...prev, cell: data as unknown as CellRecord });
    } else if (data.type === 'live') {
      this.setView({ ...prev, live: data as unknown as LiveRecord });
    } else if (data.type === 'trace') {
      this.download(data as unknown as TraceRecord);
    } else if (data.type === 'error') {
      this.setView({ ...prev, error: String(data.error) });
    }
  }

  /** Save a cell's trace as a file (the browser's download), for ui.perfetto.dev or chrome://tracing. */
  private download(rec: TraceRecord): void {
    const blob = new Blob([JSON.stringify(rec.trace)], { type: 'application/json' });
    const url = URL.createObjectURL(blob);
    const a = document.createElement('a');
    a.href = url;
    a.download = traceFileName(rec.execution_count);
    a.style.display = 'none';
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
  }

  /**
   * Requests (a strategy change) go to a kernel subshell from now on, where the kernel has them
   * (ipykernel 7, JEP 91): answered while a cell runs, not after it. The comm was opened on the
   * main shell, so the kernel activates on its main thread.
   */
  private useSubshell(): void {
    const kernel = this.notebook?.sessionContext.session?.kernel;
    if (this.comm && kernel?.supportsSubshells) {
      this.comm.commsOverSubshells = 'perCommTarget' as Kernel.IComm['commsOverSubshells'];
    }
  }

  private setView(view: KernelView): void {
    this.kernelView = view;
    this.render.call();
  }

  private closeComm(): void {
    const comm = this.comm;
    this.comm = null;
    if (comm && !comm.isDisposed) {
      try {
        comm.close();
      } catch {
        // the kernel is gone already
      }
    }
  }

  private onChange(ev: Event): void {
    const target = ev.target as HTMLElement;
    if (target.getAttribute('data-rc') === 'strategy' && this.comm) {
      this.comm.send({ request: 'strategy', name: (target as HTMLSelectElement).value });
      (target as HTMLSelectElement).blur();
    }
  }

  private onClick(ev: Event): void {
    const target = ev.target as HTMLElement;
    const what = target.getAttribute('data-rc');
    if (what === 'trace-link' || what === 'trace-on' || what === 'trace-off') {
      ev.preventDefault();
      this.comm?.send(what === 'trace-link' ? { request: 'last_trace' } : { request: 'trace', on: what === 'trace-on' });
    } else if (what === 'load-ext') {
      const kernel = this.notebook?.sessionContext.session?.kernel;
      if (kernel) {
        const future = kernel.requestExecute({ code: '%load_ext remotecuda', store_history: false });
        void future.done.then(() => this.probe());
      }
    }
  }
}
