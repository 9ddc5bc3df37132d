//! Network namespaces, links, addresses and routes made in-process: rtnetlink messages
//! (`netlink-packet-route`) on a netlink socket of the calling thread's namespace, and a
//! named namespace: a file under [`NETNS_DIR`] with the namespace bind-mounted on it in
//! the sandboxes' mount namespace ([`crate::mountns`]), so that a node of thousands of
//! sandboxes has no mount of theirs in its own table. A sandbox's network costs a
//! handful of messages to the kernel, no `ip` process.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage, AddressScope};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
    RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use super::netlink::NetlinkError;

/// Where sandbox network namespaces are pinned (the mounts are in the sandboxes' mount
/// namespace: the host sees empty files; [`netns_path`] is where it reaches them).
pub const NETNS_DIR: &str = "/run/dsec/netns";

/// A route netlink socket in the calling thread's network namespace.
pub struct Rtnl {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl Rtnl {
    pub fn open() -> Result<Rtnl, NetlinkError> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind_auto()?;
        sock.connect(&SocketAddr::new(0, 0))?;
        // The kernel answers at once; a bound keeps a create from hanging on a lost answer.
        let tv = libc::timeval {
            tv_sec: 10,
            tv_usec: 0,
        };
        // SAFETY: setsockopt with a timeval of the size given, on a socket we own.
        let r = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error().into());
        }
        Ok(Rtnl {
            sock,
            seq: 0,
            buf: vec![0; 1 << 16],
        })
    }

    /// Sends `msg` asking for an acknowledgement and waits for it; `what` names it in
    /// an error.
    fn request(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
        what: &str,
    ) -> Result<(), NetlinkError> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        packet.finalize();
        let mut out = vec![0u8; packet.buffer_len()];
        packet.serialize(&mut out);
        self.sock.send(&out, 0)?;
        loop {
            let n = self.sock.recv(&mut &mut self.buf[..], 0).map_err(|e| {
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) {
                    NetlinkError::Timeout {
                        what: what.to_string(),
                    }
                } else {
                    NetlinkError::Io(e)
                }
            })?;
            let mut at = 0;
            while at < n {
                let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&self.buf[at..n])
                    .map_err(|e| NetlinkError::Other(format!("a malformed netlink answer: {e}")))?;
                let len = m.header.length as usize;
                if m.header.sequence_number == self.seq
                    && let NetlinkPayload::Error(e) = m.payload
                {
                    return match e.code {
                        None => Ok(()),
                        Some(code) => Err(NetlinkError::Refused {
                            what: what.to_string(),
                            source: io::Error::from_raw_os_error(-code.get()),
                        }),
                    };
                }
                if len == 0 {
                    break;
                }
                at += len.next_multiple_of(4);
            }
        }
    }

    /// A veth pair: `name` here (with hardware address `mac`), `peer` in the namespace
    /// `peer_ns`, both down. (Neither end can be made up in the same message: the
    /// kernel opens an end before it is joined to its peer, and refuses.)
    pub fn add_veth(
        &mut self,
        name: &str,
        mac: [u8; 6],
        peer: &str,
        peer_ns: BorrowedFd<'_>,
    ) -> Result<(), NetlinkError> {
        let mut p = LinkMessage::default();
        p.attributes.push(LinkAttribute::IfName(peer.to_string()));
        p.attributes
            .push(LinkAttribute::NetNsFd(peer_ns.as_raw_fd()));
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.to_string()));
        m.attributes.push(LinkAttribute::Address(mac.to_vec()));
        m.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(p))),
        ]));
        self.request(
            RouteNetlinkMessage::NewLink(m),
            NLM_F_CREATE | NLM_F_EXCL,
            &format!("creating veth {name}"),
        )
    }

    /// Brings link `index` up.
    pub fn set_up(&mut self, index: u32) -> Result<(), NetlinkError> {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.header.flags = LinkFlags::Up;
        m.header.change_mask = LinkFlags::Up;
        self.request(
            RouteNetlinkMessage::SetLink(m),
            0,
            &format!("bringing up link {index}"),
        )
    }

    /// Adds `ip/prefix` to link `index`.
    pub fn add_address(
        &mut self,
        index: u32,
        ip: Ipv4Addr,
        prefix: u8,
    ) -> Result<(), NetlinkError> {
        let mut m = AddressMessage::default();
        m.header.family = AddressFamily::Inet;
        m.header.prefix_len = prefix;
        m.header.scope = AddressScope::Universe;
        m.header.index = index;
        m.attributes.push(AddressAttribute::Local(ip.into()));
        m.attributes.push(AddressAttribute::Address(ip.into()));
        self.request(
            RouteNetlinkMessage::NewAddress(m),
            NLM_F_CREATE | NLM_F_EXCL,
            &format!("adding {ip}/{prefix}"),
        )
    }

    /// The default route, via `gateway` on link `index`, which has no address of the
    /// gateway's network: the gateway is on the link by fiat (`onlink`).
    pub fn add_default_route(&mut self, index: u32, gateway: Ipv4Addr) -> Result<(), NetlinkError> {
        let mut m = route_message(RouteScope::Universe);
        m.header.flags = RouteFlags::Onlink;
        m.attributes
            .push(RouteAttribute::Gateway(RouteAddress::Inet(gateway)));
        m.attributes.push(RouteAttribute::Oif(index));
        self.request(
            RouteNetlinkMessage::NewRoute(m),
            NLM_F_CREATE | NLM_F_EXCL,
            &format!("adding the default route via {gateway}"),
        )
    }

    /// A route to the single address `ip` straight out of link `index` (no gateway),
    /// answered from `source`, a local address of another link.
    pub fn add_host_route(
        &mut self,
        index: u32,
        ip: Ipv4Addr,
        source: Ipv4Addr,
    ) -> Result<(), NetlinkError> {
        let mut m = route_message(RouteScope::Link);
        m.header.destination_prefix_length = 32;
        m.attributes
            .push(RouteAttribute::Destination(RouteAddress::Inet(ip)));
        m.attributes
            .push(RouteAttribute::PrefSource(RouteAddress::Inet(source)));
        m.attributes.push(RouteAttribute::Oif(index));
        self.request(
            RouteNetlinkMessage::NewRoute(m),
            NLM_F_CREATE | NLM_F_EXCL,
            &format!("adding the route to {ip}"),
        )
    }

    /// A permanent neighbour entry: `ip` is at `mac` on link `index` (never asked by ARP).
    pub fn add_neighbour(
        &mut self,
        index: u32,
        ip: Ipv4Addr,
        mac: [u8; 6],
    ) -> Result<(), NetlinkError> {
        let mut m = NeighbourMessage::default();
        m.header.family = AddressFamily::Inet;
        m.header.ifindex = index;
        m.header.state = NeighbourState::Permanent;
        m.header.kind = RouteType::Unicast;
        m.attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
        m.attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        self.request(
            RouteNetlinkMessage::NewNeighbour(m),
            NLM_F_CREATE | NLM_F_EXCL,
            &format!("adding the neighbour {ip}"),
        )
    }

    /// Removes `ip/prefix` from link `index`; an address that is not there is no error.
    pub fn delete_address(
        &mut self,
        index: u32,
        ip: Ipv4Addr,
        prefix: u8,
    ) -> Result<(), NetlinkError> {
        let mut m = AddressMessage::default();
        m.header.family = AddressFamily::Inet;
        m.header.prefix_len = prefix;
        m.header.index = index;
        m.attributes.push(AddressAttribute::Local(ip.into()));
        match self.request(
            RouteNetlinkMessage::DelAddress(m),
            0,
            &format!("removing {ip}/{prefix}"),
        ) {
            Err(e) if e.errno() == Some(libc::EADDRNOTAVAIL) => Ok(()),
            r => r,
        }
    }

    /// Sets the hardware address of link `index`.
    pub fn set_mac(&mut self, index: u32, mac: [u8; 6]) -> Result<(), NetlinkError> {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.attributes.push(LinkAttribute::Address(mac.to_vec()));
        self.request(
            RouteNetlinkMessage::SetLink(m),
            0,
            &format!("setting the address of link {index}"),
        )
    }

    /// Deletes link `name` (its veth peer goes with it).
    pub fn delete_link(&mut self, name: &str) -> Result<(), NetlinkError> {
        let mut m = LinkMessage::default();
        m.attributes.push(LinkAttribute::IfName(name.to_string()));
        self.request(
            RouteNetlinkMessage::DelLink(m),
            0,
            &format!("deleting link {name}"),
        )
    }
}

