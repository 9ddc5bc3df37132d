//! `/proc/*/mountinfo` as the kernel writes it.

use std::path::Path;

/// `p` as mountinfo writes it: space, tab, newline and backslash as octal escapes.
pub fn escaped(p: &Path) -> String {
    p.to_string_lossy()
        .chars()
        .map(|ch| match ch {
            ' ' | '\t' | '\n' | '\\' => format!("\\{:03o}", ch as u32),
            ch => ch.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_kernels_escapes() {
        assert_eq!(
            super::escaped(std::path::Path::new("/a b\\c\td\ne")),
            "/a\\040b\\134c\\011d\\012e"
        );
    }
}
