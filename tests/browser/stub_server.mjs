// stub_server.mjs - a stand-in for the bridge, to test the page's own logic on cases a real
// ring gives only by chance (8 stages at 100 batches/s, a refusal on demand, a long outage):
// it serves web/console/ with the Content-Security-Policy of src/bridge/console.c, a fake
// GET /v1/telemetry (docs/API.md's format, a made-up ring of STAGES stages running
// BATCHES_PER_S micro-batches) and a fake streamed /v1/chat/completions. Listens on
// 127.0.0.1 only.
//
//   node stub_server.mjs [--port 8090] [--stages 4] [--bps 100] [--api-key KEY]
//
// Test hooks: POST /stub/kill?stage=N&ms=2000 loses stage N for that long (LOST, then
// RECOVERED events); a chat message containing "refuse" is refused (429 over_budget).
import http from 'node:http';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, '../..');
const webDir = path.join(root, 'web/console');

// The CSP string, read from the C source so the stub cannot drift from the server.
export function readCsp() {
  const c = fs.readFileSync(path.join(root, 'src/bridge/console.c'), 'utf8');
  const m = c.match(/kvr_console_csp\[\]\s*=\s*((?:\s*"(?:[^"\\]|\\.)*")+)\s*;/);
  if (!m) throw new Error('cannot find kvr_console_csp in src/bridge/console.c');
  return [...m[1].matchAll(/"((?:[^"\\]|\\.)*)"/g)].map((x) => x[1]).join('');
}

