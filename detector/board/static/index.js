// TensorBoard's "Traces" tab (detector/trace_view.py serves its data): the profiled steps of several runs
// as lanes on one time axis. Per run: the lab's regions, each thread's top-level operators, the CUDA calls
// (a tick per kernel launch, a red mark per host-device sync), and each GPU stream's kernels, copies and
// memsets that the step launched. Wheel: zoom around the pointer; drag: pan; double-click: the whole
// steps again. Hover: what an event is (for device work, the call that launched it). Click a region: its
// why numbers for every run shown, side by side. Events narrower than a pixel at the current zoom are
// drawn merged, so a step of 10^5 launches stays responsive. No network: everything comes from ./runs
// and ./step.

const LANE = 18; // px per lane
const HEADER = 22; // px of a run's title lane
const AXIS = 26; // px of the time axis
const LABELS = 230; // px of the lane labels column
const CATEGORIES = ['kernel', 'gpu_memcpy', 'gpu_memset'];
const LAUNCH = 1;
const SYNC = 2;
const COPY_EDGE = '#d62728'; // a copy's outline, whatever region launched it

const state = {
  listing: null,
  selected: new Map(), // run -> step number shown
  data: new Map(), // "run@step" -> step extract
  align: 'step',
  view: null, // [start, end] µs, relative to each run's alignment point
  lanes: [], // what draw() laid out: {run, label, y, h, kind, events, drawn}
  why: null, // the region whose why numbers are shown
};

export async function render() {
  const began = performance.now();
  document.head.insertAdjacentHTML('beforeend', `<style>${CSS}</style>`);
  document.body.innerHTML = HTML;
  try {
    state.listing = await getJson('./runs');
  } catch (err) {
    setStatus(`cannot list the profile runs: ${err}`);
    return;
  }
  const runs = state.listing.runs;
  if (!runs.length) {
    setStatus(`no profile runs under ${state.listing.logdir}: run \`make profile STRATEGY=padded\` first`);
    return;
  }
  const seen = new Set();
  for (const run of runs) {
    // by default the newest run of each strategy (the listing puts it first), train mode first, five at most
    const key = `${run.strategy}/${run.mode}`;
    if (!seen.has(key) && state.selected.size < 5 && run.mode === runs[0].mode) {
      seen.add(key);
      state.selected.set(run.run, run.representative);
    }
  }
  buildControls();
  wireCanvas();
  window.addEventListener('resize', () => draw());
  await refresh();
  document.body.dataset.readyMs = Math.round(performance.now() - began); // for the tests: first full picture
}

// ----------------------------------------------------------------------------- data

