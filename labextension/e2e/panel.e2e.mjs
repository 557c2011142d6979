// End-to-end check of the "GPU pool" panel in a real JupyterLab, driven by playwright-core in
// the system's Chromium (no browser download). Started by tests/test_panel_e2e.py, which starts
// JupyterLab, the gateways and writes the notebook; the settings come in the environment.
// Exit status 0: every step passed; screenshots go to $ARTIFACTS.
import { chromium } from 'playwright-core';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const env = process.env;
const ART = env.ARTIFACTS;
const GATEWAYS = env.GATEWAYS.split(',');
fs.mkdirSync(ART, { recursive: true });
const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'rc-chromium-'));

function step(msg) {
  console.log(`[e2e ${new Date().toISOString().slice(11, 19)}] ${msg}`);
}

// an empty profile (playwright passes it as --user-data-dir)
const browser = await chromium.launchPersistentContext(userDataDir, {
  executablePath: env.CHROMIUM,
  headless: true,
  viewport: { width: 1500, height: 900 },
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', '--no-first-run']
});
const page = browser.pages()[0] ?? await browser.newPage();
page.setDefaultTimeout(60000);
page.on('console', m => { if (m.type() === 'error') console.log(`[browser] ${m.text()}`); });
const shot = async name => page.screenshot({ path: path.join(ART, `${name}.png`) });
const gatewayCount = () => page.locator('[data-rc="gateway"]').count();
const cell = i => page.locator('.jp-Notebook .jp-Cell').nth(i);

async function runCell(i) {
  await cell(i).locator('.jp-InputPrompt').click();
  await page.keyboard.press('Escape');
  await cell(i).locator('.jp-InputPrompt').click();
  await page.keyboard.press('Shift+Enter');
}

async function waitFor(what, fn, timeoutMs = 60000) {
  const end = Date.now() + timeoutMs;
  for (;;) {
    const v = await fn();
    if (v) {
      return v;
    }
    if (Date.now() > end) {
      throw new Error(`timed out waiting for ${what}`);
    }
    await page.waitForTimeout(250);
  }
}

