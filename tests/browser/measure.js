// Measures a rendered report in the page: WCAG contrast of every text and whether any label is cut.
// Called as page.evaluate(source, rootSelector); returns {texts: [...], clipped: [...]}.
(rootSelector) => {
  const root = document.querySelector(rootSelector);
  if (!root) return { texts: [], clipped: [], error: "no " + rootSelector };

  function parse(c) {
    // rgb()/rgba(), and color(srgb r g b / a) which Chromium gives for color-mix().
    let m = c.match(/^rgba?\(([^)]+)\)$/);
    if (m) {
      const p = m[1].split(/[ ,\/]+/).filter(Boolean).map(Number);
      return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
    }
    m = c.match(/^color\(srgb ([^)]+)\)$/);
    if (m) {
      const p = m[1].split(/[ \/]+/).filter(Boolean).map(Number);
      return [p[0] * 255, p[1] * 255, p[2] * 255, p.length > 3 ? p[3] : 1];
    }
    return null;
  }
  function over(top, bottom) {
    const a = top[3];
    return [0, 1, 2].map((i) => top[i] * a + bottom[i] * (1 - a)).concat([1]);
  }
  function lum(c) {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]);
  }
  function background(el) {
    // Composite background colours from the element up to the first opaque one (the page is white under all).
    const layers = [];
    for (let n = el; n && n.nodeType === 1; n = n.parentElement) {
      const s = getComputedStyle(n);
      const c = parse(s.backgroundColor);
      if (c && c[3] > 0) {
        layers.push(c);
        if (c[3] >= 1) break;
      }
    }
    let bg = [255, 255, 255, 1];
    for (let i = layers.length - 1; i >= 0; i--) bg = over(layers[i], bg);
    return bg;
  }
  function visible(el) {
    if (!el.getClientRects().length) return false;
    for (let n = el; n && n.nodeType === 1; n = n.parentElement) {
      const s = getComputedStyle(n);
      if (s.visibility === "hidden" || s.display === "none" || Number(s.opacity) === 0) return false;
    }
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0;
  }
  const texts = [];
  const seen = new Set();
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let t = walker.nextNode(); t; t = walker.nextNode()) {
    if (!t.nodeValue.trim()) continue;
    const el = t.parentElement;
    if (!el || seen.has(el) || ["STYLE", "SCRIPT", "TITLE"].includes(el.tagName)) continue;
    seen.add(el);
    if (!visible(el)) continue;
    const s = getComputedStyle(el);
    const svgText = el instanceof SVGElement;
    const fg = parse(svgText ? s.fill : s.color);
    const bg = background(svgText ? el.ownerSVGElement : el);
    if (!fg) { texts.push({ text: t.nodeValue.trim().slice(0, 60), ratio: 0, color: s.color, bg: String(bg) }); continue; }
    const shown = over(fg, bg);
    const a = lum(shown), b = lum(bg);
    texts.push({
      text: t.nodeValue.trim().slice(0, 60),
      ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05),
      color: svgText ? s.fill : s.color,
      bg: "rgb(" + bg.slice(0, 3).map(Math.round).join(",") + ")",
      tag: el.tagName,
    });
  }
  for (const ta of root.querySelectorAll("textarea")) {
    if (!visible(ta) || !ta.value) continue;
    const fg = parse(getComputedStyle(ta).color), bg = background(ta);
    const a = lum(over(fg, bg)), b = lum(bg);
    texts.push({ text: "textarea: " + ta.value.slice(0, 40), ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05), tag: "TEXTAREA" });
  }
  // A label is clipped when its text is wider or taller than its box, when an ellipsis cuts it,
  // or when its box reaches past the report's right edge.
  const clipped = [];
  const edge = root.getBoundingClientRect().right + 1;
  const labels = root.querySelectorAll("button, .lm-TabBar-tab, .p-TabBar-tab, .lm-TabBar-tabLabel, .p-TabBar-tabLabel");
  let count = 0;
  for (const el of labels) {
    if (!el.getClientRects().length) continue;
    count++;
    const s = getComputedStyle(el);
    const r = el.getBoundingClientRect();
    const why = [];
    if (el.scrollWidth > el.clientWidth + 1) why.push("text wider than its box");
    if (el.scrollHeight > el.clientHeight + 1 && s.overflowY !== "visible") why.push("text taller than its box");
    if (s.textOverflow === "ellipsis" && el.scrollWidth > el.clientWidth) why.push("ellipsis");
    if (r.right > edge) why.push("past the report's right edge");
    if (r.width < 4 || s.display === "none") why.push("hidden");
    if (why.length) clipped.push({ label: el.innerText.trim().slice(0, 80), why: why.join(", "), width: r.width });
  }
  return { texts, clipped, labels: count };
}
