"""`ds4-bench --plot`: prefill and generation t/s against ctx_tokens as an SVG (standard library
only), one pair of lines per backend measured in the run (two with `--peer`)."""
from __future__ import annotations

from xml.sax.saxutils import escape

# (prefill, gen) colours of the first and second backend: the peer's are the lighter pair
COLORS = (("#1f77b4", "#d62728"), ("#9ecae1", "#ff9896"))


def svg_plot(series, title: str = "ds4-bench") -> str:
    """series: the rows of one sweep, or {label: rows} for several (at most two); two polylines
    (prefill t/s, gen t/s) per sweep, axes, ticks and a legend."""
    if not isinstance(series, dict):
        series = {"": series}
    if not 1 <= len(series) <= len(COLORS):
        raise ValueError(f"svg_plot draws 1 to {len(COLORS)} sweeps, not {len(series)}")
    every = [r for rows in series.values() for r in rows]
    W, H, L, R, T, B = 760, 420, 70, 190, 40, 50
    pw, ph = W - L - R, H - T - B
    xs = [r["ctx_tokens"] for r in every]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x1 = x0 + 1
    ymax = max([r["prefill_tps"] for r in every] + [r["gen_tps"] for r in every] + [1e-9]) * 1.1

    def px(x):
        return L + (x - x0) / (x1 - x0) * pw

    def py(y):
        return T + ph - y / ymax * ph

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2:.1f}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
             f'<line x1="{L}" y1="{T + ph}" x2="{L + pw}" y2="{T + ph}" stroke="black"/>',
             f'<line x1="{L}" y1="{T}" x2="{L}" y2="{T + ph}" stroke="black"/>']
    for i in range(6):
        xv, yv = x0 + (x1 - x0) * i / 5, ymax * i / 5
        parts.append(f'<line x1="{px(xv):.1f}" y1="{T + ph}" x2="{px(xv):.1f}" y2="{T + ph + 5}" stroke="black"/>')
        parts.append(f'<text x="{px(xv):.1f}" y="{T + ph + 18}" text-anchor="middle">{xv:.0f}</text>')
        parts.append(f'<line x1="{L - 5}" y1="{py(yv):.1f}" x2="{L + pw}" y2="{py(yv):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{L - 8}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
    parts.append(f'<text x="{L + pw / 2:.1f}" y="{H - 10}" text-anchor="middle">ctx_tokens</text>')
    parts.append(f'<text x="16" y="{T + ph / 2:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 16 {T + ph / 2:.1f})">tokens/s</text>')
    line = 0
    for (name, rows), colors in zip(series.items(), COLORS):
        for key, what, color in zip(("prefill_tps", "gen_tps"), ("prefill t/s", "gen t/s"), colors):
            pts = " ".join(f"{px(r['ctx_tokens']):.1f},{py(r[key]):.1f}" for r in rows)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>')
            for r in rows:
                parts.append(f'<circle cx="{px(r["ctx_tokens"]):.1f}" cy="{py(r[key]):.1f}" r="3" fill="{color}"/>')
            ly = T + 10 + 20 * line
            line += 1
            label = f"{name} {what}" if name else what
            parts.append(f'<line x1="{L + pw + 15}" y1="{ly}" x2="{L + pw + 40}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
            parts.append(f'<text x="{L + pw + 45}" y="{ly + 4}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
