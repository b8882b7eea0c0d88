// What the tab shows, shared by its modules: the listing of ./runs, the runs ticked, the steps loaded and the
// time window drawn.

export const state = {
  listing: null,
  selected: new Map(), // run -> step number shown
  data: new Map(), // "run@step" -> step extract, with its lanes (lanes.js)
  align: 'step',
  view: null, // [start, end] µs, relative to each run's alignment point
  lanes: [], // what draw() laid out: {run, label, y, h, kind, events, drawn}
  why: null, // the region whose why numbers are shown
  memoryScale: null, // {low, high} bytes: the one scale of the memory lanes shown (draw.js)
};

// The runs ticked whose step has loaded: {run, step, data, info}, info being the run as ./runs lists it.
export function shown() {
  return [...state.selected]
    .map(([run, step]) => ({run, step, data: state.data.get(`${run}@${step}`)}))
    .filter((entry) => entry.data)
    .map((entry) => ({...entry, info: state.listing.runs.find((r) => r.run === entry.run)}));
}

// µs from the step's start where an entry's time axis begins: the step itself, or a region's start. The ranks
// of one run share the host's clock: each is drawn where it ran against the lowest rank shown, whose step (or
// region) the axis begins at, so a rank that waits in a collective for another shows where and how long.
export function offset(entry) {
  const reference = rankReference(entry);
  if (!reference) return alignment(entry.data);
  return alignment(reference.data) - (entry.data.start - reference.data.start);
}

function alignment(data) {
  if (state.align === 'step') return 0;
  const region = data.regions.find(([name]) => name === state.align);
  return region ? region[1] : 0;
}

// The lowest rank shown of the entry's run (the entry itself, maybe), or null for a run of one process.
export function rankReference(entry) {
  if (entry.info.rank === null || entry.data.start === undefined) return null;
  const ranks = shown().filter(
    (e) => e.info.group === entry.info.group && e.info.rank !== null && e.data.start !== undefined,
  );
  return ranks.reduce((low, e) => (e.info.rank < low.info.rank ? e : low), entry);
}

export function ms(us) {
  return (us / 1e3).toFixed(Math.abs(us) < 1e4 ? 3 : 1);
}
