// The SM timeline of a run's report: one lane per worker on a <canvas>, hover, zoom and pan, the critical path.
// Reads the trace from the page's #tl-data JSON; window.__timeline is the hook the browser tests drive.
(function(){
const D = JSON.parse(document.getElementById('tl-data').textContent);
const cv = document.getElementById('timeline'), wrap = document.getElementById('tl-wrap');
const tip = document.getElementById('tip'), ctx = cv.getContext('2d');
const N = D.id.length, LEFT = 58, TOP = 22;
const laneH = Math.max(4, Math.min(18, Math.floor(640 / Math.max(1, D.lanes))));
const H = TOP + D.lanes * laneH + 4;
let W = 800, t0 = 0, t1 = D.span > 0 ? D.span : 1, showCrit = true;
const laneStart = new Int32Array(D.lanes + 1);  // events are sorted by (lane, ts)
for (let i = 0, l = 0; l <= D.lanes; l++) { while (i < N && D.lane[i] < l) i++; laneStart[l] = i; }
const byOp = D.ops.map(() => []);
for (let i = 0; i < N; i++) byOp[D.op[i]].push(i);
const idx = new Map(); for (let i = 0; i < N; i++) idx.set(D.id[i], i);
const crit = D.crit.map(id => idx.get(id)).filter(i => i !== undefined);
function size(){ W = Math.max(300, wrap.clientWidth); const r = window.devicePixelRatio || 1;
  cv.width = W * r; cv.height = H * r; cv.style.width = W + 'px'; cv.style.height = H + 'px';
  ctx.setTransform(r, 0, 0, r, 0, 0); }
function sx(t){ return LEFT + (t - t0) * (W - LEFT - 8) / (t1 - t0); }
function draw(){
  ctx.clearRect(0, 0, W, H); ctx.font = '11px system-ui,sans-serif';
  ctx.fillStyle = '#f6f7f9';
  for (let l = 1; l < D.lanes; l += 2) ctx.fillRect(LEFT, TOP + l * laneH, W, laneH);
  const y0 = TOP, h = Math.max(1, laneH - 1);
  ctx.fillStyle = '#d8dbe0';  // waiting on counters before a start
  ctx.beginPath();
  for (let i = 0; i < N; i++) { const w = D.wait[i]; if (w <= 0) continue;
    const a = sx(D.ts[i] - w), b = sx(D.ts[i]); if (b < LEFT || a > W) continue;
    ctx.rect(Math.max(a, LEFT), y0 + D.lane[i] * laneH + h * 0.35, Math.max(b - Math.max(a, LEFT), 0.5), h * 0.3); }
  ctx.fill();
  for (let k = 0; k < byOp.length; k++) { const ev = byOp[k]; ctx.fillStyle = D.colors[k]; ctx.beginPath();
    for (let j = 0; j < ev.length; j++) { const i = ev[j]; const a = sx(D.ts[i]), b = sx(D.ts[i] + D.dur[i]);
      if (b < LEFT || a > W) continue; const x = Math.max(a, LEFT);
      ctx.rect(x, y0 + D.lane[i] * laneH, Math.max(b - x, 0.6), h); }
    ctx.fill(); }
  if (showCrit && crit.length) { ctx.strokeStyle = '#000'; ctx.lineWidth = 1.5; ctx.beginPath();
    for (const i of crit) { const a = sx(D.ts[i]), b = sx(D.ts[i] + D.dur[i]); if (b < LEFT || a > W) continue;
      ctx.rect(Math.max(a, LEFT), y0 + D.lane[i] * laneH, Math.max(b - Math.max(a, LEFT), 1), h); }
    ctx.stroke(); }
  ctx.fillStyle = '#fff'; ctx.fillRect(0, 0, LEFT, H); ctx.fillRect(0, 0, W, TOP);
  ctx.fillStyle = '#374151'; const every = Math.ceil(12 / laneH);
  for (let l = 0; l < D.lanes; l += every) ctx.fillText(D.laneNames[l], 4, TOP + l * laneH + Math.min(laneH, 12) - 1);
  const span = t1 - t0, step = Math.pow(10, Math.floor(Math.log10(span / 6)));
  const st = span / step > 30 ? step * 5 : span / step > 12 ? step * 2 : step;
  ctx.strokeStyle = '#e5e7eb'; ctx.lineWidth = 1; ctx.beginPath();
  for (let t = Math.ceil(t0 / st) * st; t <= t1; t += st) { const x = sx(t); ctx.moveTo(x, TOP - 4); ctx.lineTo(x, H);
    ctx.fillText((t >= 1000 ? (t / 1000).toFixed(st >= 1000 ? 0 : 2) + ' ms' : +t.toFixed(3) + ' µs'), x + 2, 12); }
  ctx.stroke();
}
let frame = 0; function redraw(){ if (!frame) frame = requestAnimationFrame(() => { frame = 0; draw(); }); }
function hit(mx, my){
  const l = Math.floor((my - TOP) / laneH); if (l < 0 || l >= D.lanes || mx < LEFT) return -1;
  const t = t0 + (mx - LEFT) * (t1 - t0) / (W - LEFT - 8), tol = 2 * (t1 - t0) / (W - LEFT - 8);
  let lo = laneStart[l], hi = laneStart[l + 1] - 1, k = -1;
  while (lo <= hi) { const m = (lo + hi) >> 1; if (D.ts[m] <= t + tol) { k = m; lo = m + 1; } else hi = m - 1; }
  if (k >= 0 && t <= D.ts[k] + D.dur[k] + tol) return k; return -1;
}
function describe(i){
  const lay = D.layer[i] >= 0 ? ' L' + D.layer[i] : '';
  return '#' + D.id[i] + ' ' + D.ops[D.op[i]] + lay + '\n' + D.laneNames[D.lane[i]] + '  start ' +
    D.ts[i].toFixed(2) + ' µs  dur ' + D.dur[i].toFixed(2) + ' µs\nwaited ' + D.wait[i].toFixed(2) + ' µs' +
    (D.estimated ? '  (estimated)' : '');
}
cv.addEventListener('mousemove', ev => { const r = cv.getBoundingClientRect();
  if (drag) { const dt = (drag.x - ev.clientX) * (t1 - t0) / (W - LEFT - 8); t0 = drag.t0 + dt; t1 = drag.t1 + dt;
    redraw(); return; }
  const i = hit(ev.clientX - r.left, ev.clientY - r.top);
  if (i < 0) { tip.style.display = 'none'; return; }
  tip.textContent = describe(i); tip.dataset.id = D.id[i]; tip.style.display = 'block';
  const tw = tip.offsetWidth, th = tip.offsetHeight;  // keep the tooltip inside the window
  tip.style.left = (ev.clientX + 14 + tw > window.innerWidth ? ev.clientX - tw - 10 : ev.clientX + 14) + 'px';
  tip.style.top = (ev.clientY + 12 + th > window.innerHeight ? ev.clientY - th - 8 : ev.clientY + 12) + 'px'; });
cv.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
cv.addEventListener('wheel', ev => { ev.preventDefault(); const r = cv.getBoundingClientRect();
  const f = Math.exp(ev.deltaY * 0.0015), mx = ev.clientX - r.left;
  const t = t0 + Math.max(0, mx - LEFT) * (t1 - t0) / (W - LEFT - 8);
  t0 = t - (t - t0) * f; t1 = t + (t1 - t) * f; if (t1 - t0 < 1e-3) t1 = t0 + 1e-3; redraw(); }, {passive: false});
let drag = null;
cv.addEventListener('mousedown', ev => { drag = {x: ev.clientX, t0, t1}; });
window.addEventListener('mouseup', () => { drag = null; });
cv.addEventListener('dblclick', () => { t0 = 0; t1 = D.span > 0 ? D.span : 1; redraw(); });
const cb = document.getElementById('crit-toggle');
if (cb) cb.addEventListener('change', () => { showCrit = cb.checked; redraw(); });
window.addEventListener('resize', () => { size(); draw(); });
size(); draw();
cv.dataset.lanes = D.lanes; cv.dataset.instructions = N;
window.__timeline = {
  lanes: D.lanes, instructions: N,
  positionOf(id){ const i = idx.get(id); if (i === undefined) return null; const r = cv.getBoundingClientRect();
    const a = Math.max(sx(D.ts[i]), LEFT), b = sx(D.ts[i] + D.dur[i]);
    return {x: r.left + (a + Math.max(b, a + 0.6)) / 2, y: r.top + TOP + D.lane[i] * laneH + laneH / 2}; },
  longest(){ let k = 0; for (let i = 1; i < N; i++) if (D.dur[i] > D.dur[k]) k = i; return D.id[k]; },
  benchmark(frames){ const s = performance.now(); for (let f = 0; f < frames; f++) { t1 = t1 * 0.999; draw(); }
    t0 = 0; t1 = D.span > 0 ? D.span : 1; draw(); return (performance.now() - s) / frames; },
};
})();
