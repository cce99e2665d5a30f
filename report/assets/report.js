// The report pages' script (report/pages.py inlines it): sortable tables and the attention explorer.
"use strict";
const REPORT = JSON.parse(document.getElementById("report-data").textContent);

// Sortable tables: click a header; the "worst first" button sorts the examples by chrF, lowest first.
function sortTable(table, column, numeric, ascending) {
  const body = table.tBodies[0];
  const rows = Array.from(body.rows);
  const value = (row) => numeric ? parseFloat(row.cells[column].textContent) : row.cells[column].textContent;
  const missing = (v) => numeric && Number.isNaN(v);  // an empty cell (a failed trial) goes last either way
  rows.sort((a, b) => {
    const x = value(a), y = value(b);
    if (missing(x) || missing(y)) return missing(x) - missing(y);
    return (x < y ? -1 : x > y ? 1 : 0) * (ascending ? 1 : -1);
  });
  rows.forEach((row) => body.appendChild(row));
  table.querySelectorAll("th").forEach((th) => th.classList.remove("sorted-up", "sorted-down"));
  table.tHead.rows[0].cells[column].classList.add(ascending ? "sorted-up" : "sorted-down");
}
document.querySelectorAll("table.sortable").forEach((table) => {
  table.querySelectorAll("th").forEach((th) => th.addEventListener("click", () => {
    sortTable(table, +th.dataset.column, th.dataset.numeric === "1", !th.classList.contains("sorted-up"));
  }));
});
const worst = document.getElementById("worst-first");
if (worst) worst.addEventListener("click", () => sortTable(document.getElementById("examples"), 3, true, true));

