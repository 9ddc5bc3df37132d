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

/// The terminal's columns and rows, from stdout (else stdin); 80x24 when neither is a
/// terminal.
pub fn term_size() -> (u16, u16) {
    for fd in [libc::STDOUT_FILENO, libc::STDIN_FILENO] {
        // SAFETY: TIOCGWINSZ writes a winsize into `ws`.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        let ok = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0;
        if ok && ws.ws_col > 0 && ws.ws_row > 0 {
            return (ws.ws_col, ws.ws_row);
        }
    }
    (COLUMNS, 24)
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
