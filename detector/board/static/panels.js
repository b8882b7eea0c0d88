// What the tab says in words beside the lanes: each run's label, the legend, the tooltip of the event under the
// pointer and the why panel of a region. All of it is built from text nodes (page.js `h`): a name or value
// from a run's files is shown as it is written, never read as markup.

import {h} from './page.js';
import {COPY_EDGE, regionAt, regionName, threadName} from './lanes.js';
import {ms, shown, state} from './state.js';

// A run as its checkbox reads: strategy, mode, device and when it ran, which tells two runs of one strategy apart.
export function runLabel(run) {
  const when = run.created ? run.created.slice(0, 16).replace('T', ' ') : run.run.split('/').pop();
  const synced = run.synced ? ' · regions synchronised' : '';
  const rank = run.rank === null ? '' : ` · rank ${run.rank} of ${run.ranks}`;
  return `${run.strategy} · ${run.mode}${synced}${rank} · ${run.device} · ${when}`;
}

// The legend names what the runs shown draw: their regions (host spans and the GPU work they launched),
// the launches and syncs where there are any, and the copies' outline.
export function drawLegend(entries) {
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
        } else if (lane.kind === 'memory') {
          drawn.set(what.region, event[2]);
        } else if (lane.kind === 'calls') {
          drawn.set(what.sync ? 'host-device sync' : 'kernel launch', what.sync ? colors.sync : colors.launch);
        }
      }
    }
  }
  const chips = [...drawn].map(([name, color]) => {
    const swatch = h('i');
    swatch.style.background = color;
    return h('span', {}, swatch, name);
  });
  document.getElementById('legend').replaceChildren(...chips);
}

// The tooltip's lines for the event (or merged events) under the pointer: a list of nodes and strings.
export function describe(hit) {
  const {lane, first, last} = hit;
  if (lane.kind === 'memory') return describeMemory(hit);
  const [start, dur, , what] = lane.events[first];
  const data = lane.data;
  const o = lane.offset || 0;
  if (last > first) {
    const end = Math.max(...lane.events.slice(first, last + 1).map(([s, d]) => s + d));
    return [h('b', {}, `${last - first + 1} events`), `, merged at this zoom: ${ms(start)}–${ms(end)} ms. Zoom in.`];
  }
  const when = ` at ${ms(start - o)} ms, ${dur < 1000 ? `${dur.toFixed(2)} µs` : `${ms(dur)} ms`}`;
  if (what.region) return [h('b', {}, what.region), `${when}. Click for its why numbers.`];
  if (what.op) {
    const where = `${threadName(data, what.thread)}, in ${regionAt(data, start)}`;
    return [h('b', {}, what.op), when, h('br'), where];
  }
  if (what.callName) {
    const kind = what.sync ? 'a host-device sync' : 'a kernel launch';
    const where = `${threadName(data, what.thread)}, in ${regionName(data, what.region)}`;
    return [h('b', {}, what.callName), when, h('br'), `${kind} on ${where}`];
  }
  const [cs, , thread, callName, region] = data.calls[what.call];
  return [
    h('b', {}, what.kernel),
    h('br'),
    `${what.category.replace('gpu_', '')}${when}`,
    h('br'),
    `launched by ${data.names[callName]} at ${ms(cs - o)} ms on ${threadName(data, thread)}, ` +
      `in ${regionName(data, region)}`,
  ];
}

// A memory lane at the pointer's time: the bytes allocated then, the event that set that level, and the step's last
// allocation up to it with its operator (a free sets most levels); where the pixel column merges several levels,
// also their highest.
function describeMemory({lane, first, last, level, t}) {
  const o = lane.offset || 0;
  const [start, , , what] = lane.events[level];
  const at = ` at ${ms(t - o)} ms, in ${regionAt(lane.data, t)}`;
  const lines = [h('b', {}, `${memoryText(what.allocated)} allocated`), at];
  const since = what.first ? 'the step began (tensors live from before it)' : `${change(what)} at ${ms(start - o)} ms`;
  lines.push(h('br'), `since ${since}`);
  const allocation = what.allocation;
  if (allocation && (what.bytes <= 0 || allocation.t !== start)) {
    const by = allocation.op || 'no operator';
    lines.push(h('br'), `allocated last by ${by}: ${memoryText(allocation.bytes)} at ${ms(allocation.t - o)} ms`);
  }
  if (last > first) {
    const top = lane.events.slice(first, last + 1).reduce((a, b) => (b[3].allocated > a[3].allocated ? b : a))[3];
    const after = top.first ? "at the step's start" : `after ${top.op || 'an event outside any operator'}`;
    const levels = `${last - first + 1} levels in this pixel column`;
    lines.push(h('br'), `${levels}, the highest ${memoryText(top.allocated)} ${after}. Zoom in.`);
  }
  if (lane.kept < lane.total) {
    lines.push(h('br'), h('small', {}, `${lane.kept} of the step's ${lane.total} events kept`));
  }
  return lines;
}

// An allocator's event in words: ``aten::empty allocated 64 MiB``, ``a free of 2 MiB outside any operator``.
function change({bytes, op}) {
  if (bytes >= 0) return `${op || 'an allocation outside any operator'} allocated ${memoryText(bytes)}`;
  return op ? `${op} freed ${memoryText(-bytes)}` : `a free of ${memoryText(-bytes)} outside any operator`;
}

// Bytes held, in binary units as the lab writes them (detector/lab/record/measures.py memory_text).
export function memoryText(value) {
  for (const [suffix, size] of [['GiB', 2 ** 30], ['MiB', 2 ** 20], ['KiB', 2 ** 10]]) {
    if (Math.abs(value) >= size) return `${Number((value / size).toPrecision(3))} ${suffix}`;
  }
  return `${Math.round(value)} B`;
}

// The why numbers of one region for every run shown, side by side.
export function showWhy(region) {
  const entries = shown();
  const measures = state.listing.measures;
  const value = (data, m) => (data.why[region] || {})[m];
  const rows = state.listing.why.filter((m) => entries.some(({data}) => value(data, m)));
  const head = entries.map(({info, step}) => h('th', {}, info.strategy, h('br'), h('small', {}, `step ${step}`)));
  const body = rows.map((m) =>
    h(
      'tr',
      {},
      h('th', {title: measures[m].meaning}, measures[m].header),
      ...entries.map(({data}) => h('td', {}, format(value(data, m), measures[m].unit))),
    ),
  );
  const gpu = rows.includes('gpu_ms') ? ' GPU ms: the device time of the work the region launched.' : '';
  document.getElementById('why').replaceChildren(
    h('h3', {}, `${region}: why, in the steps shown`),
    h('table', {}, h('thead', {}, h('tr', {}, h('th'), ...head)), h('tbody', {}, ...body)),
    h('p', {className: 'note'}, `Hover a measure for its meaning.${gpu}`),
  );
}

function format(value, unit) {
  if (value === undefined || value === null) return '–';
  if (typeof value !== 'number') return String(value); // not a measure the lab writes: shown as it is
  if (unit === 'share') return `${Math.round(value * 100)} %`;
  if (unit === 'ms') return value < 1000 ? value.toPrecision(3) : value.toFixed(0);
  if (unit === 'bytes') return value >= 1e6 ? `${(value / 1e6).toPrecision(3)} MB` : `${value} B`;
  if (unit === 'memory') return memoryText(value);
  return String(value);
}
