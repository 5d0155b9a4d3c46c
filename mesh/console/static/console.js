// The deltamesh console's page: asks the console for its newest snapshot every poll_s seconds and
// redraws the four panels from it. Everything shown comes from that JSON and is set as text (never
// as HTML), so names and errors a service reports cannot inject markup. No library, no network
// access beyond the console itself.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let pollS = 1;

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function td(text, cls) { return el("td", cls ? { class: cls } : {}, text); }
function num(v, digits) { return v === null || v === undefined ? "-" : Number(v).toFixed(digits === undefined ? 0 : digits); }

function rate(bps) {
  if (!bps) return "-";
  for (const [p, s] of [["G", 1e9], ["M", 1e6], ["k", 1e3]]) if (bps >= s) return (bps / s).toFixed(1) + " " + p + "B/s";
  return bps.toFixed(0) + " B/s";
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  for (const [p, s] of [["G", 1e9], ["M", 1e6], ["k", 1e3]]) if (n >= s) return (n / s).toFixed(1) + " " + p + "B";
  return n + " B";
}

function label(id) { return id.replace(/^(gateway|pool):/, ""); }

function replaceRows(table, rows) {
  const body = document.querySelector(table + " tbody");
  body.replaceChildren(...rows);
}

function drawGraph(graph) {
  const gateways = graph.nodes.filter(n => n.kind === "gateway").sort((a, b) => a.depth - b.depth || a.name.localeCompare(b.name));
  const pools = graph.nodes.filter(n => n.kind === "pool");
  const colW = 250, top = 30, boxW = 150, boxH = 34, poolGap = 30;
  const at = {};
  gateways.forEach((g, i) => { at["gateway:" + g.name] = { x: 20 + i * colW, y: top }; });
  const perGateway = {};
  for (const p of pools) {
    const gw = at["gateway:" + p.region];
    const k = (perGateway[p.region] = (perGateway[p.region] || 0) + 1);
    at[p.id] = { x: (gw ? gw.x : 20) + 40, y: top + boxH + 30 + (k - 1) * poolGap };
  }
  const most = Math.max(0, ...Object.values(perGateway));
  const width = Math.max(600, 40 + gateways.length * colW), height = top + boxH + 50 + most * poolGap;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "mesh graph" });
  for (const e of graph.links) {
    const a = at[e.from], b = at[e.to];
    if (!a || !b) continue;
    const g = svg("g", { "data-link": label(e.from) + "->" + label(e.to) });
    if (e.kind === "relay") {
      const x1 = a.x + boxW, y = a.y + boxH / 2, x2 = b.x;
      g.append(svg("line", { x1, y1: y, x2, y2: b.y + boxH / 2, class: "edge h-" + e.health }));
      g.append(svg("text", { x: (x1 + x2) / 2, y: y - 12, "text-anchor": "middle", class: "label" },
        `rtt ${num(e.rtt_p50_ms, 1)}/${num(e.rtt_p95_ms, 1)} ms`));
      g.append(svg("text", { x: (x1 + x2) / 2, y: y + 18, "text-anchor": "middle", class: "label" },
        `${rate(e.throughput_bps)} · ${e.errors || 0} err`));
    } else {
      const x = a.x + 20;
      g.append(svg("polyline", { points: `${x},${a.y + boxH} ${x},${b.y} ${b.x - 8},${b.y}`, fill: "none", class: "edge h-" + e.health, "stroke-width": 2 }));
      g.append(svg("circle", { cx: b.x, cy: b.y, r: 7, class: "pool h-" + e.health }));
      g.append(svg("text", { x: b.x + 14, y: b.y + 4 }, label(e.to)));
      g.append(svg("text", { x: b.x + 14 + 7 * label(e.to).length + 8, y: b.y + 4, class: "label" },
        e.rtt_p50_ms === null || e.rtt_p50_ms === undefined ? "" : `rtt ${num(e.rtt_p50_ms, 1)} ms`));
    }
    root.append(g);
  }
  for (const g of gateways) {
    const p = at["gateway:" + g.name];
    const cls = "node" + (g.read ? "" : " unread") + (g.origin ? " origin" : "");
    const box = svg("g", { "data-gateway": g.name });
    box.append(svg("rect", { x: p.x, y: p.y, width: boxW, height: boxH, rx: 5, class: cls + (g.ok === false ? " h-down" : "") }));
    box.append(svg("text", { x: p.x + 10, y: p.y + 15 }, g.name + (g.origin ? " (origin)" : "")));
    box.append(svg("text", { x: p.x + 10, y: p.y + 28, class: "label" },
      g.ok === false ? "not answering" : g.read ? (g.access === "metrics" ? "read: metrics" : "read") : "found via links"));
    root.append(box);
  }
  document.getElementById("graph").replaceChildren(root);
}

