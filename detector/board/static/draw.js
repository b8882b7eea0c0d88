// Drawing: the lanes of every run shown on one canvas, under one time axis, with their labels beside it.
// Events narrower than a pixel at the current zoom are drawn merged, so a step of 10^5 launches stays responsive.
// The memory lanes share one scale, from the lowest to the highest level of any run shown, so that heights compare.

import {COPY_EDGE} from './lanes.js';
import {LABELS, h, setStatus} from './page.js';
import {drawLegend, memoryText, showWhy} from './panels.js';
import {offset, rankReference, shown, state} from './state.js';

const LANE = 18; // px per lane
const HEADER = 22; // px of a run's title lane
const AXIS = 26; // px of the time axis
const PICKED_EDGE = '#212121'; // the outline of the region clicked, whose why numbers show
const PICKED_BAND = 'rgba(255, 193, 7, 0.16)'; // its span behind the run's lanes

function fullView(entries) {
  let start = 0;
  let end = 1;
  for (const entry of entries) {
    const {data} = entry;
    const o = offset(entry);
    start = Math.min(start, -o);
    for (const lane of data.lanes) {
      for (const [s, d] of lane.events) end = Math.max(end, s + d - o);
    }
    end = Math.max(end, data.dur - o);
  }
  return [start, end];
}

