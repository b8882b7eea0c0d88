// The controls above the lanes: a checkbox and a step per run (under it what its records left out, and the runs
// that cannot be shown, with why), the alignment, and the button back to the whole steps.

import {draw} from './draw.js';
import {h} from './page.js';
import {runLabel} from './panels.js';
import {state} from './state.js';

// By default the newest run of each strategy (the listing puts it first), train mode first, five at most; of a
// run of several processes every rank, at the first rank's step, so that they line up.
export function tickDefaults() {
  const runs = state.listing.runs;
  const seen = new Set();
  for (const run of runs) {
    const key = `${run.strategy}/${run.mode}`;
    if (!seen.has(key) && state.selected.size < 5 && run.mode === runs[0].mode) {
      seen.add(key);
      for (const rank of runs.filter((r) => r.group === run.group)) {
        const step = rank.steps.includes(run.representative) ? run.representative : rank.representative;
        state.selected.set(rank.run, step);
      }
    }
  }
}

// `refresh` loads the steps ticked and draws them.
export function buildControls(refresh) {
  const list = document.getElementById('runs');
  for (const run of state.listing.runs) {
    list.append(runRow(run, refresh));
    for (const warning of run.warnings) list.append(h('div', {className: 'warning'}, `${run.run}: ${warning}`));
  }
  for (const skipped of state.listing.skipped) {
    list.append(h('div', {className: 'skipped'}, `${skipped.run}: ${skipped.reason}`));
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

function runRow(run, refresh) {
  const box = h('input', {type: 'checkbox', checked: state.selected.has(run.run)});
  const steps = h('select');
  for (const n of run.steps) steps.append(new Option(stepOption(run, n), n));
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
  return h('label', {className: 'run'}, box, h('span', {title: run.run}, runLabel(run)), steps);
}

// A step as the picker lists it, with its time on the run's clock (the device's step where the device paced the run,
// else the wall time); the representative step is the median of those times.
function stepOption(run, n) {
  const ms = (run.step_ms || {})[n];
  const time = ms === undefined ? '' : ` · ${run.clock} ${ms.toFixed(1)} ms`;
  return `step ${n}${time}${n === run.representative ? ' (median)' : ''}`;
}