function drawLinks(graph) {
  replaceRows("#links-table", graph.links.map(e => {
    const tr = el("tr", { "data-link": label(e.from) + "->" + label(e.to) });
    tr.append(td(label(e.from) + " → " + label(e.to)), td(e.kind),
      td(`${num(e.rtt_p50_ms, 2)} / ${num(e.rtt_p95_ms, 2)}`, "num rtt"), td(rate(e.throughput_bps), "num"),
      td(bytes(e.bytes_total), "num"), td(e.errors || 0, "num"), td(e.health, "health " + e.health),
      td((e.last_error || "").slice(0, 80), "wrap"));
    return tr;
  }));
}

function drawPools(pools) {
  replaceRows("#pools-table", pools.map(p => {
    const tr = el("tr", { "data-pool": p.name, "data-state": p.state });
    const proof = p.proof ? (p.proof.drifted ? "drifted: " : "") + (p.proof.text || "not checked yet")
      : (p.status_read ? "no engine check" : "-");
    const proofCls = p.proof && p.proof.ok === false ? "proof-failed" : p.proof && p.proof.ok ? "proof-ok" : "";
    const mm = p.mismatch ? num(p.mismatch.abs, 4) + (p.mismatch.flagged ? " flagged" : "") : "-";
    tr.append(td(p.name), td(p.region), td(p.model), td(p.version === null ? "-" : "v" + p.version, "num version"),
      td(p.head === null ? "-" : "v" + p.head, "num head"),
      td(p.state + (p.why ? " (" + p.why + ")" : ""), "state state-" + p.state), td(proof, "wrap proof " + proofCls),
      td(mm, "num"), td(num(p.leased_per_min, 1), "num"), td(num(p.reported_per_min, 1), "num"),
      td(p.last_seen_s === null || p.last_seen_s === undefined ? "-" : num(p.last_seen_s, 1) + " s ago", "num"));
    return tr;
  }));
}

