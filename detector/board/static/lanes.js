// A step's extract (detector/lab/measure/extract.py) as lanes of events: the regions, each thread's operators, the CUDA
// calls, each GPU stream's work in the colour of the region whose call launched it, and the bytes the allocator
// had allocated over the step, each level in the colour of the region whose allocation or free set it.

export const CATEGORIES = ['kernel', 'gpu_memcpy', 'gpu_memset'];
export const SYNC = 2; // a call's flag (1: a kernel launch)
export const COPY_EDGE = '#d62728'; // a copy's outline, whatever region launched it
export const MEMORY_LANE = 44; // px of a memory lane: its height is the bytes allocated

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
  if (step.memory) lanes.push(memoryLane(step, colors));
  for (const lane of lanes) {
    lane.events.sort((a, b) => a[0] - b[0]);
    lane.longest = lane.events.reduce((m, [, d]) => Math.max(m, d), 0); // how far back a visible event can start
  }
  return {...step, lanes};
}

// The allocator's events as a lane: each level holds from its event to the next (the last to the step's end), in the
// colour of the region it fell in; low and high bound the levels, the step's start included. Each level also keeps
// the step's last allocation up to it (`allocation`), so that a level a free set still names what allocated.
function memoryLane(step, colors) {
  const {rows, start, device, events} = step.memory;
  const name = (i) => (i >= 0 ? readable(step.names[i]) : '');
  const lane = {
    kind: 'memory',
    label: `memory on ${device}: allocated`,
    height: MEMORY_LANE,
    start,
    kept: rows.length,
    total: events,
    events: [],
  };
  // the level at the step's start holds until the first event
  const points = [[0, start, 0, -1, true], ...rows];
  let allocation = null; // {t, bytes, op} of the last allocation so far
  points.forEach(([t, allocated, bytes, op, first], k) => {
    const next = k + 1 < points.length ? points[k + 1][0] : Math.max(step.dur, t);
    const region = regionAt(step, t);
    if (bytes > 0) allocation = {t, bytes, op: name(op)};
    const what = {allocated, bytes, op: name(op), region, first: Boolean(first), allocation};
    lane.events.push([t, next - t, colors.regions[region] || '#999', what]);
  });
  lane.low = points.reduce((m, [, a]) => Math.min(m, a), Infinity);
  lane.high = points.reduce((m, [, a]) => Math.max(m, a), -Infinity);
  return lane;
}

// An operator's name as a user reads it: an extract written before the lab named a compiled graph's own allocations
// (measure/extract.py MemoryNames) holds inductor's record function, `## Call CompiledFxGraph <hash> ##`.
function readable(name) {
  return /^## Call CompiledFxGraph \S+ ##$/.test(name) ? 'a compiled graph' : name;
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
