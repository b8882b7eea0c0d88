// The pointer on the canvas: wheel to zoom around it, drag to pan, double-click for the whole steps again,
// hover for what an event is (for device work, the call that launched it; on a memory lane, what was allocated at the
// pointer), click a region to highlight it in every run shown beside its why numbers.

import {draw} from './draw.js';
import {describe} from './panels.js';
import {state} from './state.js';

export function wireCanvas() {
  const canvas = document.getElementById('canvas');
  let drag = null;
  let dragged = false; // the last press panned: its click, which follows the mouseup, picks no region
  canvas.addEventListener('wheel', (event) => zoom(event, canvas.clientWidth), {passive: false});
  canvas.addEventListener('mousedown', (event) => {
    drag = {x: event.offsetX, view: state.view};
    dragged = false;
  });
  window.addEventListener('mouseup', () => {
    drag = null;
  });
  canvas.addEventListener('mousemove', (event) => {
    if (!drag) return hover(event);
    const dx = event.offsetX - drag.x;
    if (Math.abs(dx) > 2) dragged = true;
    const [a, b] = drag.view;
    const shift = (dx / canvas.clientWidth) * (b - a);
    state.view = [a - shift, b - shift];
    draw();
  });
  canvas.addEventListener('mouseleave', () => {
    document.getElementById('tooltip').style.display = 'none';
  });
  canvas.addEventListener('dblclick', () => {
    state.view = null;
    draw();
  });
  canvas.addEventListener('click', (event) => {
    if (dragged) return;
    const hit = find(event.offsetX, event.offsetY);
    if (hit && hit.lane.kind === 'regions') {
      state.why = hit.lane.events[hit.first][3].region;
      draw(); // the region highlighted in every run shown, and its why numbers
    }
  });
}

function zoom(event, width) {
  event.preventDefault();
  const [a, b] = state.view;
  const at = a + (event.offsetX / width) * (b - a);
  const factor = Math.exp((event.deltaY || 0) * 0.002);
  const span = Math.max(0.05, (b - a) * factor); // 50 ns at most
  const left = (at - a) / (b - a);
  state.view = [at - left * span, at - left * span + span];
  draw();
}

// The drawn segment under (x, y) on the canvas: {lane, first, last}, or null. On a memory lane, anywhere over the
// step: the level that holds at the pointer's time `t`, whatever its bar's height (memoryAt).
function find(x, y) {
  const lane = state.lanes.find((l) => y >= l.y && y < l.y + l.h);
  if (!lane || !lane.drawn) return null;
  if (lane.kind === 'memory') {
    const [a, b] = state.view;
    return memoryAt(lane, a + (x / document.getElementById('canvas').clientWidth) * (b - a) + (lane.offset || 0));
  }
  for (const [x0, x1, first, last] of lane.drawn) {
    if (x >= x0 - 3 && x <= Math.max(x1, x0 + 1) + 3) return {lane, first, last};
  }
  return null;
}

// The memory lane's level at `t` (µs from its step's start), as `level`, and the drawn segment that holds it (the
// levels merged into its pixel column, `first` to `last`); null outside the step.
function memoryAt(lane, t) {
  const events = lane.events;
  const end = events[events.length - 1];
  if (t < events[0][0] || t > end[0] + end[1]) return null;
  let lo = 0;
  let hi = events.length - 1;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1; // the last level that starts at or before t
    if (events[mid][0] <= t) lo = mid;
    else hi = mid - 1;
  }
  const segment = lane.drawn.find(([, , first, last]) => first <= lo && lo <= last);
  const [first, last] = segment ? segment.slice(2, 4) : [lo, lo];
  return {lane, first, last, level: lo, t};
}

function hover(event) {
  const tip = document.getElementById('tooltip');
  const hit = find(event.offsetX, event.offsetY);
  if (!hit) {
    tip.style.display = 'none';
    return;
  }
  tip.replaceChildren(...describe(hit).map(whole));
  tip.style.display = 'block';
  place(tip, event.clientX, event.clientY);
}

// A line's numbers kept whole with their units where the box wraps it ("8.564 ms", "1 MiB", not "1" then "MiB").
function whole(part) {
  return typeof part === 'string' ? part.replace(/(\d) (?=(ms|µs|GiB|MiB|KiB|B)\b)/g, '$1\u00a0') : part;
}

// The tooltip below and right of the pointer, or left of it and above it where it would leave the window that way:
// always whole inside the window (as close to an edge as it must be where it is larger than the room on either side).
function place(tip, x, y) {
  const gap = 14;
  const {width, height} = tip.getBoundingClientRect();
  const room = (at, size, limit) => (at + gap + size <= limit - 4 ? at + gap : Math.max(4, at - gap - size));
  tip.style.left = `${Math.min(room(x, width, innerWidth), Math.max(4, innerWidth - 4 - width))}px`;
  tip.style.top = `${Math.min(room(y, height, innerHeight), Math.max(4, innerHeight - 4 - height))}px`;
}
