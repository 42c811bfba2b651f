// console.js - Kvasir's console: a chat with the model and the ring drawn live
// (docs/API.md). Plain JavaScript, no library, nothing fetched from anywhere but the
// server that served the page.
//
// Two halves share one helper, an SSE reader over fetch() (EventSource cannot send an
// Authorization header):
//   chat       POST /v1/chat/completions {stream: true}; times each answer and shows the
//              server's estimate beside it, or a refusal's reason.
//   telemetry  GET /v1/telemetry: one JSON snapshot per interval; snapshots only update
//              state, a requestAnimationFrame loop draws it with a bounded amount of DOM
//              and SVG work per frame, so 8 stages at 100 batches/s stay smooth.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const SVG_NS = 'http://www.w3.org/2000/svg';
  const KEY_STORE = 'kvasir.apiKey';

  // ---- the API key: asked once, kept for the tab only ---------------------------------------

  let apiKey = sessionStorage.getItem(KEY_STORE) || '';
  let keyWaiters = [];

  function authHeaders(extra) {
    const h = Object.assign({}, extra || {});
    if (apiKey) h.Authorization = 'Bearer ' + apiKey;
    return h;
  }

  // Resolves once the user has given a key (true) or cancelled (false). One dialog at a
  // time, however many requests were refused.
  function askKey() {
    return new Promise((resolve) => {
      keyWaiters.push(resolve);
      const dlg = $('key-dialog');
      if (!dlg.open) {
        $('key-input').value = '';
        dlg.showModal();
      }
    });
  }

  function initKeyDialog() {
    const dlg = $('key-dialog');
    dlg.addEventListener('close', () => {
      const ok = dlg.returnValue === 'ok' && $('key-input').value.trim() !== '';
      if (ok) {
        apiKey = $('key-input').value.trim();
        sessionStorage.setItem(KEY_STORE, apiKey);
      }
      const w = keyWaiters;
      keyWaiters = [];
      w.forEach((resolve) => resolve(ok));
    });
    $('key-button').addEventListener('click', () => askKey().then((ok) => { if (ok) telemetry.restart(); }));
  }

  // ---- an SSE reader over fetch --------------------------------------------------------------

  // Calls onEvent(data) for each event's data (its data: lines joined by "\n"), until the
  // stream ends or `signal` aborts. Returns when the body is finished.
  async function readSSE(response, onEvent, signal) {
    const reader = response.body.getReader();
    const dec = new TextDecoder();
    let buf = '';
    let data = [];
    for (;;) {
      if (signal && signal.aborted) { reader.cancel().catch(() => {}); return; }
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf('\n')) >= 0) {
        let line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        if (line.endsWith('\r')) line = line.slice(0, -1);
        if (line === '') {
          if (data.length) onEvent(data.join('\n'));
          data = [];
        } else if (line.startsWith('data:')) {
          data.push(line.slice(line[5] === ' ' ? 6 : 5));
        } // comments (":"), "event:", "id:" and "retry:" lines are not needed here
      }
    }
    if (data.length) onEvent(data.join('\n'));
  }

  async function errorOf(resp) {
    let body = null;
    try { body = await resp.json(); } catch (e) { /* not JSON */ }
    const err = (body && body.error) || {};
    return { status: resp.status, code: err.code || '', message: err.message || resp.statusText || 'error',
             retryAfter: resp.headers.get('Retry-After') };
  }

  // ---- chat -----------------------------------------------------------------------------------

  const chat = {
    history: [],      // {role, content} sent with every request
    controller: null, // AbortController of the answer streaming now
  };

  function addMessage(role, text) {
    const div = document.createElement('div');
    div.className = 'msg ' + role;
    const body = document.createElement('span');
    body.className = 'body';
    body.textContent = text;
    div.appendChild(body);
    $('messages').appendChild(div);
    $('messages').scrollTop = $('messages').scrollHeight;
    return div;
  }

  function num(id) {
    const v = $(id).value.trim();
    return v === '' ? null : Number(v);
  }

  function fmtMs(ms) {
    if (ms == null || !isFinite(ms)) return '–';
    return ms < 1000 ? Math.round(ms) + ' ms' : (ms / 1000).toFixed(2) + ' s';
  }

  function buildRequest() {
    const messages = [];
    const sys = $('system').value.trim();
    if (sys) messages.push({ role: 'system', content: sys });
    const req = { messages: messages.concat(chat.history), stream: true,
                  stream_options: { include_usage: true } };
    const t = num('temperature'); if (t != null) req.temperature = t;
    const mt = num('max-tokens'); if (mt != null) req.max_tokens = Math.round(mt);
    const seed = num('seed'); if (seed != null) req.seed = Math.round(seed);
    const first = num('first-token-ms'), total = num('total-ms');
    if (first != null || total != null) {
      req.latency_budget = {};
      if (first != null) req.latency_budget.first_token_ms = Math.round(first);
      if (total != null) req.latency_budget.total_ms = Math.round(total);
    }
    return req;
  }

  // What the server says it expects, if it says (docs/API.md, the console's "Chat"): headers on the
  // stream's response. Absent headers show as nothing.
  function estimateOf(resp) {
    const f = parseFloat(resp.headers.get('X-Kvasir-Estimate-First-Token-Ms'));
    const t = parseFloat(resp.headers.get('X-Kvasir-Estimate-Total-Ms'));
    const id = resp.headers.get('X-Kvasir-Request-Id');
    return { first: isFinite(f) ? f : null, total: isFinite(t) ? t : null, id: id || null };
  }

  function setStats(div, parts, refused) {
    let s = div.querySelector('.stats');
    if (!s) {
      s = document.createElement('span');
      div.appendChild(s);
    }
    s.className = 'stats' + (refused ? ' refused' : '');
    s.textContent = parts.filter(Boolean).join(' · ');
  }

  async function send(text) {
    chat.history.push({ role: 'user', content: text });
    addMessage('user', text);
    const div = addMessage('assistant', '');
    const body = div.querySelector('.body');
    const ctl = new AbortController();
    chat.controller = ctl;
    $('send').disabled = true;
    $('stop').disabled = false;
    const t0 = performance.now();
    let tFirst = null, nChunks = 0, finish = null, usage = null, answer = '', streamErr = null;
    let est = { first: null, total: null, id: null };
    try {
      let resp;
      for (;;) {
        resp = await fetch('/v1/chat/completions', {
          method: 'POST', signal: ctl.signal,
          headers: authHeaders({ 'Content-Type': 'application/json' }),
          body: JSON.stringify(buildRequest()) });
        if (resp.status === 401 && await askKey()) continue;
        break;
      }
      if (!resp.ok) {
        const e = await errorOf(resp);
        div.classList.add('error');
        body.textContent = e.message;
        setStats(div, ['refused: ' + resp.status + (e.code ? ' ' + e.code : ''),
                       e.retryAfter ? 'retry after ' + e.retryAfter + ' s' : ''], true);
        chat.history.pop();
        return;
      }
      est = estimateOf(resp);
      await readSSE(resp, (data) => {
        if (data === '[DONE]') return;
        let j;
        try { j = JSON.parse(data); } catch (e) { return; }
        if (j.error) { streamErr = j.error; return; }
        if (j.usage) usage = j.usage;
        const c = j.choices && j.choices[0];
        if (!c) return;
        const piece = c.delta && c.delta.content;
        if (piece) {
          if (tFirst == null) tFirst = performance.now();
          nChunks++;
          answer += piece;
          body.textContent = answer;
          const m = $('messages');
          if (m.scrollHeight - m.scrollTop - m.clientHeight < 80) m.scrollTop = m.scrollHeight;
        }
        if (c.finish_reason) finish = c.finish_reason;
      }, ctl.signal);
    } catch (e) {
      if (e.name !== 'AbortError') streamErr = { message: String(e.message || e) };
      else finish = finish || 'stopped';
    } finally {
      chat.controller = null;
      $('send').disabled = false;
      $('stop').disabled = true;
    }
    const tEnd = performance.now();
    if (answer) chat.history.push({ role: 'assistant', content: answer });
    else if (!streamErr) chat.history.pop();
    const nTok = usage ? usage.completion_tokens : nChunks;
    const genMs = tFirst != null ? tEnd - tFirst : null;
    const tps = genMs > 0 && nTok > 1 ? ((nTok - 1) / (genMs / 1000)).toFixed(1) + ' tok/s' : '';
    const parts = [
      'first token ' + fmtMs(tFirst != null ? tFirst - t0 : null) +
        (est.first != null ? ' (est. ' + fmtMs(est.first) + ')' : ''),
      'total ' + fmtMs(tEnd - t0) + (est.total != null ? ' (est. ' + fmtMs(est.total) + ')' : ''),
      nTok + ' tokens', tps, 'finish ' + (finish || (streamErr ? 'error' : '–')),
      est.id ? 'request ' + est.id : '',
    ];
    if (streamErr) {
      div.classList.add('error');
      parts.push('error: ' + (streamErr.code ? streamErr.code + ': ' : '') + streamErr.message);
    }
    setStats(div, parts, !!streamErr);
  }

  function initChat() {
    const form = $('chat-form');
    form.addEventListener('submit', (ev) => {
      ev.preventDefault();
      const text = $('prompt').value.trim();
      if (!text || chat.controller) return;
      $('prompt').value = '';
      send(text);
    });
    $('prompt').addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        form.requestSubmit();
      }
    });
    $('stop').addEventListener('click', () => { if (chat.controller) chat.controller.abort(); });
    $('clear').addEventListener('click', () => {
      if (chat.controller) chat.controller.abort();
      chat.history = [];
      $('messages').textContent = '';
      $('prompt').focus();
    });
  }

  // ---- telemetry: state ---------------------------------------------------------------------

  const WINDOW_MS = 2500;        // the lanes show this much time
  const MAX_BATCHES = 600;       // batches kept for drawing (older ones fall off)
  const MAX_NEW_PER_FRAME = 120; // batch shapes created per frame; the rest wait a frame
  const SPARK_POINTS = 120;

  const tel = {
    snap: null,          // the latest snapshot
    batches: [],         // traces waiting to be drawn, then drawn, oldest first
    pending: [],         // traces received but not yet turned into shapes
    offset: null,        // server ms - performance.now(), smallest seen (least delayed)
    interval: 250,
    spark: [],           // tokens/s, one per snapshot
    events: [],
    dirtyTables: false,
    layoutKey: '',
  };

  function onSnapshot(s) {
    const now = performance.now();
    const off = s.t_ms - now;
    // The snapshot left the server at t_ms and arrived some ms later: the smallest offset
    // seen lately is the least delayed, so it maps server time to ours best.
    tel.offset = tel.offset == null ? off : Math.min(off, tel.offset + 0.05 * tel.interval);
    tel.interval = s.interval_ms || tel.interval;
    tel.snap = s;
    for (const b of s.batches || []) tel.pending.push(b);
    if (tel.pending.length > MAX_BATCHES) tel.pending.splice(0, tel.pending.length - MAX_BATCHES);
    tel.spark.push(s.sched ? s.sched.tokens_per_s : 0);
    if (tel.spark.length > SPARK_POINTS) tel.spark.shift();
    for (const e of s.events || []) {
      tel.events.push(e);
      if (tel.events.length > 50) tel.events.shift();
    }
    tel.dirtyTables = true;
  }

  const telemetry = {
    controller: null,
    failures: 0,
    start() {
      const ctl = new AbortController();
      this.controller = ctl;
      const run = async () => {
        while (!ctl.signal.aborted) {
          try {
            const resp = await fetch('/v1/telemetry?interval_ms=250',
              { headers: authHeaders({ Accept: 'text/event-stream' }), signal: ctl.signal, cache: 'no-store' });
            if (resp.status === 401) {
              setRingState('API key needed', 'down');
              if (!(await askKey())) return;
              continue;
            }
            if (!resp.ok) throw new Error('telemetry: HTTP ' + resp.status);
            this.failures = 0;
            await readSSE(resp, (data) => {
              try { onSnapshot(JSON.parse(data)); } catch (e) { /* a bad snapshot is skipped */ }
            }, ctl.signal);
            throw new Error('telemetry stream ended');
          } catch (e) {
            if (ctl.signal.aborted) return;
            this.failures++;
            setRingState('telemetry lost, reconnecting…', 'down');
            // Back off 0.5 s, 1 s, 2 s ... up to 10 s; a page left open reconnects forever.
            const wait = Math.min(10000, 500 * 2 ** Math.min(this.failures - 1, 5));
            await new Promise((r) => setTimeout(r, wait));
          }
        }
      };
      run();
    },
    restart() {
      if (this.controller) this.controller.abort();
      this.start();
    },
  };

  function setRingState(text, cls) {
    const el = $('ring-state');
    if (el.textContent !== text) el.textContent = text;
    el.className = 'pill ' + (cls || '');
  }

  // ---- telemetry: the lanes (SVG) -------------------------------------------------------------

  // Geometry, in SVG user units = CSS pixels of the element (re-read on resize).
  const G = { w: 600, h: 240, labelW: 150, laneH: 26, gap: 4, top: 4 };
  let svg, gBg, gTrack, gLabels, nowLine;
  let baseMs = null; // server ms at x = 0 of gTrack (keeps coordinates small)
  const SCALE_PX_PER_MS = () => (G.w - G.labelW) / WINDOW_MS;
  const pool = []; // recycled <rect>s

  function el(name, attrs, parent) {
    const e = document.createElementNS(SVG_NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  function rect(cls, x, y, w, h, title) {
    const r = pool.pop() || document.createElementNS(SVG_NS, 'rect');
    r.setAttribute('class', cls);
    r.setAttribute('x', x.toFixed(1));
    r.setAttribute('y', y.toFixed(1));
    r.setAttribute('width', Math.max(0.8, w).toFixed(1));
    r.setAttribute('height', Math.max(0.5, h).toFixed(1));
    if (title) r.dataset.title = title;
    return r;
  }

  function initLanes() {
    svg = $('lanes');
    gBg = el('g', {}, svg);
    gTrack = el('g', {}, svg);
    gLabels = el('g', {}, svg);
    nowLine = el('line', { class: 'now-line' }, svg);
    const measure = () => {
      const r = svg.getBoundingClientRect();
      G.w = Math.max(320, Math.round(r.width));
      G.labelW = G.w < 500 ? 96 : 160;
      tel.layoutKey = ''; // redraw the lane backgrounds and labels
      clearTrack();
    };
    new ResizeObserver(measure).observe($('lanes-wrap'));
    measure();
    // Hovering a batch names its requests (a title per rect would cost DOM at 100/s).
    svg.addEventListener('mousemove', (ev) => {
      const t = ev.target && ev.target.dataset ? ev.target.dataset.title : null;
      if (t) setText('lanes-hover', t);
    });
  }

  function clearTrack() {
    while (gTrack.firstChild) pool.push(gTrack.removeChild(gTrack.firstChild));
    for (const b of tel.batches) b.shapes = null;
    tel.pending = tel.batches.concat(tel.pending);
    tel.batches = [];
  }

  function laneY(i) { return G.top + i * (G.laneH + G.gap); }

  // Lane backgrounds and labels change only with the plan or a stage's state.
  function layoutLanes(s) {
    const stages = s.ring.stages;
    const key = G.w + '|' + stages.map((st) => st.addr + st.state + st.layers + st.agents).join(',');
    if (key === tel.layoutKey) return;
    tel.layoutKey = key;
    const n = Math.max(1, stages.length);
    G.laneH = n > 12 ? 16 : 28; // below 24 units the address line is left out
    G.h = G.top * 2 + n * (G.laneH + G.gap);
    svg.setAttribute('viewBox', '0 0 ' + G.w + ' ' + G.h);
    svg.style.height = G.h + 'px';
    gBg.textContent = '';
    gLabels.textContent = '';
    stages.forEach((st, i) => {
      const y = laneY(i);
      const down = st.state === 'down';
      el('rect', { class: 'lane-bg' + (down ? ' down' : ''), x: 0, y, width: G.w, height: G.laneH }, gBg);
      // The label column covers the track as batches scroll under it.
      el('rect', { class: 'label-bg', x: 0, y, width: G.labelW, height: G.laneH }, gLabels);
      const t = el('text', { class: 'lane-label', x: 4, y: y + 11 }, gLabels);
      t.textContent = 'stage ' + st.index + ' · L' + st.layers[0] + '–' + st.layers[1];
      if (st.agents && st.agents.length) {
        const a = el('tspan', { class: 'agent-label' }, t);
        a.textContent = ' +' + st.agents.length + ' agent' + (st.agents.length > 1 ? 's' : '');
      }
      if (G.laneH >= 24) {
        const sub = el('text', { class: 'lane-sub', x: 4, y: y + G.laneH - 4 }, gLabels);
        sub.textContent = st.addr + ' · ' + st.threads + ' thr';
      }
      if (down) {
        const d = el('text', { class: 'down-text', x: G.labelW + 8, y: y + G.laneH / 2 + 4 }, gLabels);
        d.textContent = 'LOST' + (st.error ? ': ' + st.error.slice(0, 60) : '');
      }
    });
    nowLine.setAttribute('x1', G.w - 2);
    nowLine.setAttribute('x2', G.w - 2);
    nowLine.setAttribute('y1', 0);
    nowLine.setAttribute('y2', G.h);
  }

  // Where batch b was in each stage: stage i got it after the hops and the stages before it
  // (held + blocked each); the round trip's remainder is spread over the n + 1 hops.
  function shapesOf(b) {
    const st = b.stages || [];
    const trip = b.returned_ms - b.sent_ms;
    let busy = 0;
    for (const t of st) busy += t[0] + t[2];
    const hop = Math.max(0, (trip - busy) / (st.length + 1));
    const scale = SCALE_PX_PER_MS();
    const rows = b.prefill_rows + b.decode_rows;
    const preFrac = rows ? b.prefill_rows / rows : 0;
    const title = 'batch ' + b.id + ': ' + b.prefill_rows + ' prefill + ' + b.decode_rows + ' decode rows; ' +
      (b.seqs || []).map((q) => (q.req != null ? 'req ' + q.req : 'seq ' + q.seq) + ' ' + q.kind + ' ' + q.rows)
        .join(', ') + (b.seqs_more ? ', +' + b.seqs_more + ' more' : '');
    const shapes = [];
    let t = b.sent_ms + hop;
    st.forEach((tm, i) => {
      const x = (t - baseMs) * scale;
      const y = laneY(i) + 2, h = G.laneH - 4;
      const w = tm[0] * scale;
      if (preFrac > 0) shapes.push(rect('b-prefill', x, y, w, h * preFrac, title));
      if (preFrac < 1) shapes.push(rect('b-decode', x, y + h * preFrac, w, h * (1 - preFrac), title));
      if (tm[2] > 0) shapes.push(rect('b-blocked', x + w, y + h * 0.3, tm[2] * scale, h * 0.4, title));
      t += tm[0] + tm[2] + hop;
    });
    return shapes;
  }

  // What each stage holds at server time `t` (for the table's "now carrying").
  function carrying(t) {
    const out = [];
    for (let k = tel.batches.length - 1; k >= 0 && out.filter(Boolean).length < (tel.snap ? tel.snap.ring.stages.length : 0); k--) {
      const b = tel.batches[k];
      if (b.returned_ms < t - 1000) break;
      const st = b.stages || [];
      const busy = st.reduce((a, m) => a + m[0] + m[2], 0);
      const hop = Math.max(0, (b.returned_ms - b.sent_ms - busy) / (st.length + 1));
      let s0 = b.sent_ms + hop;
      st.forEach((m, i) => {
        if (!out[i] && t >= s0 && t <= s0 + m[0] + m[2]) out[i] = b;
        s0 += m[0] + m[2] + hop;
      });
    }
    return out;
  }

  let lastCarry = 0;

  function frame() {
    requestAnimationFrame(frame);
    const s = tel.snap;
    if (!s || !s.ring || tel.offset == null) return;
    layoutLanes(s);
    // Draw one interval (plus a margin) behind the server, so a batch reported in the next
    // snapshot has not yet reached the right edge when it arrives.
    const tNow = performance.now() + tel.offset - tel.interval * 1.5 - 50;
    if (baseMs == null) baseMs = tNow - WINDOW_MS;
    // Bounded work: at most MAX_NEW_PER_FRAME new shapes' worth of batches per frame.
    let made = 0;
    while (tel.pending.length && made < MAX_NEW_PER_FRAME) {
      const b = tel.pending.shift();
      b.shapes = shapesOf(b);
      for (const r of b.shapes) gTrack.appendChild(r);
      made += b.shapes.length;
      tel.batches.push(b);
    }
    // Batches that left the window go back to the pool.
    while (tel.batches.length && (tel.batches[0].returned_ms < tNow - WINDOW_MS - 200 || tel.batches.length > MAX_BATCHES)) {
      const b = tel.batches.shift();
      for (const r of b.shapes || []) { gTrack.removeChild(r); pool.push(r); }
    }
    // Scrolling is one transform: shapes keep their coordinates.
    const dx = G.w - (tNow - baseMs) * SCALE_PX_PER_MS();
    gTrack.setAttribute('transform', 'translate(' + dx.toFixed(1) + ' 0)');
    // Re-base now and then so coordinates stay small (and float-exact).
    if (tNow - baseMs > 600000) { baseMs = null; clearTrack(); }
    if (tel.dirtyTables) { tel.dirtyTables = false; renderTables(s); }
    const now = performance.now();
    if (now - lastCarry > 250) { lastCarry = now; renderCarrying(carrying(tNow)); }
  }

  // ---- telemetry: tables and cards (once per snapshot) ----------------------------------------

  const REFUSAL_LABELS = { first_token_budget: 'first-token budget', total_budget: 'total budget',
    kv_full: 'KV full', queue_full: 'queue full', too_long: 'too long', ring_down: 'ring down', internal: 'internal' };

  function pct(x) { return (100 * (x || 0)).toFixed(0) + '%'; }

  function setText(id, text) {
    const e = $(id);
    if (e.textContent !== String(text)) e.textContent = text;
  }

  const stageRows = [];

  function renderTables(s) {
    const ring = s.ring, sc = s.sched;
    const down = ring.stages.filter((st) => st.state === 'down').length;
    if (ring.up) setRingState('ring up · ' + ring.stages.length + ' stages', 'up');
    else setRingState(down ? 'ring down · ' + down + ' stage' + (down > 1 ? 's' : '') + ' lost' : 'ring down', 'down');
    setText('ring-summary', ring.stages.length + ' stages · ' + ring.agents.length + ' expert agent' + (ring.agents.length === 1 ? '' : 's') + ' · ' +
      ring.microbatches + ' micro-batches of ≤ ' + ring.row_width + ' rows · ' + ring.max_seqs +
      ' sequences · epoch ' + ring.epoch + (s.batches_missed ? ' · ' + s.batches_missed + ' batches not drawn' : ''));

    const tbody = $('stages').tBodies[0];
    while (stageRows.length > ring.stages.length) tbody.removeChild(stageRows.pop().tr);
    ring.stages.forEach((st, i) => {
      let row = stageRows[i];
      if (!row) {
        const tr = document.createElement('tr');
        const cells = [];
        for (let c = 0; c < 5; c++) cells.push(tr.appendChild(document.createElement('td')));
        const bar = document.createElement('div');
        bar.className = 'share';
        const parts = ['h', 's', 'b'].map((c) => { const sp = document.createElement('span'); sp.className = c; bar.appendChild(sp); return sp; });
        const txt = document.createElement('div');
        txt.className = 'share-text';
        cells[3].append(bar, txt);
        cells[4].className = 'carrying';
        row = { tr, cells, parts, txt };
        stageRows[i] = row;
        tbody.appendChild(tr);
      }
      row.tr.className = st.state === 'down' ? 'down' : '';
      const agents = st.agents.length ? ' + agent ' + st.agents.map((a) => ring.agents[a].addr).join(', ') : '';
      const vals = [st.index + ' · L' + st.layers[0] + '–' + st.layers[1] + ' · ' + st.threads + ' thr',
        st.addr + agents, st.state + (st.error ? ' (' + st.error + ')' : '')];
      vals.forEach((v, c) => { if (row.cells[c].textContent !== v) row.cells[c].textContent = v; });
      row.parts[0].style.width = pct(st.held);
      row.parts[1].style.width = pct(st.starved);
      row.parts[2].style.width = pct(st.blocked);
      row.txt.textContent = pct(st.held) + ' / ' + pct(st.starved) + ' / ' + pct(st.blocked) + ' · KV ' + st.kv_blocks + ' blocks';
    });

    setText('tps', (sc.tokens_per_s || 0).toFixed(1));
    setText('batch-ms', (sc.batch_ms || 0).toFixed(1));
    setText('running', sc.running);
    setText('waiting', sc.waiting);
    setText('inflight', sc.inflight);
    setText('admitted', sc.admitted);
    const rb = $('refusals').tBodies[0];
    const keys = Object.keys(sc.refused);
    if (rb.rows.length !== keys.length) {
      rb.textContent = '';
      keys.forEach((k) => { const tr = rb.insertRow(); tr.insertCell().textContent = REFUSAL_LABELS[k] || k; tr.insertCell(); });
    }
    keys.forEach((k, i) => { const c = rb.rows[i].cells[1]; const v = String(sc.refused[k]); if (c.textContent !== v) c.textContent = v; });

    const kv = sc.kv_blocks, total = kv.total || 1;
    const meter = $('kv-meter').children;
    meter[0].style.width = pct(kv.used / total);
    meter[1].style.width = pct(kv.cached / total);
    setText('kv-text', kv.used + ' used + ' + kv.cached + ' cached of ' + kv.total + ' blocks (' + pct(kv.used / total) + ' in use, the same on every stage)');
    const pc = sc.prefix_cache;
    setText('prefix-text', 'prefix cache: ' + pc.hits + ' of ' + pc.queries + ' prompt tokens hit (' +
      pct(pc.queries ? pc.hits / pc.queries : 0) + '), ' + pc.evicted + ' blocks evicted');

    const max = Math.max(1, ...tel.spark);
    const pts = tel.spark.map((v, i) => (i * 300 / (SPARK_POINTS - 1)).toFixed(1) + ',' + (58 - 56 * v / max).toFixed(1));
    $('spark-line').setAttribute('points', pts.join(' '));

    const ol = $('events');
    while (tel.events.length) {
      const e = tel.events.shift();
      const li = document.createElement('li');
      li.className = e.type;
      const when = new Date(Date.now() - (performance.now() + tel.offset - e.t_ms)).toLocaleTimeString();
      li.textContent = when + ' ' + (e.type === 'lost'
        ? 'ring lost' + (e.stage != null ? ' at stage ' + e.stage : '') + ', ' + e.held + ' requests held' + (e.why ? ': ' + e.why : '')
        : 'recovered after ' + fmtMs(e.outage_ms) + ', ' + e.held + ' held requests re-prefilled');
      ol.insertBefore(li, ol.firstChild);
      while (ol.children.length > 30) ol.removeChild(ol.lastChild);
    }
  }

  function renderCarrying(now) {
    stageRows.forEach((row, i) => {
      const b = now[i];
      const seqs = b ? b.seqs || [] : [];
      const text = b ? '#' + b.id + ' ' + b.prefill_rows + 'p+' + b.decode_rows + 'd: ' + seqs.slice(0, 4).map((q) =>
        (q.req != null ? 'r' + q.req : 's' + q.seq) + (q.kind === 'prefill' ? '·p' + q.rows : '·d')).join(' ') +
        (seqs.length > 4 || b.seqs_more ? ' …' : '') : 'idle';
      if (row.cells[4].textContent !== text) row.cells[4].textContent = text;
    });
  }

  // ---- start ----------------------------------------------------------------------------------

  function start() {
    initKeyDialog();
    initChat();
    initLanes();
    telemetry.start();
    requestAnimationFrame(frame);
    fetch('/v1/models', { headers: authHeaders() }).then((r) => (r.ok ? r.json() : null)).then((j) => {
      if (j && j.data && j.data[0]) setText('model-name', j.data[0].id);
    }).catch(() => {});
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