/// A unicast route of the main table, of this software's making.
fn route_message(scope: RouteScope) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = AddressFamily::Inet;
    m.header.table = RouteHeader::RT_TABLE_MAIN;
    m.header.protocol = RouteProtocol::Boot;
    m.header.scope = scope;
    m.header.kind = RouteType::Unicast;
    m
}

/// The index of interface `name` in the calling thread's namespace.
pub fn index(name: &str) -> Result<u32, NetlinkError> {
    let c = CString::new(name).map_err(|_| NetlinkError::Other(format!("bad name {name:?}")))?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => Err(NetlinkError::Refused {
            what: format!("looking up interface {name}"),
            source: io::Error::last_os_error(),
        }),
        i => Ok(i),
    }
}

fn check(r: libc::c_int, what: impl FnOnce() -> String) -> Result<(), NetlinkError> {
    if r == 0 {
        Ok(())
    } else {
        Err(NetlinkError::Refused {
            what: what(),
            source: io::Error::last_os_error(),
        })
    }
}

fn cpath(p: &Path) -> Result<CString, NetlinkError> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| NetlinkError::Other(format!("bad path {}", p.display())))
}

/// mount(2) with no data; `what` names it in an error.
fn mount(
    src: &std::ffi::CStr,
    dst: &std::ffi::CStr,
    flags: libc::c_ulong,
    what: impl FnOnce() -> String,
) -> Result<(), NetlinkError> {
    // SAFETY: NUL-terminated strings that outlive the call; no data argument.
    check(
        unsafe {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                c"none".as_ptr(),
                flags,
                std::ptr::null(),
            )
        },
        what,
    )
}