// The attention data: per example, deflated bytes in a <script id="blob-N">, inflated when opened.
async function inflate(number) {
  const text = atob(document.getElementById("blob-" + number).textContent);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

// One head's weights [Tq * Tk] (floats in [0, 1]) of a module; head "mean" averages the heads.
function headWeights(bytes, module, head) {
  const [heads, tq, tk] = module.shape;
  const out = new Float32Array(tq * tk);
  const chosen = head === "mean" ? [...Array(heads).keys()] : [+head];
  for (const h of chosen) {
    if (module.keep === null) {
      const start = module.offset + h * tq * tk;
      for (let i = 0; i < tq * tk; i++) out[i] += bytes[start + i] / 255;
    } else {
      const k = module.keep, count = heads * tq * k;
      const view = new DataView(bytes.buffer, bytes.byteOffset);
      for (let r = 0; r < tq; r++) for (let j = 0; j < k; j++) {
        const at = (h * tq + r) * k + j;
        out[r * tk + view.getUint16(module.offset + 2 * at, true)] += bytes[module.offset + 2 * count + at] / 255;
      }
    }
  }
  if (chosen.length > 1) for (let i = 0; i < out.length; i++) out[i] /= chosen.length;
  return out;
}

const ROLE_LABELS = {cross: "cross", source_self: "source self", target_self: "target self", grid: "grid over the image"};
function element(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}
function option(select, value, text) { select.appendChild(element("option", {value: value}, text)); }
// A token's weight: exact in data-w and the tooltip, as colour relative to the largest of its row.
function shade(node, weight, largest) {
  node.dataset.w = weight.toFixed(4);
  node.title = weight.toFixed(3);
  node.style.background = `rgba(214, 39, 40, ${Math.min(1, weight / Math.max(largest, 1e-6)).toFixed(3)})`;
}

async function openExplorer(details) {
  const root = details.querySelector(".explorer");
  if (root.dataset.ready) return;
  root.dataset.ready = "1";
  const number = +details.dataset.example;
  const example = REPORT.examples[number];
  const bytes = await inflate(number);
  const controls = element("div", {class: "controls"});
  const kind = element("select", {class: "kind"}), layer = element("select", {class: "layer"}), head = element("select", {class: "head"});
  const roles = [...new Set(example.modules.map((m) => m.role))];
  roles.forEach((r) => option(kind, r, ROLE_LABELS[r] || r));
  for (const [label, select] of [["kind", kind], ["layer", layer], ["head", head]]) {
    controls.appendChild(document.createTextNode(label + " ")); controls.appendChild(select);
  }
  const accuracy = element("div", {class: "accuracy"});
  for (const [name, value] of Object.entries(example.accuracy || {})) accuracy.appendChild(element("div", {}, `${name}: ${value.toFixed(3)}`));
  const queries = element("div", {class: "tokens queries"}), keys = element("div", {class: "tokens keys"});
  const canvas = element("canvas", {class: "heatmap"});
  root.append(controls, accuracy, queries, keys, canvas);

  let weights = null, module = null, queryTokens = [], keyTokens = [], active = null;
  function modulesOf(role) { return example.modules.filter((m) => m.role === role); }
  function fillLayers() {
    layer.innerHTML = "";
    modulesOf(kind.value).forEach((m, i) => option(layer, i, m.name));
    fillHeads();
  }
  function fillHeads() {
    const previous = head.value;
    head.innerHTML = "";
    module = modulesOf(kind.value)[+layer.value];
    for (let h = 0; h < module.shape[0]; h++) option(head, h, "head " + h);
    if (module.shape[0] > 1) option(head, "mean", "mean");
    if ([...head.options].some((o) => o.value === previous)) head.value = previous;
    draw();
  }
  function tokenRow(row, label, tokens, side) {
    row.innerHTML = "";
    row.appendChild(element("span", {class: "label"}, label));
    return tokens.map((t, i) => {
      const node = element("span", {class: "tok", "data-side": side, "data-index": i}, t);
      node.addEventListener("mouseenter", () => highlight(side, i));
      row.appendChild(node);
      return node;
    });
  }
  function draw() {
    weights = headWeights(bytes, module, head.value);
    const [, tq, tk] = module.shape;
    if (module.role === "grid") {
      queryTokens = tokenRow(queries, "words", example.queries, "query");
      keyTokens = [];
      keys.innerHTML = "";
      drawImage(null);
      return;
    }
    const source = example.source, output = example.output;
    const [q, k] = {cross: [output, source], source_self: [source, source], target_self: [output, output]}[module.role] || [output, source];
    queryTokens = tokenRow(queries, module.role === "source_self" ? "source" : "output", q.slice(0, tq), "query");
    keyTokens = tokenRow(keys, module.role === "target_self" ? "output" : "source", k.slice(0, tk), "key");
    const scale = Math.max(4, Math.min(16, Math.floor(480 / Math.max(tq, tk))));
    canvas.width = tk * scale; canvas.height = tq * scale;
    const context = canvas.getContext("2d");
    for (let i = 0; i < tq; i++) for (let j = 0; j < tk; j++) {
      const v = Math.round(255 * (1 - weights[i * tk + j]));
      context.fillStyle = `rgb(${v},${v},${v})`;
      context.fillRect(j * scale, i * scale, scale, scale);
    }
    canvas.dataset.scale = scale;
    if (active) highlight(active[0], active[1]);
  }
  function drawImage(word) {
    const [height, width, channels] = example.image.shape;
    const [gh, gw] = example.grid;
    const scale = Math.max(1, Math.floor(480 / Math.max(width, height)));
    canvas.width = width * scale; canvas.height = height * scale;
    const context = canvas.getContext("2d");
    const pixels = context.createImageData(width, height);
    for (let p = 0; p < width * height; p++) for (let c = 0; c < 3; c++) {
      pixels.data[4 * p + c] = bytes[example.image.offset + p * channels + (channels === 1 ? 0 : c)];
    }
    for (let p = 0; p < width * height; p++) pixels.data[4 * p + 3] = 255;
    const small = document.createElement("canvas");
    small.width = width; small.height = height;
    small.getContext("2d").putImageData(pixels, 0, 0);
    context.imageSmoothingEnabled = false;
    context.drawImage(small, 0, 0, width * scale, height * scale);
    if (word === null) return;
    const [, , cells] = module.shape;
    let top = 0;
    for (let c = 0; c < cells; c++) top = Math.max(top, weights[word * cells + c]);
    for (let c = 0; c < cells; c++) {
      const w = weights[word * cells + c] / Math.max(top, 1e-6);
      context.fillStyle = `rgba(255, 80, 0, ${(0.65 * w).toFixed(3)})`;
      const x = (c % gw) * width / gw * scale, y = Math.floor(c / gw) * height / gh * scale;
      context.fillRect(x, y, width / gw * scale, height / gh * scale);
    }
    const box = (example.boxes || [])[word];
    if (box) {
      context.strokeStyle = "#2ca02c"; context.lineWidth = 2;
      context.strokeRect(box[0] * scale, box[1] * scale, (box[2] - box[0]) * scale, (box[3] - box[1]) * scale);
    }
  }
  function highlight(side, index) {
    active = [side, index];
    const [, tq, tk] = module.shape;
    queryTokens.concat(keyTokens).forEach((n) => { n.classList.remove("active", "gold"); n.style.background = ""; delete n.dataset.w; });
    (side === "query" ? queryTokens : keyTokens)[index].classList.add("active");
    if (module.role === "grid") { drawImage(index); return; }
    const shown = side === "query" ? keyTokens.map((n, j) => weights[index * tk + j]) : queryTokens.map((n, i) => weights[i * tk + index]);
    const largest = Math.max(...shown);
    (side === "query" ? keyTokens : queryTokens).forEach((n, j) => shade(n, shown[j], largest));
    if (module.role === "cross" && example.alignment) {
      for (const [t0, t1, s0, s1] of example.alignment) {
        const inside = side === "query" ? t0 <= index && index < t1 : s0 <= index && index < s1;
        if (!inside) continue;
        const [from, to, nodes] = side === "query" ? [s0, s1, keyTokens] : [t0, t1, queryTokens];
        for (let j = from; j < Math.min(to, nodes.length); j++) nodes[j].classList.add("gold");
      }
    }
    const context = canvas.getContext("2d"), scale = +canvas.dataset.scale;
    draw.outline && context.putImageData(draw.outline, 0, 0);
    draw.outline = context.getImageData(0, 0, canvas.width, canvas.height);
    context.strokeStyle = "#d62728"; context.lineWidth = 2;
    if (side === "query") context.strokeRect(1, index * scale + 1, tk * scale - 2, scale - 2);
    else context.strokeRect(index * scale + 1, 1, scale - 2, tq * scale - 2);
  }
  kind.addEventListener("change", () => { draw.outline = null; active = null; fillLayers(); });
  layer.addEventListener("change", () => { draw.outline = null; fillHeads(); });
  head.addEventListener("change", () => { draw.outline = null; draw(); });
  fillLayers();
  root.dataset.rendered = "1";
}
document.querySelectorAll("details.example").forEach((details) => {
  details.addEventListener("toggle", () => { if (details.open) openExplorer(details); });
});
const first = document.querySelector("details.example");
if (first) first.open = true;
