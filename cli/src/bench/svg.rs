//! Line charts as plain SVG text for docs/performance.md (no plotting dependency: axes,
//! log or linear scales, a legend, dashed baselines).

use std::fmt::Write as _;

/// One line of a chart.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// `(x, y)` points, drawn in order; non-finite or (on a log axis) non-positive values
    /// are skipped.
    pub points: Vec<(f64, f64)>,
    /// Palette index (a store's claims and its raw baseline share a colour).
    pub color: usize,
    /// Dashed (baselines).
    pub dashed: bool,
}

/// A chart's axes.
pub struct Axes<'a> {
    /// Title above the plot.
    pub title: &'a str,
    /// X axis label.
    pub x_label: &'a str,
    /// Y axis label.
    pub y_label: &'a str,
    /// Logarithmic x.
    pub log_x: bool,
    /// Logarithmic y.
    pub log_y: bool,
}

const PALETTE: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];
const W: f64 = 760.0;
const H: f64 = 420.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;

/// `1.5k`, `20M`, `0.25`: short labels for ticks.
pub fn short(v: f64) -> String {
    let a = v.abs();
    let (x, unit) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let s = if x.abs() >= 100.0 || x.fract() == 0.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    };
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    };
    format!("{s}{unit}")
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A scale: data range to pixels, and its ticks.
struct Scale {
    log: bool,
    lo: f64,
    hi: f64,
}

impl Scale {
    fn new(values: impl Iterator<Item = f64>, log: bool) -> Self {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            (lo, hi) = (1.0, 10.0);
        }
        if log {
            let lo = 10f64.powf(lo.log10().floor());
            let hi = 10f64.powf(hi.log10().ceil()).max(lo * 10.0);
            Self { log, lo, hi }
        } else {
            let hi = if hi <= 0.0 { 1.0 } else { hi * 1.1 };
            Self {
                log,
                lo: lo.min(0.0),
                hi,
            }
        }
    }

    fn frac(&self, v: f64) -> f64 {
        if self.log {
            (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }

    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let mut t = Vec::new();
            let mut v = self.lo;
            while v <= self.hi * 1.0001 {
                t.push(v);
                v *= 10.0;
            }
            t
        } else {
            let raw = (self.hi - self.lo) / 5.0;
            let mag = 10f64.powf(raw.log10().floor());
            let step = [1.0, 2.0, 5.0, 10.0]
                .iter()
                .map(|m| m * mag)
                .find(|s| *s >= raw)
                .unwrap_or(raw);
            let mut t = Vec::new();
            let mut v = (self.lo / step).ceil() * step;
            while v <= self.hi {
                t.push(v);
                v += step;
            }
            t
        }
    }
}

/// A line chart.
pub fn line_chart(axes: &Axes<'_>, series: &[Series]) -> String {
    let ok = |log: bool, v: f64| v.is_finite() && (!log || v > 0.0);
    let pts = || {
        series
            .iter()
            .flat_map(|s| s.points.iter())
            .filter(|(x, y)| ok(axes.log_x, *x) && ok(axes.log_y, *y))
    };
    let xs = Scale::new(pts().map(|p| p.0), axes.log_x);
    let ys = Scale::new(pts().map(|p| p.1), axes.log_y);
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let px = |x: f64| LEFT + xs.frac(x) * pw;
    let py = |y: f64| TOP + ph - ys.frac(y) * ph;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        LEFT + pw / 2.0,
        escape(axes.title)
    );
    for t in xs.ticks() {
        let x = px(t);
        let _ = writeln!(
            o,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#e0e0e0"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph,
            TOP + ph + 16.0,
            short(t)
        );
    }
    for t in ys.ticks() {
        let y = py(t);
        let _ = writeln!(
            o,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            short(t)
        );
    }
    let _ = writeln!(
        o,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        H - 12.0,
        escape(axes.x_label)
    );
    let _ = writeln!(
        o,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + ph / 2.0,
        escape(axes.y_label)
    );
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[s.color % PALETTE.len()];
        let dash = if s.dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let path: Vec<String> = s
            .points
            .iter()
            .filter(|(x, y)| ok(axes.log_x, *x) && ok(axes.log_y, *y))
            .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
            .collect();
        if !path.is_empty() {
            let _ = writeln!(
                o,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
                path.join(" ")
            );
            for p in &path {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(o, r#"<circle cx="{x}" cy="{y}" r="3" fill="{color}"/>"#);
            }
        }
        let ly = TOP + 10.0 + i as f64 * 18.0;
        let lx = LEFT + pw + 12.0;
        let _ = writeln!(
            o,
            r#"<line x1="{lx}" y1="{ly}" x2="{:.1}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 24.0,
            lx + 30.0,
            ly + 4.0,
            escape(&s.name)
        );
    }
    o.push_str("</svg>\n");
    o
}
