//! A VM guest's network, from `dsec.net=<ip>/<prefix>,<gateway>` on the kernel command
//! line: `eth0` gets the address, the default route goes to the gateway, and
//! `/etc/resolv.conf` names the gateway (which passes DNS on to the node's proxy). Every VM
//! and every fork copy has the same address: the edge puts each VM in a network namespace
//! of its own that translates it to the sandbox's.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetSpec {
    pub ip: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Ipv4Addr,
}

/// The `dsec.net=` value of a kernel command line, if there is one.
pub fn from_cmdline(cmdline: &str) -> Option<Result<NetSpec, String>> {
    let v = cmdline
        .split_whitespace()
        .find_map(|w| w.strip_prefix("dsec.net="))?;
    Some(parse(v))
}

fn parse(v: &str) -> Result<NetSpec, String> {
    let bad = || format!("dsec.net={v:?} is not <ip>/<prefix>,<gateway>");
    let (cidr, gw) = v.split_once(',').ok_or_else(bad)?;
    let (ip, prefix) = cidr.split_once('/').ok_or_else(bad)?;
    let spec = NetSpec {
        ip: ip.parse().map_err(|_| bad())?,
        prefix: prefix.parse().ok().filter(|p| *p <= 32).ok_or_else(bad)?,
        gateway: gw.parse().map_err(|_| bad())?,
    };
    Ok(spec)
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut r: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in r.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    r
}

fn sockaddr(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size on Linux; this is how the
    // ioctls take an IPv4 address.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

struct Sock(i32);

impl Drop for Sock {
    fn drop(&mut self) {
        // SAFETY: closing the socket this struct owns.
        unsafe { libc::close(self.0) };
    }
}

impl Sock {
    fn ioctl<T>(&self, req: libc::c_ulong, arg: &mut T, what: &str) -> Result<(), String> {
        // SAFETY: `arg` is the struct this request takes.
        if unsafe { libc::ioctl(self.0, req, arg as *mut T) } != 0 {
            return Err(format!("{what}: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    fn up(&self, name: &str) -> Result<(), String> {
        let mut r = ifreq(name);
        self.ioctl(libc::SIOCGIFFLAGS, &mut r, &format!("flags of {name}"))?;
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        unsafe { r.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
        self.ioctl(libc::SIOCSIFFLAGS, &mut r, &format!("bringing {name} up"))
    }
}

/// Configures `eth0`, the default route and the resolver; waits up to 5 s for `eth0`.
pub fn configure(spec: &NetSpec) -> Result<(), String> {
    // SAFETY: a plain socket for interface ioctls.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!("socket: {}", std::io::Error::last_os_error()));
    }
    let s = Sock(fd);
    s.up("lo")?;
    let t0 = Instant::now();
    while !std::path::Path::new("/sys/class/net/eth0").exists() {
        if t0.elapsed() > Duration::from_secs(5) {
            return Err("no eth0 (is virtio_net loaded?)".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut r = ifreq("eth0");
    r.ifr_ifru.ifru_addr = sockaddr(spec.ip);
    s.ioctl(libc::SIOCSIFADDR, &mut r, "setting eth0's address")?;
    let mask = if spec.prefix == 0 {
        0
    } else {
        u32::MAX << (32 - spec.prefix as u32)
    };
    let mut r = ifreq("eth0");
    r.ifr_ifru.ifru_netmask = sockaddr(Ipv4Addr::from(mask));
    s.ioctl(libc::SIOCSIFNETMASK, &mut r, "setting eth0's netmask")?;
    s.up("eth0")?;
    // SAFETY: rtentry is plain data; all zeroes is a valid value.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr(spec.gateway);
    rt.rt_flags = (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort;
    s.ioctl(libc::SIOCADDRT, &mut rt, "adding the default route")?;
    // The image's resolv.conf may be a link to a resolver the guest does not run.
    let _ = std::fs::remove_file("/etc/resolv.conf");
    std::fs::write(
        "/etc/resolv.conf",
        format!(
            "nameserver {}\noptions timeout:2 attempts:2\n",
            spec.gateway
        ),
    )
    .map_err(|e| format!("writing /etc/resolv.conf: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_specs_come_from_the_command_line() {
        let c = "console=ttyS0 quiet dsec.net=172.16.0.2/30,172.16.0.1 dsec.rw_mb=1024";
        assert_eq!(
            from_cmdline(c).unwrap().unwrap(),
            NetSpec {
                ip: Ipv4Addr::new(172, 16, 0, 2),
                prefix: 30,
                gateway: Ipv4Addr::new(172, 16, 0, 1)
            }
        );
        assert!(from_cmdline("console=ttyS0").is_none());
        for bad in [
            "dsec.net=172.16.0.2",
            "dsec.net=172.16.0.2/33,1.1.1.1",
            "dsec.net=x/30,1.1.1.1",
            "dsec.net=1.2.3.4/30,gw",
        ] {
            assert!(from_cmdline(bad).unwrap().is_err(), "{bad}");
        }
    }
}