fn sandboxes_ns() -> Result<&'static crate::mountns::MountNs, NetlinkError> {
    Ok(crate::mountns::get()?)
}

/// Where the host opens the named namespace `name`.
pub fn netns_path(name: &str) -> Result<std::path::PathBuf, NetlinkError> {
    Ok(sandboxes_ns()?.view(&Path::new(NETNS_DIR).join(name)))
}

/// Creates the named network namespace `name` and returns it open. A thread of its own,
/// in the sandboxes' mount namespace, unshares into the new network namespace and
/// bind-mounts it on its file.
pub fn create_netns(name: &str) -> Result<File, NetlinkError> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(NetlinkError::Other(format!("bad namespace name {name:?}")));
    }
    let ns = sandboxes_ns()?;
    std::fs::create_dir_all(NETNS_DIR)?;
    let path = Path::new(NETNS_DIR).join(name);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| NetlinkError::Refused {
            what: format!("creating {}", path.display()),
            source: e,
        })?;
    let made = ns
        .run(|| -> Result<File, NetlinkError> {
            // SAFETY: unshare on this thread only; it ends right after.
            check(unsafe { libc::unshare(libc::CLONE_NEWNET) }, || {
                "unsharing a network namespace".into()
            })?;
            // Links made in it from now on (the sandbox's eth0) start with IPv6 off; its
            // loopback, already there, keeps `::1`. The namespace's default is a plain
            // value: unlike a link's own switch, it takes no lock shared by all namespaces.
            disable_ipv6("default")?;
            let dst = cpath(&path)?;
            mount(c"/proc/thread-self/ns/net", &dst, libc::MS_BIND, || {
                format!("bind-mounting the namespace on {}", path.display())
            })?;
            File::open(&path).map_err(NetlinkError::Io)
        })
        .map_err(NetlinkError::from)
        .and_then(|r| r);
    if made.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    made
}

/// Turns IPv6 off in `conf` of the calling thread's network namespace: a link's name, or
/// `default` for the links made in it later. A kernel without IPv6 has nothing to turn off.
pub fn disable_ipv6(conf: &str) -> Result<(), NetlinkError> {
    let knob = format!("net/ipv6/conf/{conf}/disable_ipv6");
    match write_sysctl(&knob, "1") {
        Ok(()) => Ok(()),
        Err(e)
            if e.kind() == io::ErrorKind::NotFound && !Path::new("/proc/sys/net/ipv6").exists() =>
        {
            Ok(())
        }
        Err(e) => Err(NetlinkError::Refused {
            what: format!("writing /proc/sys/{knob}"),
            source: e,
        }),
    }
}

