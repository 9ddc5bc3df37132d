//! Users named in requests, looked up in the sandbox's own /etc/passwd (aether is static
//! and has no NSS).

pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

fn parse(passwd: &str, want: &str) -> Option<User> {
    let numeric = want.parse::<u32>().ok();
    passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        let uid = f[2].parse().ok()?;
        let gid = f[3].parse().ok()?;
        (f[0] == want || numeric == Some(uid)).then(|| User {
            name: f[0].to_string(),
            uid,
            gid,
            home: f[5].to_string(),
        })
    })
}

/// A user by name or uid; a uid with no passwd entry runs with gid = uid and HOME=/.
pub fn lookup(user: &str) -> Result<User, String> {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    if let Some(u) = parse(&passwd, user) {
        return Ok(u);
    }
    match user.parse::<u32>() {
        Ok(uid) => Ok(User {
            name: user.to_string(),
            uid,
            gid: uid,
            home: "/".into(),
        }),
        Err(_) => Err(format!(
            "user {user:?} does not exist in the sandbox's /etc/passwd; give a user name from it or a numeric uid"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_users_by_name_and_uid() {
        let p = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\nbad line\n";
        let u = parse(p, "nobody").unwrap();
        assert_eq!(
            (u.uid, u.gid, u.home.as_str()),
            (65534, 65534, "/nonexistent")
        );
        assert_eq!(parse(p, "0").unwrap().name, "root");
        assert!(parse(p, "alice").is_none());
    }
}