const TYPES = { '.html': 'text/html; charset=utf-8', '.js': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8', '.svg': 'image/svg+xml', '.json': 'application/json' };

export function startStub({ port = 0, stages = 4, bps = 100, apiKey = '' } = {}) {
  const csp = readCsp();
  const t0 = process.hrtime.bigint();
  const nowMs = () => Number(process.hrtime.bigint() - t0) / 1e6 + 1000;
  const ring = {
    stages: Array.from({ length: stages }, (_, i) => ({
      index: i, addr: '127.0.0.1:' + (7001 + i), layers: [i * 4, i * 4 + 3], threads: 2,
      state: 'up', since_ms: nowMs(), error: '' })),
    agents: stages > 2 ? [{ index: 0, addr: '127.0.0.1:7100', threads: 2,
      holds: [{ layers: [5, 6], experts: [0, 3] }], stages: [1] }] : [],
    downUntil: 0, downStage: -1,
  };
  const sched = { batches: 0, generated: 0, prompt: 0, admitted: 0,
    refused: { first_token_budget: 0, total_budget: 0, kv_full: 0, queue_full: 0, too_long: 0,
               ring_down: 0, internal: 0 } };
  const traces = [];  // the last few seconds of fake batches
  const events = [];  // ring events, each with a serial
  let nextBatch = 1, nextEvent = 1, activeChats = 0;
  const running = new Map(); // request id -> tokens left to prefill (> 0) or decode (0)
  let nextReq = 1;

  // Make the batches of the last tick: each carries the running requests (decode rows) and
  // the prompts still prefilling, plus background decode rows so lanes are never empty.
  function tick() {
    const t = nowMs();
    const down = t < ring.downUntil;
    for (const st of ring.stages) {
      const s = down && st.index === ring.downStage ? 'down' : down ? 'unknown' : 'up';
      if (st.state !== s) { st.state = s; st.since_ms = t; st.error = s === 'down' ? 'link lost (stub kill)' : ''; }
    }
    if (!down && ring.downStage >= 0) {
      events.push({ serial: nextEvent++, t_ms: t, type: 'recovered', stage: null, held: 2,
        outage_ms: t - ring.lostAt, why: '' });
      ring.downStage = -1;
    }
    if (down) return;
    const perTick = bps / 20;
    ring.carry = (ring.carry || 0) + perTick;
    const nNow = Math.floor(ring.carry);
    for (let k = 0; k < nNow; k++) {
      ring.carry -= 1;
      const id = nextBatch++;
      const seqs = [];
      let pre = 0, dec = 0;
      for (const [req, left] of running) {
        if (left > 0) {
          const n = Math.min(left, 32);
          running.set(req, left - n);
          seqs.push({ seq: req % 8, req, kind: 'prefill', rows: n, ...(left - n === 0 ? { last: true } : {}) });
          pre += n;
        } else {
          seqs.push({ seq: req % 8, req, kind: 'decode', rows: 1 });
          dec += 1;
        }
      }
      const bg = 2 + (id % 5);
      for (let k = 0; k < bg; k++) seqs.push({ seq: 8 + k, req: 1000 + k, kind: 'decode', rows: 1 });
      dec += bg;
      if (id % 17 === 0) { seqs.push({ seq: 20, req: 2000 + id, kind: 'prefill', rows: 48 }); pre += 48; }
      const held = ring.stages.map((st) => 2 + 0.05 * pre + 0.2 * dec + (st.index === 1 ? 1.5 : 0));
      const sent = t - 100 + k * (50 / nNow);
      let cur = sent + 0.3;
      const st = held.map((h, i) => {
        const blocked = i === 0 ? 0.8 : 0.1;
        const row = [h, 1.2, blocked];
        cur += h + blocked + 0.3;
        return row;
      });
      traces.push({ id, sent_ms: sent, returned_ms: cur, ctrl: id % 9 === 0 ? 3 : 0,
        prefill_rows: pre, decode_rows: dec, seqs, seqs_more: 0, stages: st,
        agents: ring.agents.length ? [{ agent: 0, held_ms: 0.4, starved_ms: 0.1, blocked_ms: 0, pairs: 12 }] : [] });
      sched.batches++;
      sched.prompt += pre;
      sched.generated += dec;
    }
    while (traces.length > 2000) traces.shift();
  }
  const ticker = setInterval(tick, 50);

  function snapshot(cursor, intervalMs) {
    const t = nowMs();
    const fresh = traces.filter((b) => b.id > cursor.batch);
    const batches = fresh.slice(-64);
    if (fresh.length) cursor.batch = fresh[fresh.length - 1].id;
    const evs = events.filter((e) => e.serial > cursor.event);
    if (evs.length) cursor.event = evs[evs.length - 1].serial;
    const up = t >= ring.downUntil;
    const tps = up ? bps * 4 : 0;
    return {
      v: 1, t_ms: t, interval_ms: intervalMs,
      ring: { up, epoch: 0, row_width: 256, microbatches: ring.stages.length, max_seqs: 32, n_ctx: 2048,
        kv_block_tokens: 16, kv_blocks: 512,
        stages: ring.stages.map((s) => ({ ...s, held: up ? 0.55 + 0.05 * s.index : 0,
          starved: up ? 0.35 : 1, blocked: up ? 0.1 - 0.01 * s.index : 0,
          held_ms_total: sched.batches * 3, starved_ms_total: sched.batches, blocked_ms_total: sched.batches / 5,
          kv_blocks: 40 + running.size * 4, agents: ring.agents.filter((a) => a.stages.includes(s.index)).map((a) => a.index) })),
        agents: ring.agents.map((a) => ({ ...a, held_ms_total: 1, starved_ms_total: 0, blocked_ms_total: 0, pairs: 12 })) },
      sched: { running: running.size + 4, waiting: 0, inflight: up ? ring.stages.length : 0,
        batches: sched.batches, prompt_tokens: sched.prompt, generated_tokens: sched.generated,
        tokens_per_s: tps + 10 * Math.sin(t / 700), batch_ms: 14.2,
        kv_blocks: { used: 40 + running.size * 4, cached: 24, total: 512 },
        prefix_cache: { queries: 4000, hits: 1800, evicted: 12 }, admitted: sched.admitted,
        refused: sched.refused },
      batches, batches_missed: fresh.length - batches.length, events: evs.map(({ serial, ...e }) => e),
      events_missed: 0,
    };
  }

  function json(res, status, obj, headers = {}) {
    res.writeHead(status, { 'Content-Type': 'application/json', ...headers });
    res.end(JSON.stringify(obj));
  }

  function error(res, status, type, code, message, headers) {
    json(res, status, { error: { message, type, param: null, code } }, headers);
  }

  async function chatCompletion(req, res) {
    let body = '';
    for await (const chunk of req) body += chunk;
    let j;
    try { j = JSON.parse(body); } catch (e) {
      return error(res, 400, 'invalid_request_error', 'invalid_json', 'malformed JSON');
    }
    const last = (j.messages || []).filter((m) => m.role === 'user').pop();
    const text = last ? String(last.content) : '';
    if (/refuse/i.test(text)) {
      sched.refused.first_token_budget++;
      return error(res, 429, 'rate_limit_error', 'over_budget',
        'would miss first-token budget: estimated 812 ms > ' + ((j.latency_budget || {}).first_token_ms || 500) + ' ms',
        { 'Retry-After': '1' });
    }
    sched.admitted++;
    const id = nextReq++;
    const maxTokens = j.max_tokens || 16;
    const words = ('This is the stub answering "' + text.slice(0, 40) + '" with seed ' + (j.seed ?? 'none') +
      ' and temperature ' + (j.temperature ?? 1) + '. The ring is drawn on the right.').split(' ');
    const n = Math.min(words.length, maxTokens);
    running.set(id, 40);
    res.writeHead(200, { 'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache',
      'X-Kvasir-Estimate-First-Token-Ms': '120', 'X-Kvasir-Estimate-Total-Ms': String(120 + 30 * n),
      'X-Kvasir-Request-Id': String(id) });
    const meta = { id: 'chatcmpl-stub' + id, object: 'chat.completion.chunk', created: 1700000000, model: 'stub' };
    const send = (o) => res.write('data: ' + JSON.stringify(o) + '\n\n');
    send({ ...meta, choices: [{ index: 0, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null }] });
    let closed = false;
    res.on('close', () => { closed = true; running.delete(id); });
    await new Promise((r) => setTimeout(r, 100));
    for (let i = 0; i < n && !closed; i++) {
      send({ ...meta, choices: [{ index: 0, delta: { content: (i ? ' ' : '') + words[i] }, logprobs: null, finish_reason: null }] });
      await new Promise((r) => setTimeout(r, 25));
    }
    if (closed) return;
    running.delete(id);
    send({ ...meta, choices: [{ index: 0, delta: {}, logprobs: null, finish_reason: n < words.length ? 'length' : 'stop' }] });
    if (j.stream_options && j.stream_options.include_usage)
      send({ ...meta, choices: [], usage: { prompt_tokens: 12, completion_tokens: n, total_tokens: 12 + n } });
    res.write('data: [DONE]\n\n');
    res.end();
  }

  const server = http.createServer(async (req, res) => {
    const url = new URL(req.url, 'http://127.0.0.1');
    const p = url.pathname;
    if (req.method === 'GET' && (p === '/' || /^\/[a-z0-9_.-]+\.(html|js|css|svg)$/.test(p))) {
      const file = path.join(webDir, p === '/' ? 'index.html' : p.slice(1));
      if (!file.startsWith(webDir) || !fs.existsSync(file)) return error(res, 404, 'invalid_request_error', 'not_found', 'not found');
      res.writeHead(200, { 'Content-Type': TYPES[path.extname(file)] || 'application/octet-stream',
        'Content-Security-Policy': csp, 'X-Content-Type-Options': 'nosniff', 'Cache-Control': 'no-cache' });
      return res.end(fs.readFileSync(file));
    }
    if (apiKey && req.headers.authorization !== 'Bearer ' + apiKey && p.startsWith('/v1/'))
      return error(res, 401, 'authentication_error', 'invalid_api_key', 'missing or wrong API key', { 'WWW-Authenticate': 'Bearer' });
    if (req.method === 'GET' && p === '/v1/models')
      return json(res, 200, { object: 'list', data: [{ id: 'stub-model', object: 'model', created: 0, owned_by: 'kvasir' }] });
    if (req.method === 'POST' && p === '/v1/chat/completions') return chatCompletion(req, res);
    if (req.method === 'GET' && p === '/v1/telemetry') {
      const interval = Math.min(5000, Math.max(100, Number(url.searchParams.get('interval_ms')) || 250));
      res.writeHead(200, { 'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache' });
      res.write('retry: 2000\n\n');
      const cursor = { batch: nextBatch - 1 - 2 * bps, event: 0 };
      const timer = setInterval(() => res.write('event: snapshot\ndata: ' + JSON.stringify(snapshot(cursor, interval)) + '\n\n'), interval);
      res.on('close', () => clearInterval(timer));
      return;
    }
    if (req.method === 'POST' && p === '/stub/kill') {
      const stage = Number(url.searchParams.get('stage') ?? 1), ms = Number(url.searchParams.get('ms') ?? 2000);
      const t = nowMs();
      ring.downStage = stage;
      ring.downUntil = t + ms;
      ring.lostAt = t;
      events.push({ serial: nextEvent++, t_ms: t, type: 'lost', stage, held: 2, why: 'stage ' + stage + ': link lost (stub kill)' });
      return json(res, 200, { ok: true });
    }
    error(res, 404, 'invalid_request_error', 'not_found', 'not found');
  });
  return new Promise((resolve) => {
    server.listen(port, '127.0.0.1', () => {
      const addr = server.address();
      resolve({ url: 'http://127.0.0.1:' + addr.port, close: () => { clearInterval(ticker); server.closeAllConnections?.(); server.close(); } });
    });
  });
}

if (process.argv[1] && fileURLToPath(import.meta.url) === path.resolve(process.argv[1])) {
  const arg = (name, def) => { const i = process.argv.indexOf('--' + name); return i > 0 ? process.argv[i + 1] : def; };
  startStub({ port: Number(arg('port', 8090)), stages: Number(arg('stages', 4)), bps: Number(arg('bps', 100)),
    apiKey: arg('api-key', '') }).then((s) => console.log('stub console server on ' + s.url));
}
