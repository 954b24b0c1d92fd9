//! PNG charts (plotters, bitmap backend). Text is drawn with a TrueType font found on the system
//! (DejaVu Sans or Liberation Sans; `STARCKPT_CHART_FONT` names another), loaded once.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, bail};
use plotters::prelude::*;
use plotters::style::FontStyle;

const FONT_FILES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers a system font as plotters' "sans-serif", once per process.
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let candidates: Vec<String> = std::env::var("STARCKPT_CHART_FONT")
                .into_iter()
                .chain(FONT_FILES.iter().map(|f| f.to_string()))
                .collect();
            let Some(bytes) = candidates.iter().find_map(|path| std::fs::read(path).ok()) else {
                return Err(format!(
                    "no TrueType font for the chart: install fonts-dejavu-core or set STARCKPT_CHART_FONT \
                     (looked for {})",
                    candidates.join(", ")
                ));
            };
            // plotters keeps fonts for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| "the chart font is not a TrueType font plotters can read".to_string())
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Bars of throughput (GB/s) in groups (a phase, then each series measured for it): the
/// last series of a group is drawn in blue (ours), the others in grey (baselines).
pub fn throughput(path: &Path, title: &str, groups: &[(&str, Vec<(&str, f64)>)]) -> anyhow::Result<()> {
    if groups.iter().flat_map(|(_, bars)| bars).any(|(_, v)| !v.is_finite() || *v < 0.0) {
        bail!("throughput values must be finite and non-negative");
    }
    register_font()?;
    let bars: Vec<(String, f64, bool)> = groups
        .iter()
        .flat_map(|(phase, bars)| {
            let last = bars.len().saturating_sub(1);
            bars.iter().enumerate().map(move |(i, (name, value))| (format!("{phase}: {name}"), *value, i == last))
        })
        .collect();
    let top = bars.iter().map(|(_, v, _)| *v).fold(0.0f64, f64::max).max(0.1) * 1.2;
    let draw = || -> Result<(), Box<dyn std::error::Error + '_>> {
        let root = BitMapBackend::new(path, (1200, 640)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 26))
            .margin(20)
            .x_label_area_size(60)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..bars.len() as f64, 0f64..top)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc("GB/s")
            .axis_desc_style(("sans-serif", 18))
            .label_style(("sans-serif", 15))
            .draw()?;
        let ours = RGBColor(31, 119, 180);
        let theirs = RGBColor(160, 160, 160);
        chart.draw_series(bars.iter().enumerate().map(|(i, (_, value, is_ours))| {
            let color = if *is_ours { ours } else { theirs };
            Rectangle::new([(i as f64 + 0.15, 0.0), (i as f64 + 0.85, *value)], color.filled())
        }))?;
        chart.draw_series(bars.iter().enumerate().map(|(i, (_, value, _))| {
            Text::new(format!("{value:.2}"), (i as f64 + 0.35, value + top * 0.02), ("sans-serif", 16))
        }))?;
        for (i, (label, _, _)) in bars.iter().enumerate() {
            let (phase, name) = label.split_once(": ").unwrap_or((label, ""));
            let style = ("sans-serif", 14).into_font();
            root.draw(&Text::new(name.to_string(), chart.backend_coord(&(i as f64 + 0.1, 0.0)), style.clone()))?;
            let below = chart.backend_coord(&(i as f64 + 0.1, 0.0));
            root.draw(&Text::new(phase.to_string(), (below.0, below.1 + 20), style))?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("{e}")).with_context(|| format!("draw the chart {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chart.png");
        let groups =
            [("persist", vec![("O_DIRECT write", 1.5), ("starckpt", 1.2)]), ("restore", vec![("starckpt", 0.7)])];
        // (Needs a TrueType font: .ci/run installs fonts-dejavu-core.)
        throughput(&path, "test", &groups).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(png.len() > 5000, "a chart with bars and text, not an empty image");
        assert!(throughput(&path, "bad", &[("x", vec![("nan", f64::NAN)])]).is_err());
    }
}
