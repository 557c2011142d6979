import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';

import { PoolPanel } from './panel';

/** The "GPU pool" panel in the right sidebar. */
const plugin: JupyterFrontEndPlugin<void> = {
  id: 'remotecuda-labextension:gpu-pool',
  description: 'RemoteCUDA: the GPU pool, its load, and what the active notebook uses',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILayoutRestorer],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker, restorer: ILayoutRestorer | null) => {
    const panel = new PoolPanel(tracker);
    app.shell.add(panel, 'right', { rank: 900 });
    if (restorer) {
      restorer.add(panel, panel.id);
    }
  }
};

export default plugin;
