// TensorBoard's "Traces" tab (detector/board/plugin.py serves its data and these modules): the profiled steps
// of several runs as lanes on one time axis. Per run: the lab's regions, each thread's top-level operators, the
// CUDA calls (a tick per kernel launch, a red mark per host-device sync), each GPU stream's kernels, copies
// and memsets that the step launched, and the bytes allocated over the step (where the profile recorded memory). No
// network: everything comes from ./runs and ./step.
//
// The modules, one concern each: state.js (what is shown), lanes.js (a step as lanes), draw.js (the canvas),
// interact.js (zoom, pan, hover, click), panels.js (labels, legend, tooltip, why), controls.js (the run list),
// page.js (the skeleton, and `h`: text nodes only).

import {buildControls, tickDefaults} from './controls.js';
import {draw} from './draw.js';
import {wireCanvas} from './interact.js';
import {prepare} from './lanes.js';
import {mount, setStatus} from './page.js';
import {state} from './state.js';

export async function render() {
  const began = performance.now();
  mount();
  try {
    state.listing = await getJson('./runs');
  } catch (err) {
    setStatus(`cannot list the profile runs: ${err}`);
    return;
  }
  if (!state.listing.runs.length) {
    setStatus(`no profile runs under ${state.listing.logdir}: run \`make profile STRATEGY=padded\` first`);
    return;
  }
  tickDefaults();
  buildControls(refresh);
  wireCanvas();
  window.addEventListener('resize', () => draw());
  await refresh();
  document.body.dataset.readyMs = Math.round(performance.now() - began); // for the tests: first full picture
}

async function getJson(url) {
  const response = await fetch(url);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

// Loads the ticked steps not loaded yet, then draws the whole steps.
async function refresh() {
  const wanted = [...state.selected].filter(([run, step]) => !state.data.has(`${run}@${step}`));
  if (wanted.length) setStatus(`loading ${wanted.length} step(s) …`);
  const failed = [];
  await Promise.all(
    wanted.map(async ([run, step]) => {
      try {
        const url = `./step?run=${encodeURIComponent(run)}&step=${step}`;
        state.data.set(`${run}@${step}`, prepare(await getJson(url), state.listing.colors, state.listing.collectives));
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