async function getJson(url) {
  const response = await fetch(url);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

async function refresh() {
  const wanted = [...state.selected].filter(([run, step]) => !state.data.has(`${run}@${step}`));
  if (wanted.length) setStatus(`loading ${wanted.length} step(s) …`);
  const failed = [];
  await Promise.all(
    wanted.map(async ([run, step]) => {
      try {
        const url = `./step?run=${encodeURIComponent(run)}&step=${step}`;
        state.data.set(`${run}@${step}`, prepare(await getJson(url)));
      } catch (err) {
        failed.push(`${run}: ${err.message}`);
        state.selected.delete(run);
      }
    }),
  );
  state.view = null; // the whole steps
  draw();
  if (failed.length) setStatus(`not shown: ${failed.join('; ')}`);
}

// Lanes of one step, each with its events sorted by start: [start, dur, colour, payload].
function prepare(step) {
  const colors = state.listing.colors;
  const name = (i) => step.names[i];
  const lanes = [];
  lanes.push({
    kind: 'regions',
    label: 'regions',
    events: step.regions.map(([region, start, dur]) => [start, dur, colors.regions[region] || '#999', {region}]),
  });
  step.threads.forEach((thread, t) => {
    lanes.push({
      kind: 'ops',
      label: t === 0 ? 'main thread: operators' : `thread ${thread.tid}: operators`,
      events: thread.ops.map(([start, dur, op]) => [start, dur, '#8da0cb', {op: name(op), thread: t}]),
    });
  });
  const calls = step.calls.filter(([, , , , , flags]) => flags);
  if (calls.length) lanes.push({
    kind: 'calls',
    label: 'launches ▮  syncs ▼',
    events: calls.map(([start, dur, thread, call, region, flags]) => [
      start,
      dur,
      flags & SYNC ? colors.sync : colors.launch,
      {callName: name(call), thread, region, sync: Boolean(flags & SYNC)},
    ]),
  });
  // GPU work in the colour of the region whose call launched it: the host runs steps ahead of the device
  const launchedBy = (call) => regionName(step, step.calls[call][4]);
  for (const stream of step.streams) {
    lanes.push({
      kind: 'gpu',
      label: `GPU stream ${stream.stream}`,
      events: stream.events.map(([start, dur, category, kernel, call]) => [
        start,
        dur,
        colors.regions[launchedBy(call)] || '#999',
        {kernel: name(kernel), category: CATEGORIES[category], call},
      ]),
    });
  }
  for (const lane of lanes) {
    lane.events.sort((a, b) => a[0] - b[0]);
    lane.longest = lane.events.reduce((m, [, d]) => Math.max(m, d), 0); // how far back a visible event can start
  }
  return {...step, lanes};
}

// ----------------------------------------------------------------------------- controls

function buildControls() {
  const list = document.getElementById('runs');
  for (const run of state.listing.runs) {
    const row = document.createElement('label');
    row.className = 'run';
    const box = document.createElement('input');
    box.type = 'checkbox';
    box.checked = state.selected.has(run.run);
    const steps = document.createElement('select');
    for (const n of run.steps) {
      const option = new Option(n === run.representative ? `step ${n} (median)` : `step ${n}`, n);
      steps.append(option);
    }
    steps.value = state.selected.get(run.run) ?? run.representative;
    const update = () => {
      if (box.checked) state.selected.set(run.run, Number(steps.value));
      else state.selected.delete(run.run);
      refresh();
    };
    box.onchange = update;
    steps.onchange = () => {
      box.checked = true;
      update();
    };
    const text = document.createElement('span');
    text.textContent = runLabel(run);
    text.title = run.run;
    row.append(box, text, steps);
    list.append(row);
  }
  for (const skipped of state.listing.skipped) {
    const row = document.createElement('div');
    row.className = 'skipped';
    row.textContent = `${skipped.run}: ${skipped.reason}`;
    list.append(row);
  }
  const align = document.getElementById('align');
  for (const region of Object.keys(state.listing.colors.regions)) {
    if (region !== 'step' && region !== 'other') align.append(new Option(`the start of ${region}`, region));
  }
  align.onchange = () => {
    state.align = align.value;
    state.view = null;
    draw();
  };
  document.getElementById('reset').onclick = () => {
    state.view = null;
    draw();
  };
}

// A run as its checkbox reads: strategy, mode, device and when it ran, which tells two runs of one strategy apart.
function runLabel(run) {
  const when = run.created ? run.created.slice(0, 16).replace('T', ' ') : run.run.split('/').pop();
  return `${run.strategy} · ${run.mode} · ${run.device} · ${when}`;
}

// The legend names what the runs shown draw: their regions (host spans and the GPU work they launched),
// the launches and syncs where there are any, and the copies' outline.
function drawLegend(entries) {
  const legend = document.getElementById('legend');
  legend.replaceChildren();
  const colors = state.listing.colors;
  const drawn = new Map();
  for (const {data} of entries) {
    for (const lane of data.lanes) {
      for (const event of lane.events) {
        const what = event[3];
        if (lane.kind === 'regions') drawn.set(what.region, event[2]);
        else if (lane.kind === 'gpu') {
          drawn.set(regionName(data, data.calls[what.call][4]), event[2]);
          if (what.category === 'gpu_memcpy') drawn.set('copy (outlined)', COPY_EDGE);
        } else if (lane.kind === 'calls') drawn.set(what.sync ? 'host-device sync' : 'kernel launch', what.sync ? colors.sync : colors.launch);
      }
    }
  }
  for (const [name, color] of drawn) {
    const chip = document.createElement('span');
    const swatch = document.createElement('i');
    swatch.style.background = color;
    chip.append(swatch, document.createTextNode(name));
    legend.append(chip);
  }
}

function setStatus(text) {
  document.getElementById('status').textContent = text;
}

// ----------------------------------------------------------------------------- drawing

function shown() {
  return [...state.selected]
    .map(([run, step]) => ({run, step, data: state.data.get(`${run}@${step}`)}))
    .filter((entry) => entry.data)
    .map((entry) => ({...entry, info: state.listing.runs.find((r) => r.run === entry.run)}));
}

// µs from the step's start where this run's time axis begins: the step itself, or a region's start.
function offset(data) {
  if (state.align === 'step') return 0;
  const region = data.regions.find(([name]) => name === state.align);
  return region ? region[1] : 0;
}

function fullView(entries) {
  let start = 0;
  let end = 1;
  for (const {data} of entries) {
    const o = offset(data);
    start = Math.min(start, -o);
    for (const lane of data.lanes) {
      for (const [s, d] of lane.events) end = Math.max(end, s + d - o);
    }
    end = Math.max(end, data.dur - o);
  }
  return [start, end];
}

function draw() {
  const began = performance.now();
  const entries = shown();
  const canvas = document.getElementById('canvas');
  const labels = document.getElementById('labels');
  labels.innerHTML = '';
  state.lanes = [];
  if (!entries.length) {
    setStatus('tick a run to see its step');
    canvas.height = 0;
    return;
  }
  if (!state.view) state.view = fullView(entries);
  drawLegend(entries);
  let y = AXIS;
  for (const {run, step, data, info} of entries) {
    state.lanes.push({run, kind: 'header', y, h: HEADER, label: `${info.strategy} · step ${step}`, events: []});
    addLabel(labels, `${info.strategy} · ${info.mode} · step ${step} · ${(data.dur / 1e3).toFixed(1)} ms`, y, HEADER, 'header');
    y += HEADER;
    for (const lane of data.lanes) {
      state.lanes.push({...lane, run, data, y, h: LANE, offset: offset(data)});
      addLabel(labels, lane.label, y, LANE, lane.kind);
      y += LANE;
    }
    y += 6;
  }
  const width = Math.max(200, document.getElementById('plot').clientWidth - LABELS - 8);
  const ratio = window.devicePixelRatio || 1;
  canvas.width = width * ratio;
  canvas.height = y * ratio;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${y}px`;
  labels.style.height = `${y}px`;
  const ctx = canvas.getContext('2d');
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, y);
  drawAxis(ctx, width);
  const drawnPerRun = {};
  for (const lane of state.lanes) {
    if (!lane.events.length) continue;
    lane.drawn = drawLane(ctx, lane, width);
    drawnPerRun[lane.run] = (drawnPerRun[lane.run] || 0) + lane.drawn.length;
  }
  canvas.dataset.drawn = JSON.stringify(drawnPerRun);
  const [a, b] = state.view;
  const where = state.align === 'step' ? "the step's start" : `the start of ${state.align}`;
  setStatus(`showing ${ms(a)} to ${ms(b)} ms from ${where}; ${entries.length} run(s)`);
  document.getElementById('range').textContent = `${ms(a)}–${ms(b)} ms`;
  if (state.why) showWhy(state.why);
  document.body.dataset.drawMs = (performance.now() - began).toFixed(1); // for the tests: responsiveness
}

function addLabel(parent, text, y, h, kind) {
  const label = document.createElement('div');
  label.className = `lane-label ${kind}`;
  label.style.top = `${y}px`;
  label.style.height = `${h}px`;
  label.textContent = text;
  parent.append(label);
}

function ms(us) {
  return (us / 1e3).toFixed(Math.abs(us) < 1e4 ? 3 : 1);
}

function toX(t, width) {
  const [a, b] = state.view;
  return ((t - a) / (b - a)) * width;
}

function drawAxis(ctx, width) {
  const [a, b] = state.view;
  const span = b - a;
  const step = niceStep(span / 8);
  ctx.fillStyle = '#444';
  ctx.strokeStyle = '#ddd';
  ctx.font = '11px sans-serif';
  for (let t = Math.ceil(a / step) * step; t <= b; t += step) {
    const x = toX(t, width);
    ctx.beginPath();
    ctx.moveTo(x, AXIS - 6);
    ctx.lineTo(x, ctx.canvas.height);
    ctx.stroke();
    ctx.fillText(`${ms(t)} ms`, x + 2, AXIS - 10);
  }
}

function niceStep(raw) {
  const power = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 5, 10]) if (m * power >= raw) return m * power;
  return 10 * power;
}

// Draws a lane's visible events, merging those less than a pixel apart; returns the drawn segments
// [x0, x1, first, last] (indices into lane.events) for hit-testing.
function drawLane(ctx, lane, width) {
  const events = lane.events;
  const a = state.view[0] + (lane.offset || 0) - lane.longest; // no event starting earlier can show
  const o = lane.offset || 0;
  let lo = 0;
  let hi = events.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (events[mid][0] < a) lo = mid + 1;
    else hi = mid;
  }
  const start = lo;
  const drawn = [];
  let current = null;
  const top = lane.y + 2;
  const h = lane.h - 4;
  const flush = () => {
    if (!current) return;
    const [x0, x1, first, last] = current;
    const color = lane.events[first][2];
    if (lane.kind === 'calls') {
      ctx.fillStyle = color;
      if (lane.events[first][3].sync) {
        ctx.beginPath();
        ctx.moveTo(x0 - 4, top);
        ctx.lineTo(x0 + 4, top);
        ctx.lineTo(x0, top + h);
        ctx.fill();
      } else {
        ctx.fillRect(x0, top, Math.max(1, x1 - x0), h);
      }
    } else {
      ctx.fillStyle = last > first ? shade(color) : color;
      ctx.fillRect(x0, top, Math.max(1, x1 - x0), h);
      if (lane.kind === 'gpu' && lane.events.slice(first, last + 1).some((e) => e[3].category === 'gpu_memcpy')) {
        ctx.strokeStyle = COPY_EDGE;
        ctx.strokeRect(x0 + 0.5, top + 0.5, Math.max(1, x1 - x0) - 1, h - 1);
      }
    }
    drawn.push(current);
    current = null;
  };
  for (let i = start; i < events.length; i++) {
    const [s, d] = events[i];
    const x0 = toX(s - o, width);
    const x1 = toX(s + d - o, width);
    if (x1 < 0) continue;
    if (x0 > width) break;
    const sync = lane.kind === 'calls' && events[i][3].sync;
    // a sub-pixel event joins its neighbour when less than a pixel lies between them; wide ones stand alone
    const tiny = current && (x1 - x0 < 1 || current[1] - current[0] < 1);
    if (current && tiny && !sync && !lane.events[current[2]][3].sync && x0 - current[1] < 1) {
      current[1] = Math.max(current[1], x1);
      current[3] = i;
    } else {
      flush();
      current = [x0, x1, i, i];
    }
  }
  flush();
  return drawn;
}

function shade(hex) {
  // merged events: the lane's colour, darker, so that a block of many tiny events reads as such
  const n = parseInt(hex.slice(1), 16);
  const f = (v) => Math.round(v * 0.7);
  return `rgb(${f(n >> 16)}, ${f((n >> 8) & 255)}, ${f(n & 255)})`;
}

// ----------------------------------------------------------------------------- zoom, pan, hover, click

function wireCanvas() {
  const canvas = document.getElementById('canvas');
  let drag = null;
  canvas.addEventListener(
    'wheel',
    (event) => {
      event.preventDefault();
      const width = canvas.clientWidth;
      const [a, b] = state.view;
      const at = a + (event.offsetX / width) * (b - a);
      const factor = Math.exp((event.deltaY || 0) * 0.002);
      const span = Math.max(0.05, (b - a) * factor); // 50 ns at most
      const left = (at - a) / (b - a);
      state.view = [at - left * span, at - left * span + span];
      draw();
    },
    {passive: false},
  );
  canvas.addEventListener('mousedown', (event) => {
    drag = {x: event.offsetX, view: state.view, moved: false};
  });
  window.addEventListener('mouseup', () => {
    drag = null;
  });
  canvas.addEventListener('mousemove', (event) => {
    if (drag) {
      const dx = event.offsetX - drag.x;
      if (Math.abs(dx) > 2) drag.moved = true;
      const [a, b] = drag.view;
      const shift = (dx / canvas.clientWidth) * (b - a);
      state.view = [a - shift, b - shift];
      draw();
      return;
    }
    hover(event);
  });
  canvas.addEventListener('mouseleave', () => {
    document.getElementById('tooltip').style.display = 'none';
  });
  canvas.addEventListener('dblclick', () => {
    state.view = null;
    draw();
  });
  canvas.addEventListener('click', (event) => {
    if (drag && drag.moved) return;
    const hit = find(event.offsetX, event.offsetY);
    if (hit && hit.lane.kind === 'regions') {
      state.why = hit.lane.events[hit.first][3].region;
      showWhy(state.why);
    }
  });
}

function find(x, y) {
  const lane = state.lanes.find((l) => y >= l.y && y < l.y + l.h);
  if (!lane || !lane.drawn) return null;
  for (const [x0, x1, first, last] of lane.drawn) {
    if (x >= x0 - 3 && x <= Math.max(x1, x0 + 1) + 3) return {lane, first, last};
  }
  return null;
}

function hover(event) {
  const tip = document.getElementById('tooltip');
  const hit = find(event.offsetX, event.offsetY);
  if (!hit) {
    tip.style.display = 'none';
    return;
  }
  tip.innerHTML = describe(hit);
  tip.style.display = 'block';
  tip.style.left = `${event.clientX + 14}px`;
  tip.style.top = `${event.clientY + 14}px`;
}

function regionName(data, index) {
  return index >= 0 ? data.regions[index][0] : 'other';
}

function threadName(data, t) {
  return t === 0 ? 'the main thread' : `thread ${data.threads[t].tid}`;
}

function describe({lane, first, last}) {
  const [start, dur, , what] = lane.events[first];
  const data = lane.data;
  if (last > first) {
    const end = Math.max(...lane.events.slice(first, last + 1).map(([s, d]) => s + d));
    return `<b>${last - first + 1} events</b>, merged at this zoom: ${ms(start)}–${ms(end)} ms. Zoom in.`;
  }
  const when = `at ${ms(start - (lane.offset || 0))} ms, ${dur < 1000 ? `${dur.toFixed(2)} µs` : `${ms(dur)} ms`}`;
  if (what.region) return `<b>${esc(what.region)}</b> ${when}. Click for its why numbers.`;
  if (what.op) {
    const region = regionAt(data, start);
    return `<b>${esc(what.op)}</b> ${when}<br>${threadName(data, what.thread)}, in ${esc(region)}`;
  }
  if (what.callName) {
    const kind = what.sync ? 'a host-device sync' : 'a kernel launch';
    const where = `${threadName(data, what.thread)}, in ${esc(regionName(data, what.region))}`;
    return `<b>${esc(what.callName)}</b> ${when}<br>${kind} on ${where}`;
  }
  const call = data.calls[what.call];
  const [cs, , thread, callName, region] = call;
  return (
    `<b>${esc(what.kernel)}</b><br>${what.category.replace('gpu_', '')} ${when}<br>` +
    `launched by ${esc(data.names[callName])} at ${ms(cs - (lane.offset || 0))} ms on ${threadName(data, thread)}, ` +
    `in ${esc(regionName(data, region))}`
  );
}

function regionAt(data, t) {
  const found = data.regions.find(([, s, d]) => t >= s && t < s + d);
  return found ? found[0] : 'other';
}

function esc(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'})[c]);
}

// The why numbers of one region for every run shown, side by side.
function showWhy(region) {
  const panel = document.getElementById('why');
  const entries = shown();
  const measures = state.listing.measures;
  const rows = state.listing.why.filter((m) => entries.some(({data}) => (data.why[region] || {})[m]));
  const head = entries.map(({info, step}) => `<th>${esc(info.strategy)}<br><small>step ${step}</small></th>`).join('');
  const body = rows
    .map((m) => {
      const cells = entries.map(({data}) => `<td>${format((data.why[region] || {})[m], measures[m].unit)}</td>`);
      return `<tr><th title="${esc(measures[m].meaning)}">${esc(measures[m].header)}</th>${cells.join('')}</tr>`;
    })
    .join('');
  panel.innerHTML =
    `<h3>${esc(region)}: why, in the steps shown</h3>` +
    `<table><thead><tr><th></th>${head}</tr></thead><tbody>${body}</tbody></table>` +
    '<p class="note">Hover a measure for its meaning. GPU ms: the device time of the work the region launched.</p>';
}

function format(value, unit) {
  if (value === undefined || value === null) return '–';
  if (unit === 'share') return `${Math.round(value * 100)} %`;
  if (unit === 'ms') return value < 1000 ? value.toPrecision(3) : value.toFixed(0);
  if (unit === 'bytes') return value >= 1e6 ? `${(value / 1e6).toPrecision(3)} MB` : `${value} B`;
  return String(value);
}

// ----------------------------------------------------------------------------- page

const HTML = `
<div id="bar">
  <div id="runs"></div>
  <div id="tools">
    <label>align on <select id="align"><option value="step">the step's start</option></select></label>
    <button id="reset">whole steps</button>
    <span id="range"></span>
    <div id="status"></div>
    <div class="help">wheel: zoom · drag: pan · double-click: whole steps · hover: details · click a region: why</div>
    <div id="legend"></div>
  </div>
</div>
<div id="plot"><div id="labels"></div><canvas id="canvas"></canvas></div>
<div id="why"></div>
<div id="tooltip"></div>`;

const CSS = `
body { font: 13px Roboto, sans-serif; margin: 8px; color: #212121; }
#bar { display: flex; gap: 24px; align-items: flex-start; margin-bottom: 8px; }
#runs { display: flex; flex-direction: column; gap: 2px; max-height: 160px; overflow: auto; }
.run { display: flex; gap: 6px; align-items: center; }
.run select { font-size: 12px; }
.skipped { color: #999; font-size: 12px; }
#tools { display: flex; flex-direction: column; gap: 4px; }
#status, .help { color: #666; font-size: 12px; }
#range { font-weight: 500; }
#plot { position: relative; display: flex; }
#labels { position: relative; width: ${LABELS}px; flex: none; }
.lane-label { position: absolute; left: 0; width: ${LABELS - 8}px; font-size: 11px; line-height: 18px;
  white-space: nowrap; overflow: hidden; text-overflow: ellipsis; color: #555; }
.lane-label.header { font-weight: 600; color: #212121; line-height: 22px; border-top: 1px solid #ccc; }
#canvas { cursor: grab; flex: none; }
#tooltip { position: fixed; display: none; background: #fff; border: 1px solid #bbb; padding: 6px 8px;
  box-shadow: 0 2px 6px rgba(0,0,0,.2); max-width: 480px; font-size: 12px; pointer-events: none; z-index: 10; }
#why table { border-collapse: collapse; margin-top: 4px; }
#why th, #why td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; font-size: 12px; }
#why tbody th { text-align: left; font-weight: 500; }
.note { color: #666; font-size: 12px; }
#legend { display: flex; flex-wrap: wrap; gap: 10px; font-size: 11px; color: #555; }
#legend i { display: inline-block; width: 10px; height: 10px; margin-right: 3px; vertical-align: -1px; }`;
