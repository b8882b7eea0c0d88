// The pointer on the canvas: wheel to zoom around it, drag to pan, double-click for the whole steps again,
// hover for what an event is (for device work, the call that launched it), click a region for its why numbers.

import {draw} from './draw.js';
import {describe, showWhy} from './panels.js';
import {state} from './state.js';

export function wireCanvas() {
  const canvas = document.getElementById('canvas');
  let drag = null;
  canvas.addEventListener('wheel', (event) => zoom(event, canvas.clientWidth), {passive: false});
  canvas.addEventListener('mousedown', (event) => {
    drag = {x: event.offsetX, view: state.view, moved: false};
  });
  window.addEventListener('mouseup', () => {
    drag = null;
  });
  canvas.addEventListener('mousemove', (event) => {
    if (!drag) return hover(event);
    const dx = event.offsetX - drag.x;
    if (Math.abs(dx) > 2) drag.moved = true;
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
    if (drag && drag.moved) return;
    const hit = find(event.offsetX, event.offsetY);
    if (hit && hit.lane.kind === 'regions') {
      state.why = hit.lane.events[hit.first][3].region;
      showWhy(state.why);
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

// The drawn segment under (x, y) on the canvas: {lane, first, last}, or null.
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
  tip.replaceChildren(...describe(hit));
  tip.style.display = 'block';
  tip.style.left = `${event.clientX + 14}px`;
  tip.style.top = `${event.clientY + 14}px`;
}
