// A step's extract (detector/lab/extract.py) as lanes of events: the regions, each thread's operators, the CUDA
// calls, and each GPU stream's work in the colour of the region whose call launched it.

export const CATEGORIES = ['kernel', 'gpu_memcpy', 'gpu_memset'];
export const SYNC = 2; // a call's flag (1: a kernel launch)
export const COPY_EDGE = '#d62728'; // a copy's outline, whatever region launched it

// Lanes of one step, each with its events sorted by start: [start, dur, colour, payload].
export function prepare(step, colors, collectives = []) {
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
  const collective = (kernel) => collectives.some((prefix) => name(kernel).startsWith(prefix));
  for (const stream of step.streams) {
    const comm = stream.events.length && stream.events.every(([, , , kernel]) => collective(kernel));
    lanes.push({
      kind: 'gpu',
      label: `GPU stream ${stream.stream}${comm ? ': collectives' : ''}`,
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

export function regionName(data, index) {
  return index >= 0 ? data.regions[index][0] : 'other';
}

export function regionAt(data, t) {
  const found = data.regions.find(([, s, d]) => t >= s && t < s + d);
  return found ? found[0] : 'other';
}

export function threadName(data, t) {
  return t === 0 ? 'the main thread' : `thread ${data.threads[t].tid}`;
}
