//! A VM's network: QEMU runs inside the sandbox's network namespace (`dsec-<id>`, made by
//! the edge's network module like a container's, with the sandbox's address on `eth0`) and
//! gives the guest a tap device there. The guest has the same address in every VM and
//! every fork copy ([`GUEST_CIDR`], told on the kernel command line); the namespace
//! translates it to the sandbox's address on the way out, and sends DNS to the node's
//! proxy, so the node's egress rules and DNS policy hold for a VM as for a container.

use std::process::Command;

/// The guest's side and the namespace's side of the tap.
pub const GUEST_CIDR: &str = "172.16.0.2/30";
pub const TAP_ADDR: &str = "172.16.0.1";
pub const TAP: &str = "tap0";
/// One MAC for every guest and one for every tap (each VM is alone on its tap): a fork
/// copy's guest still has the tap's MAC in its ARP cache from the source's.
pub const GUEST_MAC: &str = "52:54:00:d5:ec:02";
pub const TAP_MAC: &str = "52:54:00:d5:ec:01";

/// The kernel command line's `dsec.net=` value.
pub fn cmdline() -> String {
    format!("dsec.net={GUEST_CIDR},{TAP_ADDR}")
}

/// Runs `argv` in the sandbox network namespace `ns` (pinned out of the host's mount
/// table, so not one `ip netns exec` sees).
fn run(ns: &str, argv: &[&str], input: Option<&str>) -> Result<(), String> {
    let path = crate::net::rtnl::netns_path(ns).map_err(|e| e.to_string())?;
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", path.display()))
        .arg("--")
        .args(argv);
    let out = match input {
        Some(text) => {
            use std::io::Write;
            let mut child = cmd
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| format!("running {}: {e}", argv.join(" ")))?;
            if let Some(mut i) = child.stdin.take() {
                i.write_all(text.as_bytes())
                    .map_err(|e| format!("writing to {}: {e}", argv[0]))?;
            }
            child.wait_with_output()
        }
        None => cmd.output(),
    }
    .map_err(|e| format!("running {}: {e}", argv.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "{} in namespace {ns}: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// The namespace's NAT: the guest's traffic leaves as the sandbox's address, its DNS goes
/// to the node side of the sandbox's veth (where the node redirects it to the proxy).
fn nat_script(node_side: &str, tap: &str) -> String {
    format!(
        "table ip dsecvm {{}}
delete table ip dsecvm
table ip dsecvm {{
  chain pre {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname \"{tap}\" ip daddr {TAP_ADDR} meta l4proto {{ tcp, udp }} th dport 53 dnat to {node_side}
  }}
  chain post {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname \"eth0\" masquerade
  }}
}}
"
    )
}

/// Makes the tap and the translation in namespace `ns`, in one process there (a fork of
/// many copies does this for each). Idempotent: a VM resumed from disk finds them there.
/// `node_side` is the gateway address of the sandbox's veth.
pub fn setup(ns: &str, node_side: &str) -> Result<(), String> {
    setup_tap(ns, node_side, TAP, None)
}

/// [`setup`] with the tap's name and, for a VMM that runs unprivileged (Firecracker in
/// its jail), the user and group that may attach to it.
pub fn setup_tap(
    ns: &str,
    node_side: &str,
    tap: &str,
    owner: Option<(u32, u32)>,
) -> Result<(), String> {
    let owner = owner
        .map(|(u, g)| format!(" user {u} group {g}"))
        .unwrap_or_default();
    let script = format!(
        "set -e
if ! ip link show {tap} >/dev/null 2>&1; then
  ip tuntap add dev {tap} mode tap{owner}
  ip link set {tap} address {TAP_MAC}
  ip addr add {TAP_ADDR}/30 dev {tap}
  ip link set {tap} up
fi
echo 1 > /proc/sys/net/ipv4/ip_forward
nft -f -
"
    );
    run(
        ns,
        &["sh", "-c", &script],
        Some(&nat_script(node_side, tap)),
    )
}

/// QEMU's arguments for the guest's network device (`bus`: `device` or `pci`).
pub fn qemu_args(bus: &str) -> [String; 4] {
    [
        "-netdev".into(),
        format!("tap,id=net0,ifname={TAP},script=no,downscript=no"),
        "-device".into(),
        format!("virtio-net-{bus},netdev=net0,mac={GUEST_MAC}"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nat_names_the_tap_and_the_node_side() {
        let s = nat_script("10.200.0.5", TAP);
        assert!(s.contains("iifname \"tap0\" ip daddr 172.16.0.1"));
        assert!(s.contains("dnat to 10.200.0.5"));
        assert!(s.contains("oifname \"eth0\" masquerade"));
        assert_eq!(cmdline(), "dsec.net=172.16.0.2/30,172.16.0.1");
        assert_eq!(
            qemu_args("pci")[3],
            "virtio-net-pci,netdev=net0,mac=52:54:00:d5:ec:02"
        );
    }
}
