//! `dsec-aether vmux` as a process: it connects to a chardev socket (here a test server
//! standing in for QEMU, with a guest-side multiplexer behind it), carries connections made
//! to its listening socket, and exits when the chardev closes.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::time::{Duration, Instant};

use dsec_common::vmux::Mux;

#[test]
fn vmux_carries_connections_and_ends_with_the_vm() {
    let dir = tempfile::tempdir().unwrap();
    let chardev = dir.path().join("vm.chardev");
    let listen = dir.path().join("aether.sock");
    let server = UnixListener::bind(&chardev).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dsec-aether"))
        .arg("vmux")
        .arg(&listen)
        .arg(&chardev)
        .spawn()
        .unwrap();
    let (link, _) = server.accept().unwrap();
    // The "guest": echoes each stream back in upper case.
    let guest = Mux::guest(Box::new(link.try_clone().unwrap()), |mut s: UnixStream| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).unwrap();
            s.write_all(&buf.to_ascii_uppercase()).unwrap();
        });
    });
    let reader = link.try_clone().unwrap();
    std::thread::spawn(move || guest.run(reader));

    let t0 = Instant::now();
    while !listen.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "vmux never listened"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for word in ["hello", "vm"] {
        let mut c = UnixStream::connect(&listen).unwrap();
        c.write_all(word.as_bytes()).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        let mut got = String::new();
        c.read_to_string(&mut got).unwrap();
        assert_eq!(got, word.to_uppercase());
    }
    // The VM goes away: vmux follows.
    link.shutdown(Shutdown::Both).unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success());
            break;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("vmux outlived its VM's chardev");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