let failed = false;
try {
  step('open the notebook');
  await page.goto(`${env.LAB_URL}lab/tree/${env.NOTEBOOK}?token=${env.TOKEN}`);
  await page.locator('.jp-Notebook .jp-Cell').first().waitFor();
  step('open the GPU pool panel');
  await page.locator('.lm-TabBar-tab[data-id="remotecuda-gpu-pool"]').click();
  await page.locator('#remotecuda-gpu-pool').waitFor({ state: 'visible' });

  step('both gateways are listed');
  await waitFor('two gateways in the panel', async () => (await gatewayCount()) === 2);
  for (const g of GATEWAYS) {
    await page.locator(`[data-rc="gateway"][data-address="${g}"]`).waitFor();
  }
  step('the kernel is a RemoteCUDA one and reports its strategy');
  await waitFor('strategy adaptive', async () =>
    (await page.locator('select[data-rc="strategy"]').count()) > 0
    && (await page.locator('select[data-rc="strategy"]').inputValue()) === 'adaptive', 120000);
  await shot('1-pool-before-training');

  step('turn tracing on in the panel');
  await page.locator('button[data-rc="trace-on"]').click();
  await waitFor('the kernel to report tracing', async () =>
    /the next cell gets a trace link/.test((await page.locator('[data-rc="trace-row"]').textContent()) ?? ''), 30000);

  step('run the training cell');
  await runCell(0);
  const ops = await waitFor('a nonzero op count for the cell', async () => {
    const el = page.locator('[data-rc="cell-ops"]');
    const n = (await el.count()) ? Number(await el.textContent()) : 0;
    return n > 0 ? n : 0;
  }, 180000);
  step(`last cell: ${ops} ops`);
  const out0 = await cell(0).locator('.jp-OutputArea').textContent();
  if (!/loss/.test(out0)) {
    throw new Error(`training cell output: ${out0}`);
  }
  await page.locator('[data-rc="mine"]').first().waitFor();
  await page.locator('[data-rc="trace-link"]').waitFor({ timeout: 30000 });
  await shot('2-after-training');

  step('download the training cell\'s trace from its link');
  const [download] = await Promise.all([page.waitForEvent('download', { timeout: 30000 }),
    page.locator('[data-rc="trace-link"]').click()]);
  const traceFile = path.join(ART, download.suggestedFilename());
  await download.saveAs(traceFile);
  if (!/^cell-\d+\.trace\.json$/.test(download.suggestedFilename())) {
    throw new Error(`trace file named ${download.suggestedFilename()}`);
  }
  const traceOps = JSON.parse(fs.readFileSync(traceFile, 'utf8')).traceEvents.filter(ev => ev.ph === 'X' && ev.cat === 'ops');
  step(`downloaded ${download.suggestedFilename()}: ${traceOps.length} op events`);
  if (traceOps.length === 0) {
    throw new Error('the downloaded trace has no op event');
  }

  step('change the strategy in the panel');
  await page.locator('select[data-rc="strategy"]').selectOption('memory-aware');
  await waitFor('the kernel to report memory-aware', async () =>
    (await page.locator('select[data-rc="strategy"]').inputValue()) === 'memory-aware'
    && (await page.locator('[data-rc="kernel"]').count()) > 0);
  await page.waitForTimeout(1500); // a status push after the change, rendered
  if ((await page.locator('select[data-rc="strategy"]').inputValue()) !== 'memory-aware') {
    throw new Error('the strategy went back');
  }
  await runCell(1);
  await waitFor('%remotecuda strategy output', async () =>
    /strategy: memory-aware/.test((await cell(1).locator('.jp-OutputArea').textContent()) ?? ''));
  step('the kernel says memory-aware');

  step('run a cell that sleeps 10 s; the panel keeps updating');
  await runCell(2);
  const live = page.locator('[data-rc="live"]');
  await waitFor('the running cell in the panel', async () => /a cell is running/.test((await live.textContent()) ?? ''), 8000);
  const seq1 = Number(await live.getAttribute('data-seq'));
  const text1 = await live.textContent();
  await page.waitForTimeout(3000);
  const seq2 = Number(await live.getAttribute('data-seq'));
  const text2 = await live.textContent();
  step(`during the sleep: "${text1}" (push ${seq1}) then "${text2}" (push ${seq2})`);
  if (!(seq2 > seq1) || text1 === text2 || !/a cell is running/.test(text2)) {
    throw new Error('the panel did not update while the cell ran');
  }
  await shot('3-while-sleeping');

  step('change the strategy while the cell sleeps: the kernel answers at once (comms on a subshell)');
  await page.locator('select[data-rc="strategy"]').selectOption('latency-optimized');
  await waitFor('the kernel to report latency-optimized while the cell still runs', async () =>
    (await page.locator('[data-rc="kernel"]').getAttribute('data-strategy')) === 'latency-optimized', 5000);
  if (!/a cell is running/.test((await live.textContent()) ?? '')) {
    throw new Error('the cell ended before the kernel answered: answered by the busy shell, not a subshell');
  }

  step(`stop gateway ${env.KILL_ADDRESS}`);
  process.kill(Number(env.KILL_PID), 'SIGKILL');
  await waitFor('the stopped gateway to leave the panel', async () =>
    (await gatewayCount()) === 1
    && (await page.locator(`[data-rc="gateway"][data-address="${env.KILL_ADDRESS}"]`).count()) === 0, 30000);
  await shot('4-one-gateway-left');

  step('follow another notebook, on a plain Python kernel');
  await page.locator('.jp-DirListing-itemText', { hasText: env.PLAIN_NOTEBOOK }).dblclick();
  await page.locator('[data-rc="not-remotecuda"]').waitFor({ timeout: 120000 });
  await shot('5-plain-kernel');
  step('the panel offers %load_ext remotecuda; use it');
  await page.locator('button[data-rc="load-ext"]').click();
  await page.locator('select[data-rc="strategy"]').waitFor({ timeout: 120000 });
  await shot('6-plain-kernel-loaded');
  step('done');
} catch (err) {
  failed = true;
  console.log(`FAILED: ${err.stack || err}`);
  try {
    await shot('failure');
  } catch {
    // the page is gone
  }
} finally {
  await browser.close();
  fs.rmSync(userDataDir, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);
