// console_test.mjs - the console page (web/console/) in headless chromium, driven by
// playwright-core (issue 38's acceptance 1, in part).
//
//   cd tests/browser && npm ci && node console_test.mjs
//
// Without KVR_CONSOLE_URL it starts stub_server.mjs (a fake ring) and tests the page's own
// logic; with KVR_CONSOLE_URL=http://127.0.0.1:PORT it runs against that server (a real
// `kvasir serve`: tests/integration/console_browser.sh), skips what only the stub can do (a
// refusal on demand, the 8-stage frame rate), checks each stage's shares against /metrics,
// and kills a stage only if KVR_CONSOLE_KILL names a command that kills one.
//
// It checks that: the page loads with a Content-Security-Policy; no request leaves
// 127.0.0.1 (they are all recorded, and anything else is aborted and fails the test); no
// console error or uncaught exception; the ring's lanes fill with batches and the stage
// table shows every stage; a chat answer streams in with its timings; a refusal shows its
// reason; a lost stage shows as lost, then the ring as recovered; the page draws at
// >= KVR_CONSOLE_MIN_FPS (30) frames/s with 8 stages at 100 batches/s (stub only). It writes
// screenshots to build/console-*.png (KVR_CONSOLE_SHOTS overrides the folder).
//
// Environment: KVR_CHROMIUM (default /usr/bin/chromium), KVR_API_KEY (the server's key: the
// first page must ask for it, and is given it in its dialog; later pages start with it),
// KVR_CONSOLE_TIMEOUT_MS (per step, default 15000).
import { chromium } from 'playwright-core';
import { execSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { startStub } from './stub_server.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const shots = process.env.KVR_CONSOLE_SHOTS || path.resolve(here, '../../build');
const STEP_MS = Number(process.env.KVR_CONSOLE_TIMEOUT_MS || 15000);
const MIN_FPS = Number(process.env.KVR_CONSOLE_MIN_FPS || 30);
fs.mkdirSync(shots, { recursive: true });

const failures = [];
function check(cond, what) {
  console.log((cond ? 'ok   ' : 'FAIL ') + what);
  if (!cond) failures.push(what);
}

// Every request the page makes must go to the server under test on 127.0.0.1.
function isLocal(url, base) {
  const u = new URL(url);
  if (u.protocol === 'data:' || u.protocol === 'blob:') return true;
  return u.hostname === '127.0.0.1' && u.origin === new URL(base).origin;
}

async function openPage(browser, base, opts, log, seedKey = true) {
  const context = await browser.newContext(opts);
  const page = await context.newPage();
  await page.route('**/*', (route) => {
    const url = route.request().url();
    log.requests.push(url);
    if (!isLocal(url, base)) {
      log.external.push(url);
      return route.abort();
    }
    return route.continue();
  });
  page.on('console', (msg) => {
    if (msg.type() === 'error') log.errors.push(msg.text());
  });
  page.on('pageerror', (err) => log.errors.push('uncaught: ' + err.message));
  page.on('dialog', (d) => d.dismiss());
  if (process.env.KVR_API_KEY && seedKey)
    await page.addInitScript((k) => sessionStorage.setItem('kvasir.apiKey', k), process.env.KVR_API_KEY);
  return { context, page };
}

// n streams of chat at once, again and again for `ms`; a refusal just means try again.
async function backgroundLoad(base, n, ms) {
  const until = Date.now() + ms;
  const headers = { 'Content-Type': 'application/json' };
  if (process.env.KVR_API_KEY) headers.Authorization = 'Bearer ' + process.env.KVR_API_KEY;
  const one = async (k) => {
    while (Date.now() < until) {
      try {
        const r = await fetch(base + '/v1/chat/completions', { method: 'POST', headers,
          body: JSON.stringify({ messages: [{ role: 'user', content: 'load ' + k }], max_tokens: 256,
                                 ignore_eos: true, stream: true }) });
        await r.text();
      } catch (e) { await new Promise((r) => setTimeout(r, 200)); }
    }
  };
  await Promise.all(Array.from({ length: n }, (_, k) => one(k)));
}

// Each stage's held / starved / blocked share as the page shows it (whole percent), and as
// /metrics gives it (kvasir:stage_utilization, _starved_fraction, _blocked_fraction).
async function pageShares(page) {
  return page.evaluate(() => [...document.querySelectorAll('#stages .share-text')]
    .map((e) => (e.textContent.match(/\d+(?=%)/g) || []).slice(0, 3).map(Number)));
}
async function metricShares(base) {
  const headers = process.env.KVR_API_KEY ? { Authorization: 'Bearer ' + process.env.KVR_API_KEY } : {};
  const text = await (await fetch(base + '/metrics', { headers })).text();
  const out = [];
  ['stage_utilization', 'stage_starved_fraction', 'stage_blocked_fraction'].forEach((name, k) => {
    for (const m of text.matchAll(new RegExp('^kvasir:' + name + '\\{(?:model_name="[^"]*",)?stage="(\\d+)"\\} (\\S+)$', 'gm')))
      (out[+m[1]] = out[+m[1]] || [])[k] = Number(m[2]) * 100;
  });
  return out;
}

async function main() {
  let stub = null;
  let base = process.env.KVR_CONSOLE_URL;
  if (!base) {
    stub = await startStub({ stages: 4, bps: 100 });
    base = stub.url;
    console.log('stub server on ' + base);
  }
  const browser = await chromium.launch({
    executablePath: process.env.KVR_CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
  });
  const log = { requests: [], external: [], errors: [] };
  try {
    const { context, page } = await openPage(browser, base,
      { viewport: { width: 1400, height: 900 }, colorScheme: 'light' }, log, false);

    // ---- load ---------------------------------------------------------------------------
    // A real ring is idle until asked: keep it busy (from node, not the page) while the
    // lanes are checked, so every stage has batches to show.
    const load = stub ? null : backgroundLoad(base, 4, 12000);
    const resp = await page.goto(base + '/', { waitUntil: 'load', timeout: STEP_MS });
    check(resp && resp.status() === 200, 'GET / answers 200');
    const csp = (resp && resp.headers()['content-security-policy']) || '';
    check(/script-src 'self'/.test(csp) && !/unsafe/.test(csp), 'GET / sends a strict Content-Security-Policy: ' + csp);
    if (process.env.KVR_API_KEY) {
      // The page came without the key; the telemetry's 401 makes it ask for one.
      await page.waitForSelector('#key-dialog[open]', { timeout: STEP_MS });
      check(true, 'the page asks for the API key');
      await page.fill('#key-input', process.env.KVR_API_KEY);
      await page.click('#key-form button[value=ok]');
      // Chromium logs every 4xx response as "Failed to load resource": expected here only.
      const e401 = log.errors.filter((e) => /status of 401/.test(e));
      log.errors.splice(0, log.errors.length, ...log.errors.filter((e) => !/status of 401/.test(e)));
      check(e401.length > 0, 'the key was asked for after a 401 (' + e401.length + ')');
    }
    await page.waitForSelector('#ring-state.up', { timeout: STEP_MS });
    check(true, 'the ring shows as up');
    await page.waitForFunction(() => document.querySelectorAll('#lanes rect.b-decode, #lanes rect.b-prefill').length > 20,
      null, { timeout: STEP_MS });
    const lanes = await page.evaluate(() => {
      const stages = document.querySelectorAll('#stages tbody tr').length;
      const laneBgs = document.querySelectorAll('#lanes .lane-bg').length;
      // Shapes per lane: which lane each batch shape's y falls in.
      const ys = [...document.querySelectorAll('#lanes .lane-bg')].map((r) => [+r.getAttribute('y'), +r.getAttribute('height')]);
      const per = ys.map(() => 0);
      for (const r of document.querySelectorAll('#lanes rect.b-decode, #lanes rect.b-prefill')) {
        const y = +r.getAttribute('y');
        ys.forEach(([y0, h], i) => { if (y >= y0 && y < y0 + h) per[i]++; });
      }
      return { stages, laneBgs, per, shares: [...document.querySelectorAll('#stages .share-text')].map((e) => e.textContent) };
    });
    check(lanes.stages > 0 && lanes.stages === lanes.laneBgs, 'one lane and one table row per stage (' + lanes.stages + ')');
    check(lanes.per.every((n) => n > 0), 'every lane shows batches: ' + lanes.per.join(', '));
    check(lanes.shares.every((t) => /\d+% \/ \d+% \/ \d+%/.test(t)), 'every stage shows held / starved / blocked shares');
    if (!stub) {
      // The same numbers as /metrics, within rounding: both are the scheduler's last ~2 s
      // window, so compare a page that did not change while /metrics was read.
      let seen = '';
      for (let i = 0; i < 20; i++) {
        const before = await pageShares(page);
        const m = await metricShares(base);
        const after = await pageShares(page);
        seen = JSON.stringify(before) + ' vs ' + JSON.stringify(m.map((s) => s.map((v) => +v.toFixed(1))));
        const same = JSON.stringify(before) === JSON.stringify(after) && before.length === m.length &&
          before.every((s, j) => s.length === 3 && s.every((v, k) => Math.abs(v - m[j][k]) <= 1));
        if (same) { seen = 'ok ' + seen; break; }
        await page.waitForTimeout(150);
      }
      check(seen.startsWith('ok '), 'every stage\'s shares match /metrics within rounding: ' + seen.replace(/^ok /, ''));
    }
    await page.waitForTimeout(800);
    await page.screenshot({ path: path.join(shots, stub ? 'console-idle.png' : 'console-load.png'), fullPage: true });
    if (load) await load;
    if (!stub) { // a real ring, idle again once the load's window has passed
      await page.waitForTimeout(2500);
      await page.screenshot({ path: path.join(shots, 'console-idle.png'), fullPage: true });
    }

    // ---- chat ---------------------------------------------------------------------------
    await page.click('#settings summary'); // opens the settings, as a user would
    await page.fill('#max-tokens', '12');
    await page.fill('#seed', '7');
    await page.fill('#prompt', 'Hello ring');
    await page.press('#prompt', 'Enter'); // the keyboard path
    await page.waitForFunction(() => {
      const s = document.querySelector('.msg.assistant .stats');
      return s && /finish (stop|length)/.test(s.textContent);
    }, null, { timeout: STEP_MS * 4 });
    const answer = await page.evaluate(() => {
      const m = [...document.querySelectorAll('.msg.assistant')].pop();
      return { text: m.querySelector('.body').textContent, stats: m.querySelector('.stats').textContent };
    });
    check(answer.text.length > 0, 'a chat answer streamed in: ' + JSON.stringify(answer.text.slice(0, 60)));
    check(/first token \d/.test(answer.stats) && /total \d/.test(answer.stats) && /tokens/.test(answer.stats),
      'the answer shows its first-token and total time, tokens: ' + answer.stats);
    if (stub) check(/est\. 120 ms/.test(answer.stats) && /request \d+/.test(answer.stats), 'the answer shows the server\'s estimate and request id');
    else console.log('info the server ' + (/est\. \d/.test(answer.stats) ? 'sends' : 'does not send') + ' admission\'s estimate');
    await page.screenshot({ path: path.join(shots, 'console-chat.png'), fullPage: true });

    // ---- a refusal (stub only: a real ring refuses when it is busy, not on demand) -----------
    if (stub) {
      const before = log.errors.length;
      await page.fill('#prompt', 'please refuse this');
      await page.click('#send');
      await page.waitForSelector('.msg.assistant.error .stats.refused', { timeout: STEP_MS });
      const refused = await page.textContent('.msg.assistant.error');
      check(/over_budget/.test(refused) && /estimated 812 ms/.test(refused) && /retry after 1 s/.test(refused),
        'a refusal shows its status, code and reason: ' + refused);
      // Chromium logs every 4xx response as "Failed to load resource": expected here only.
      const added = log.errors.splice(before);
      check(added.every((e) => /status of 429/.test(e)), 'the refusal logged nothing but its 429');
    }

    // ---- under load, then a lost stage ----------------------------------------------------
    if (stub) {
      const posts = [0, 1, 2].map((i) => page.evaluate((k) => fetch('/v1/chat/completions', {
        method: 'POST', headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify({ messages: [{ role: 'user', content: 'load ' + k }], max_tokens: 40, stream: true }) })
        .then((r) => r.text()), i));
      await page.waitForTimeout(700);
      await page.screenshot({ path: path.join(shots, 'console-load.png'), fullPage: true });
      await Promise.all(posts);
    }
    let killed = false;
    if (stub) {
      await page.evaluate(() => fetch('/stub/kill?stage=1&ms=2500', { method: 'POST' }));
      killed = true;
    } else if (process.env.KVR_CONSOLE_KILL) {
      // Under load, so the loss holds requests and the recovery re-prefills them.
      const load = backgroundLoad(base, 6, 5000);
      await page.waitForTimeout(1500);
      execSync(process.env.KVR_CONSOLE_KILL, { stdio: 'inherit' });
      killed = true;
      await page.waitForSelector('#events li.lost', { timeout: STEP_MS });
      await page.screenshot({ path: path.join(shots, 'console-recovery.png'), fullPage: true });
      await load;
    }
    if (killed) {
      // A real ring may be whole again before the next snapshot: only the stub's stays
      // down long enough to see the lane and the pill red.
      // The pill and the stage table are redrawn on different frames: wait for both.
      if (stub) await page.waitForSelector('#ring-state.down', { timeout: STEP_MS });
      if (stub) await page.waitForSelector('#stages tbody tr.down', { timeout: STEP_MS }).catch(() => {});
      await page.waitForSelector('#events li.lost', { timeout: STEP_MS });
      const lost = await page.evaluate(() => ({
        rowDown: document.querySelectorAll('#stages tbody tr.down').length,
        event: document.querySelector('#events li.lost').textContent }));
      check((!stub || lost.rowDown >= 1) && /requests held/.test(lost.event), 'a lost stage shows as lost with its held requests: ' + lost.event);
      if (stub) await page.screenshot({ path: path.join(shots, 'console-recovery.png'), fullPage: true });
      await page.waitForSelector('#events li.recovered', { timeout: STEP_MS * 4 });
      await page.waitForSelector('#ring-state.up', { timeout: STEP_MS * 4 });
      const rec = await page.textContent('#events li.recovered');
      check(/recovered after/.test(rec), 'then the ring shows as recovered: ' + rec);
    }

    // ---- dark, and a phone ------------------------------------------------------------------
    await page.emulateMedia({ colorScheme: 'dark' });
    await page.waitForTimeout(300);
    const bg = await page.evaluate(() => getComputedStyle(document.body).backgroundColor);
    check(bg !== 'rgb(247, 247, 248)', 'dark mode changes the background (' + bg + ')');
    await page.screenshot({ path: path.join(shots, 'console-dark.png'), fullPage: true });
    await context.close();

    const phone = await openPage(browser, base, { viewport: { width: 390, height: 844 }, deviceScaleFactor: 2,
      isMobile: true, hasTouch: true }, log);
    await phone.page.goto(base + '/', { waitUntil: 'load', timeout: STEP_MS });
    await phone.page.waitForSelector('#ring-state.up', { timeout: STEP_MS });
    await phone.page.waitForTimeout(800);
    const overflow = await phone.page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    check(overflow <= 1, 'nothing is wider than a phone screen (overflow ' + overflow + ' px)');
    await phone.page.screenshot({ path: path.join(shots, 'console-phone.png'), fullPage: true });
    await phone.context.close();

    // ---- frame rate with 8 stages at 100 batches/s (stub) ----------------------------------
    if (stub) {
      const stub8 = await startStub({ stages: 8, bps: 100 });
      const log8 = { requests: [], external: [], errors: [] };
      const big = await openPage(browser, stub8.url, { viewport: { width: 1400, height: 900 } }, log8);
      await big.page.goto(stub8.url + '/', { waitUntil: 'load', timeout: STEP_MS });
      await big.page.waitForSelector('#ring-state.up', { timeout: STEP_MS });
      await big.page.waitForTimeout(1500);
      const fps = await big.page.evaluate(() => new Promise((resolve) => {
        let n = 0; const t0 = performance.now();
        const f = () => { n++; if (performance.now() - t0 < 3000) requestAnimationFrame(f); else resolve(n / ((performance.now() - t0) / 1000)); };
        requestAnimationFrame(f);
      }));
      const shapes = await big.page.evaluate(() => document.querySelectorAll('#lanes rect').length);
      check(fps >= MIN_FPS, '8 stages at 100 batches/s: ' + fps.toFixed(1) + ' frames/s (>= ' + MIN_FPS + '), ' + shapes + ' shapes');
      await big.page.screenshot({ path: path.join(shots, 'console-8stages.png'), fullPage: true });
      await big.context.close();
      stub8.close();
      log.errors.push(...log8.errors);
      log.external.push(...log8.external);
      log.requests.push(...log8.requests);
    }
  } catch (e) {
    check(false, 'the run finished: ' + (e && e.message ? e.message.split('\n')[0] : e));
  } finally {
    await browser.close();
    if (stub) stub.close();
  }
  check(log.external.length === 0, 'no request left 127.0.0.1 (' + log.requests.length + ' requests' +
    (log.external.length ? '; external: ' + log.external.join(', ') : '') + ')');
  check(log.errors.length === 0, 'no console error' + (log.errors.length ? ': ' + log.errors.join(' | ') : ''));
  console.log('screenshots in ' + shots);
  if (failures.length) {
    console.log(failures.length + ' check(s) failed');
    process.exit(1);
  }
  console.log('all checks passed');
}

main();