function drawVersions(models) {
  const heads = Object.entries(models).map(([m, info]) => `${m}: head ${info.head === null ? "-" : "v" + info.head}`);
  document.getElementById("heads").textContent = heads.join(" · ");
  const rows = [];
  for (const [model, info] of Object.entries(models)) {
    const versions = info.versions || [];
    const scale = Math.max(0.001, ...versions.map(v => v.everywhere_s || 0));
    for (const v of versions) {
      const row = el("div", { class: "timeline", "data-model": model, "data-version": v.version });
      row.append(el("span", {}, (Object.keys(models).length > 1 ? model + " " : "") + "v" + v.version));
      const bar = svg("svg", { viewBox: "0 0 1000 18", preserveAspectRatio: "none" });
      const x = s => 6 + 988 * (s || 0) / scale;
      bar.append(svg("line", { x1: 6, y1: 9, x2: x(v.everywhere_s), y2: 9, class: "axis" }));
      if (v.slowest && v.after_s[v.slowest.from] !== undefined && v.after_s[v.slowest.to] !== undefined) {
        bar.append(svg("line", { x1: x(v.after_s[v.slowest.from]), y1: 9, x2: x(v.after_s[v.slowest.to]), y2: 9, class: "hop" }));
      }
      for (const [place, s] of Object.entries(v.after_s)) {
        if (s === null) continue;
        const mark = place.startsWith("gateway:")
          ? svg("rect", { x: x(s) - 4, y: 5, width: 8, height: 8, class: "gw", transform: `rotate(45 ${x(s)} 9)` })
          : svg("circle", { cx: x(s), cy: 9, r: 4, class: "pl" });
        mark.append(svg("title", {}, `${label(place)}: ${s.toFixed(2)} s`));
        bar.append(mark);
      }
      row.append(bar);
      const missing = (v.missing || []).map(label);
      const reached = missing.length ? `not yet at ${missing.join(", ")}; the rest in` : "everywhere in";
      const what = v.everywhere_s === null ? "not yet at the origin's listing"
        : `${reached} ${v.everywhere_s.toFixed(2)} s` + (v.slowest ? ` · slowest ${label(v.slowest.from)} → ${label(v.slowest.to)} ${v.slowest.seconds.toFixed(2)} s` : "");
      row.append(el("span", { class: "what" }, what));
      rows.push(row);
    }
  }
  document.getElementById("timelines").replaceChildren(...rows);
}

function drawBroker(broker) {
  const status = document.getElementById("broker-status");
  if (!broker) { status.textContent = "no broker configured"; replaceRows("#broker-table", []); return; }
  const tasks = broker.tasks ? ` · tasks: ${broker.tasks.exhausted ? "all issued" : "issuing"}` : "";
  status.textContent = (broker.ok ? "answering" : "not answering") + (broker.error ? ": " + broker.error : "") + tasks;
  replaceRows("#broker-table", Object.entries(broker.models).map(([m, b]) => {
    const tr = el("tr", { "data-policy": m });
    tr.append(td(m), td(b.version === null ? "-" : "v" + b.version, "num"), td(b.fresh_groups, "num"),
      td(b.fresh_samples, "num"), td(b.replay_samples, "num"), td(b.unacked_batches, "num"),
      td(num(b.ingest_per_min, 1), "num ingest"), td(num(b.batch_ms, 1), "num"),
      td(`${num(b.stale_dropped_total)} (${num(b.stale_per_min, 1)}/min)`, "num stale"));
    return tr;
  }));
  const bal = broker.balance;
  document.getElementById("balance").textContent = bal
    ? `autoscaling (the balance report): ${bal.decision}; ` + Object.entries(bal.models).map(([m, r]) =>
        `${m} waits ${num(100 * (r.wait_fraction || 0), 0)}% of its steps, wants ${r.target_gpus} GPUs`).join("; ")
    : (broker.balance_error || "");
}

function drawProblems(snap) {
  const items = [];
  for (const g of snap.gateways || []) if (g.error) items.push(`gateway ${g.region || g.url}: ${g.error}`);
  if (snap.broker && snap.broker.error) items.push(`broker: ${snap.broker.error}`);
  document.getElementById("problems").replaceChildren(...items.map(t => el("li", {}, t)));
}

function draw(snap) {
  if (!snap.generated_at) return;
  pollS = snap.poll_s || pollS;
  document.getElementById("updated").textContent = "updated " + new Date(snap.generated_at * 1000).toLocaleTimeString();
  drawProblems(snap);
  drawGraph(snap.graph);
  drawLinks(snap.graph);
  drawPools(snap.pools);
  drawVersions(snap.models);
  drawBroker(snap.broker);
}

async function poll() {
  try {
    const resp = await fetch("/api/snapshot", { cache: "no-store", credentials: "same-origin" });
    if (resp.status === 401) { window.location.assign("/login"); return; }
    if (resp.ok) draw(await resp.json());
  } catch (e) {
    document.getElementById("updated").textContent = "the console does not answer: " + e;
  }
  setTimeout(poll, pollS * 1000);
}

document.addEventListener("DOMContentLoaded", poll);
