//! Human output: tables and durations.

use std::sync::atomic::{AtomicBool, Ordering};

use comfy_table::{ColumnConstraint, ContentArrangement, Table, presets::UTF8_BORDERS_ONLY};

/// The width tables fit when the output is not a terminal (whose own width is used).
pub const COLUMNS: u16 = 80;

static WIDE: AtomicBool = AtomicBool::new(false);

/// `--wide`: tables as wide as their cells, never wrapped.
pub fn set_wide(wide: bool) {
    WIDE.store(wide, Ordering::Relaxed);
}

/// A table that fits the terminal (80 columns when the output is not one), long cells
/// wrapped, unless `--wide`.
pub fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut t = Table::new();
    t.load_style(UTF8_BORDERS_ONLY);
    if !WIDE.load(Ordering::Relaxed) {
        t.set_content_arrangement(ContentArrangement::Dynamic);
        if t.width().is_none() {
            t.set_width(COLUMNS);
        }
    }
    t.set_header(header.to_vec());
    // An id is copied whole into the next command: it never wraps.
    for (i, h) in header.iter().enumerate() {
        if *h == "id"
            && let Some(c) = t.column_mut(i)
        {
            c.set_constraint(ColumnConstraint::ContentWidth);
        }
    }
    for r in rows {
        t.add_row(r);
    }
    t.to_string()
}

pub fn ago_ms(ms: u64) -> String {
    let now = dsec_image::store::now_ms();
    human_secs(now.saturating_sub(ms) / 1000) + " ago"
}

pub fn in_ms(ms: u64) -> String {
    let now = dsec_image::store::now_ms();
    "in ".to_string() + &human_secs(ms.saturating_sub(now) / 1000)
}

pub fn human_secs(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h{}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d", s / 86400),
    }
}

pub fn print_json<T: serde::Serialize>(v: &T) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}