// Lays out and draws the runs shown in state.view (the whole steps where it is null).
export function draw() {
  const began = performance.now();
  const entries = shown();
  const canvas = document.getElementById('canvas');
  const labels = document.getElementById('labels');
  labels.replaceChildren();
  state.lanes = [];
  if (!entries.length) {
    setStatus('tick a run to see its step');
    canvas.height = 0;
    return;
  }
  if (!state.view) state.view = fullView(entries);
  drawLegend(entries);
  state.memoryScale = memoryScale(entries);
  let y = AXIS;
  for (const entry of entries) {
    const {run, step, data, info} = entry;
    const rank = info.rank === null ? '' : ` · rank ${info.rank}`;
    state.lanes.push({run, kind: 'header', y, h: HEADER, label: `${info.strategy}${rank} · step ${step}`, events: []});
    const title = `${info.strategy} · ${info.mode}${rank} · step ${step} · ${stepTime(entry)}`;
    const header = laneLabel(title, y, HEADER, 'header');
    header.title = clockMeaning(entry);
    labels.append(header);
    y += HEADER;
    const o = offset(entry);
    for (const lane of data.lanes) {
      const height = lane.height || LANE;
      state.lanes.push({...lane, run, data, y, h: height, offset: o});
      const label = lane.kind === 'memory' ? memoryLabel(lane, y, height) : laneLabel(lane.label, y, height, lane.kind);
      labels.append(label);
      y += height;
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
  const decimals = drawAxis(ctx, width);
  const picked = state.why ? pickedRegions(width) : [];
  for (const region of picked) drawBand(ctx, region);
  const drawnPerRun = {};
  for (const lane of state.lanes) {
    if (!lane.events.length) continue;
    lane.drawn = drawLane(ctx, lane, width);
    drawnPerRun[lane.run] = (drawnPerRun[lane.run] || 0) + lane.drawn.length;
  }
  for (const region of picked) drawOutline(ctx, region);
  canvas.dataset.drawn = JSON.stringify(drawnPerRun);
  // the window's ends one decimal finer than the axis's labels, both ends alike
  const [a, b] = state.view.map((t) => (t / 1e3).toFixed(decimals + 1));
  const where = state.align === 'step' ? "the step's start" : `the start of ${state.align}`;
  const aligned = entries.filter((e) => ![null, e].includes(rankReference(e))).length;
  const ranks = aligned ? `; ${aligned} rank(s) placed against their run's lowest rank on the host's clock` : '';
  setStatus(`showing ${a} to ${b} ms from ${where}; ${entries.length} run(s)${ranks}`);
  document.getElementById('range').textContent = `${a}–${b} ms`;
  if (state.why) showWhy(state.why);
  document.body.dataset.drawMs = (performance.now() - began).toFixed(1); // for the tests: responsiveness
}

// A step's time as the lab's tables lead with it: on a run the device paced, the device's step (from the step's first
// kernel to the next step's: the host ran steps ahead, launching, and its ProfilerStep is no measure of the step);
// elsewhere the host's ProfilerStep, the wall time (on the CPU the host is the device).
function stepTime({data, info}) {
  const device = info.clock === 'device' && (data.why.step || {}).device_step_ms;
  return device ? `device ${device.toFixed(1)} ms` : `wall ${(data.dur / 1e3).toFixed(1)} ms`;
}

// What the header's time is, on hovering it.
function clockMeaning(entry) {
  const wall = `the host's ProfilerStep took ${(entry.data.dur / 1e3).toFixed(1)} ms`;
  const paced = entry.info.paced ? ` The run was ${entry.info.paced}.` : '';
  if (stepTime(entry).startsWith('wall')) return `wall: ${wall}.${paced}`;
  return `device: the GPU's step, from its first kernel to the next step's; ${wall}, launching ahead.${paced}`;
}

// The lowest and highest bytes allocated of the memory lanes shown: their one scale (null where none has memory).
function memoryScale(entries) {
  const lanes = entries.flatMap(({data}) => data.lanes.filter((lane) => lane.kind === 'memory'));
  if (!lanes.length) return null;
  const low = Math.min(...lanes.map((lane) => lane.low));
  const high = Math.max(...lanes.map((lane) => lane.high));
  return {low, high: Math.max(high, low + 1)};
}

// A memory lane's label: what it draws, beside the shared scale's highest level at the lane's top and its lowest at
// its foot, level with the bars' reach.
function memoryLabel(lane, y, height) {
  const {low, high} = state.memoryScale;
  const label = laneLabel('', y, height, 'memory');
  label.title = `${lane.label}: ${memoryText(low)} at the foot to ${memoryText(high)} at the top, one scale for all`;
  const top = h('span', {className: 'scale top'}, memoryText(high));
  label.append(h('span', {className: 'name'}, lane.label), top, h('span', {className: 'scale foot'}, memoryText(low)));
  return label;
}

function laneLabel(text, y, height, kind) {
  const label = h('div', {className: `lane-label ${kind}`}, text);
  label.style.top = `${y}px`;
  label.style.height = `${height}px`;
  return label;
}

function toX(t, width) {
  const [a, b] = state.view;
  return ((t - a) / (b - a)) * width;
}

// The time axis: a label every nice step, each with the decimals the step needs (5 ms steps: "5 ms", "10 ms"; 0.2 ms
// steps: "0.2 ms", "10.4 ms"). The step is wide enough for the widest label, and a label that would run past the
// canvas's right edge ends at it, or is left out where that would reach its neighbour: no label cut or overlapping.
// Returns the decimals.
function drawAxis(ctx, width) {
  const [a, b] = state.view;
  ctx.font = '11px sans-serif';
  let step = niceStep((b - a) / 8);
  const text = (k, decimals) => `${((k * step) / 1e3).toFixed(decimals)} ms`;
  const decimalsOf = (s) => Math.max(0, -Math.floor(Math.log10(s / 1e3) + 1e-9));
  // the widest label of the view (its largest value), with a gap: a coarser step until the labels fit
  while (((step / (b - a)) * width) < ctx.measureText(text(Math.floor(b / step), decimalsOf(step))).width + 12) {
    step = niceStep(step * 1.01);
  }
  const decimals = decimalsOf(step);
  ctx.fillStyle = '#444';
  ctx.strokeStyle = '#ddd';
  const labels = [];
  const extents = [];
  for (let k = Math.ceil(a / step); k * step <= b; k++) {
    const x = toX(k * step, width);
    ctx.beginPath();
    ctx.moveTo(x, AXIS - 6);
    ctx.lineTo(x, ctx.canvas.height);
    ctx.stroke();
    const label = text(k, decimals);
    const w = ctx.measureText(label).width;
    let left = x + 2;
    if (left + w > width) left = width - w - 1; // ends at the canvas's edge, left of its tick
    if (left < 0 || (extents.length && left < extents[extents.length - 1][1] + 6)) continue;
    ctx.fillText(label, left, AXIS - 10);
    labels.push(label);
    extents.push([left, left + w]);
  }
  ctx.canvas.dataset.axis = JSON.stringify(labels); // for the tests: what the axis says, and where
  ctx.canvas.dataset.axisExtents = JSON.stringify(extents.map(([l, r]) => [+l.toFixed(1), +r.toFixed(1)]));
  return decimals;
}

// The region whose why numbers are shown, in every run that has it: its regions lane, its span in x, and the bottom
// of the run's lanes.
function pickedRegions(width) {
  const picked = [];
  for (const lane of state.lanes.filter((l) => l.kind === 'regions')) {
    const event = lane.events.find(([, , , what]) => what.region === state.why);
    if (!event) continue;
    const own = state.lanes.filter((l) => l.run === lane.run && l.kind !== 'header');
    const bottom = Math.max(...own.map((l) => l.y + l.h));
    const o = lane.offset || 0;
    picked.push({lane, x0: toX(event[0] - o, width), x1: toX(event[0] + event[1] - o, width), bottom});
  }
  return picked;
}

// Behind the run's lanes: the picked region's span, so that its GPU work and memory read against it.
function drawBand(ctx, {lane, x0, x1, bottom}) {
  ctx.fillStyle = PICKED_BAND;
  ctx.fillRect(x0, lane.y, Math.max(1, x1 - x0), bottom - lane.y);
}

// Over the regions lane: the picked region's bar outlined.
function drawOutline(ctx, {lane, x0, x1}) {
  ctx.strokeStyle = PICKED_EDGE;
  ctx.lineWidth = 2;
  ctx.strokeRect(x0 + 1, lane.y + 1, Math.max(1, x1 - x0 - 2), lane.h - 2);
  ctx.lineWidth = 1;
}

function niceStep(raw) {
  const power = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 5, 10]) if (m * power >= raw) return m * power;
  return 10 * power;
}

