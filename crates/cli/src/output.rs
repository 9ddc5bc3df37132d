//! Human output: tables and durations.

use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};

pub fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut t = Table::new();
    t.load_style(UTF8_BORDERS_ONLY);
    t.set_header(header.to_vec());
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
