// The Traces tab's page: its skeleton and style (constants, no data), its status line, and `h`, the one way the
// other modules build what they show from data: strings go in as text nodes, never as markup.

export const LABELS = 230; // px of the lane labels column

// An element with properties (className, title, …) and children; a string child becomes a text node.
export function h(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  node.append(...children);
  return node;
}

export function mount() {
  document.head.append(h('style', {textContent: CSS}));
  document.body.innerHTML = HTML; // a constant: the page's skeleton, which the modules fill with text nodes
}

export function setStatus(text) {
  document.getElementById('status').textContent = text;
}

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
#runs { display: flex; flex-direction: column; gap: 2px; max-height: 160px; overflow: auto; flex: none; }
.run { display: flex; gap: 6px; align-items: center; white-space: nowrap; }
.run select { font-size: 12px; }
.skipped { color: #999; font-size: 12px; }
.warning { color: #b26a00; font-size: 12px; }
#tools { display: flex; flex-direction: column; gap: 4px; min-width: 0; }
#reset { align-self: flex-start; }
#status, .help { color: #666; font-size: 12px; }
#range { font-weight: 500; }
#plot { position: relative; display: flex; }
#labels { position: relative; width: ${LABELS}px; flex: none; }
.lane-label { position: absolute; left: 0; width: ${LABELS - 8}px; font-size: 11px; line-height: 18px;
  white-space: nowrap; overflow: hidden; text-overflow: ellipsis; color: #555; }
.lane-label.header { font-weight: 600; color: #212121; line-height: 22px; border-top: 1px solid #ccc; z-index: 1;
  overflow: visible; width: max-content; min-width: ${LABELS - 8}px; }
.lane-label.memory { overflow: visible; }
.lane-label.memory .name { position: absolute; left: 0; top: 2px; width: ${LABELS - 86}px; white-space: normal;
  line-height: 13px; }
.lane-label.memory .scale { position: absolute; right: 2px; line-height: 13px; color: #777; }
.lane-label.memory .top { top: 1px; }
.lane-label.memory .foot { bottom: 1px; }
#canvas { cursor: grab; flex: none; }
#tooltip { position: fixed; display: none; background: #fff; border: 1px solid #bbb; padding: 6px 8px;
  box-shadow: 0 2px 6px rgba(0,0,0,.2); max-width: min(480px, calc(100vw - 24px)); font-size: 12px;
  overflow-wrap: anywhere; pointer-events: none; z-index: 10; }
#why table { border-collapse: collapse; margin-top: 4px; }
#why th, #why td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; font-size: 12px; }
#why tbody th { text-align: left; font-weight: 500; }
.note { color: #666; font-size: 12px; }
#legend { display: flex; flex-wrap: wrap; gap: 10px; font-size: 11px; color: #555; }
#legend i { display: inline-block; width: 10px; height: 10px; margin-right: 3px; vertical-align: -1px; }`;