// The index of the first event that can show: none starting before the view's start less the lane's longest.
function firstVisible(lane) {
  const events = lane.events;
  const a = state.view[0] + (lane.offset || 0) - lane.longest;
  let lo = 0;
  let hi = events.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (events[mid][0] < a) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Draws a lane's visible events, merging those less than a pixel apart; returns the drawn segments
// [x0, x1, first, last] (indices into lane.events) for hit-testing.
function drawLane(ctx, lane, width) {
  if (lane.kind === 'memory') return drawMemory(ctx, lane, width);
  const events = lane.events;
  const o = lane.offset || 0;
  const drawn = [];
  let current = null;
  const flush = () => {
    if (!current) return;
    drawSegment(ctx, lane, current);
    drawn.push(current);
    current = null;
  };
  for (let i = firstVisible(lane); i < events.length; i++) {
    const [s, d] = events[i];
    const x0 = toX(s - o, width);
    const x1 = toX(s + d - o, width);
    if (x1 < 0) continue;
    if (x0 > width) break;
    const sync = lane.kind === 'calls' && events[i][3].sync;
    // sub-pixel events less than a pixel apart are drawn as one (darker) bar; a wide one stands alone, never
    // darkened by a sub-pixel neighbour, which gets a pixel of its own
    const tiny = current && x1 - x0 < 1 && current[1] - current[0] < 1;
    if (current && tiny && !sync && !events[current[2]][3].sync && x0 - current[1] < 1) {
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

// One drawn segment: a sync's triangle, a launch's tick, or a bar (darker where events are merged; a copy outlined).
function drawSegment(ctx, lane, [x0, x1, first, last]) {
  const top = lane.y + 2;
  const h = lane.h - 4;
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
    return;
  }
  ctx.fillStyle = last > first ? shade(color) : color;
  ctx.fillRect(x0, top, Math.max(1, x1 - x0), h);
  if (lane.kind === 'gpu' && lane.events.slice(first, last + 1).some((e) => e[3].category === 'gpu_memcpy')) {
    ctx.strokeStyle = COPY_EDGE;
    ctx.strokeRect(x0 + 0.5, top + 0.5, Math.max(1, x1 - x0) - 1, h - 1);
  }
}

// A memory lane: each level a bar from the lane's foot up to its bytes on the shared scale, in its region's colour.
// The levels within one pixel column merge into their highest, so a peak is never lost at any zoom and a dense
// stretch reads as its envelope, column by column; the segments it returns hold the merged events' range and, as
// `top`, the index of the highest.
function drawMemory(ctx, lane, width) {
  const {low, high} = state.memoryScale;
  const foot = lane.y + lane.h - 2;
  const height = (allocated) => 1 + ((allocated - low) / (high - low)) * (lane.h - 5);
  const o = lane.offset || 0;
  const drawn = [];
  let current = null;
  const flush = () => {
    if (!current) return;
    const [x0, x1, , , top] = current;
    const h = height(lane.events[top][3].allocated);
    ctx.fillStyle = lane.events[top][2];
    const left = Math.floor(x0); // whole pixel columns: no seams between neighbouring columns
    ctx.fillRect(left, foot - h, Math.max(1, Math.ceil(x1) - left), h);
    drawn.push(current);
    current = null;
  };
  for (let i = firstVisible(lane); i < lane.events.length; i++) {
    const [s, d, , what] = lane.events[i];
    const x0 = Math.max(toX(s - o, width), 0);
    const x1 = Math.min(toX(s + d - o, width), width);
    if (x1 < 0) continue;
    if (x0 > width) break;
    const column = current ? Math.floor(current[0]) + 1 : 0; // the pixel column the current segment began in
    if (current && current[1] <= column && x1 <= column) {
      current[1] = Math.max(current[1], x1);
      current[3] = i;
      if (what.allocated > lane.events[current[4]][3].allocated) current[4] = i;
    } else {
      flush();
      current = [x0, x1, i, i, i];
    }
  }
  flush();
  // the foot, and a fainter line where the scale's highest level reaches: its label's two ends
  ctx.strokeStyle = '#bbb';
  ctx.beginPath();
  ctx.moveTo(0, foot + 0.5);
  ctx.lineTo(width, foot + 0.5);
  ctx.stroke();
  ctx.strokeStyle = '#e4e4e4';
  ctx.beginPath();
  ctx.moveTo(0, lane.y + 1.5);
  ctx.lineTo(width, lane.y + 1.5);
  ctx.stroke();
  return drawn;
}

function shade(hex) {
  // merged events: the lane's colour, darker, so that a block of many tiny events reads as such
  const n = parseInt(hex.slice(1), 16);
  const f = (v) => Math.round(v * 0.7);
  return `rgb(${f(n >> 16)}, ${f((n >> 8) & 255)}, ${f(n & 255)})`;
}
