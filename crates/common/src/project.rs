//! Project paths (`root/team-a/exp-1`) and the rules every component applies to them: a
//! key acts on its project and the projects inside it, and images belong to the project
//! their reference names.

/// The project every other one lies inside; its keys are the deployment's administrators.
pub const ROOT: &str = "root";

/// `a` is `b` or inside it.
pub fn within(a: &str, b: &str) -> bool {
    a == b || (a.starts_with(b) && a.as_bytes().get(b.len()) == Some(&b'/'))
}

/// Whether a key of project `key` may start sandboxes from, and see, images of project
/// `image` (the part of a reference before its name): those of its own project and the
/// projects inside it, and those of its ancestors up to `root` (shared base images).
/// Siblings' images are invisible. The root project reads every image.
pub fn may_read_images(key: &str, image: &str) -> bool {
    key == ROOT || within(image, key) || within(key, image)
}

/// Whether a key of project `key` may create, overwrite or delete images of project
/// `image`: only inside its own project subtree, so no tenant can replace a shared image.
pub fn may_write_images(key: &str, image: &str) -> bool {
    within(image, key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_is_by_path_component() {
        assert!(within("root/t1", "root") && within("root/t1", "root/t1"));
        assert!(!within("root/t10", "root/t1") && !within("root", "root/t1"));
    }
}