/// Writes `value` to `/proc/sys/<knob>` as the calling thread's network namespace sees it.
///
/// Through a procfs instance made for this write and attached nowhere. Under the
/// `/proc/sys` it was looked up in, the kernel keeps one cached `net` entry per network
/// namespace that looked, and compares each lookup with all of them: on a node of 3,000
/// sandboxes one write through the node's `/proc` took 1.1–1.8 ms, and was the largest
/// cost that grew with the number of sandboxes. A private instance's entries go with it
/// (0.06 ms at 3,000). Where `fsopen` is missing or refused, it writes through `/proc`.
pub fn write_sysctl(knob: &str, value: &str) -> io::Result<()> {
    use std::io::Write;
    use std::os::fd::{FromRawFd, OwnedFd};
    const FSOPEN_CLOEXEC: libc::c_uint = 1;
    const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
    const FSMOUNT_CLOEXEC: libc::c_uint = 1;
    const MOUNT_ATTR_NOSUID_NODEV_NOEXEC: libc::c_uint = 0x2 | 0x4 | 0x8;
    let owned = |fd: libc::c_long| -> io::Result<OwnedFd> {
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor the kernel just returned, owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
    };
    // SAFETY: fsopen(2) with a NUL-terminated name; it returns a new descriptor.
    let fs =
        match owned(unsafe { libc::syscall(libc::SYS_fsopen, c"proc".as_ptr(), FSOPEN_CLOEXEC) }) {
            Ok(fs) => fs,
            // No new mount API (before 5.2), or a policy that refuses it (a seccomp profile
            // of a container the edge runs in): the node's /proc still works, only slower.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => {
                return std::fs::write(format!("/proc/sys/{knob}"), value);
            }
            Err(e) => return Err(e),
        };
    // SAFETY: fsconfig(2) on the context just opened; the command takes no arguments.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fsmount(2) on the created context; it returns a new, detached mount.
    let mnt = owned(unsafe {
        libc::syscall(
            libc::SYS_fsmount,
            fs.as_raw_fd(),
            FSMOUNT_CLOEXEC,
            MOUNT_ATTR_NOSUID_NODEV_NOEXEC,
        )
    })?;
    let rel = CString::new(format!("sys/{knob}"))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in a sysctl"))?;
    // SAFETY: openat(2) below the detached mount with a NUL-terminated relative path.
    let f = owned(unsafe {
        libc::openat(
            mnt.as_raw_fd(),
            rel.as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW,
        )
    } as libc::c_long)?;
    File::from(f).write_all(value.as_bytes())
}

/// Deletes the named network namespace (as `ip netns del`): unmounts and removes its
/// file. The kernel tears the namespace and its interfaces down once nothing uses it.
pub fn delete_netns(name: &str) -> Result<(), NetlinkError> {
    let path = Path::new(NETNS_DIR).join(name);
    let c = cpath(&path)?;
    sandboxes_ns()?.run(|| {
        // SAFETY: umount2 with a NUL-terminated path that outlives the call.
        let _ = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    })?;
    std::fs::remove_file(&path).map_err(NetlinkError::Io)
}

/// Runs `f` on a thread that has joined the namespace `ns` (it ends with `f`).
pub fn in_netns<T: Send + 'static>(
    ns: &File,
    f: impl FnOnce() -> Result<T, NetlinkError> + Send + 'static,
) -> Result<T, NetlinkError> {
    let ns = ns.try_clone()?;
    std::thread::Builder::new()
        .name("dsec-netns".into())
        .spawn(move || {
            // SAFETY: setns on this thread only; the thread ends after `f`.
            check(
                unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
                || "joining the namespace".into(),
            )?;
            f()
        })
        .map_err(NetlinkError::Io)?
        .join()
        .map_err(|_| NetlinkError::Other("the namespace thread panicked".into()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_sysctl(knob: &str) -> String {
        std::fs::read_to_string(format!("/proc/sys/{knob}")).unwrap_or_default()
    }

    /// The write lands in the calling thread's namespace (as `/proc/sys` read from it
    /// shows), not in the node's.
    #[test]
    fn a_sysctl_is_written_in_the_threads_own_namespace() {
        const KNOB: &str = "net/ipv4/conf/default/rp_filter";
        let node = read_sysctl(KNOB);
        if node.is_empty() || unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root and IPv4 sysctls");
            return;
        }
        let want = if node.trim() == "2" { "1" } else { "2" };
        let seen = std::thread::spawn(move || {
            // SAFETY: unshare on this thread only; it ends right after.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
            write_sysctl(KNOB, want).unwrap();
            read_sysctl(KNOB)
        })
        .join()
        .unwrap();
        assert_eq!(seen.trim(), want);
        assert_eq!(read_sysctl(KNOB), node, "the node's own value changed");
        let bad = std::thread::spawn(|| write_sysctl("net/no/such/knob", "1"))
            .join()
            .unwrap();
        assert_eq!(bad.unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
