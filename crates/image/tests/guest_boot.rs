//! Boots a real guest under QEMU (TCG, `-M microvm`) from the artefacts `dsec_image::guest`
//! builds: the Debian cloud kernel, the busybox initramfs and the EROFS root disks of a
//! two-layer image in a throw-away store. Skipped where `qemu-system-x86_64` is not
//! installed. Needs root and a Debian mirror the first time (the kernel package is
//! downloaded).

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dsec_image::cpio::read_newc;
use dsec_image::guest::{self, DiskSource, ROOT_READY_LINE};
use dsec_image::{ImageRef, ImageStore, Manifest};

/// Kills and reaps QEMU however the test ends.
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The host TSC rate in kHz (`cpu MHz` × 1000): under TCG the guest TSC ticks at this rate,
/// and telling the guest saves a PIT calibration that hangs on a busy host.
fn host_tsc_khz() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = info
        .lines()
        .find(|l| l.starts_with("cpu MHz"))?
        .split(':')
        .nth(1)?
        .trim()
        .parse()
        .ok()?;
    Some((mhz * 1000.0).round() as u64)
}

/// A two-layer image: busybox as /bin/sh and friends and a file the top layer deletes,
/// then a marker file.
fn make_image(store: &ImageStore, marker: &str) -> ImageRef {
    let d = store.temp_dir("guest-test-layer").unwrap();
    std::fs::create_dir_all(d.join("bin")).unwrap();
    std::fs::create_dir_all(d.join("etc")).unwrap();
    std::fs::copy(guest::HOST_BUSYBOX, d.join("bin/busybox")).unwrap();
    for applet in ["sh", "cat", "echo", "touch", "poweroff", "ls"] {
        std::os::unix::fs::symlink("busybox", d.join("bin").join(applet)).unwrap();
    }
    std::fs::write(d.join("etc/dsec-gone"), "deleted above\n").unwrap();
    let (base, size) = store.add_layer(&d).unwrap();
    let d = store.temp_dir("guest-test-layer").unwrap();
    std::fs::create_dir_all(d.join("etc")).unwrap();
    std::fs::write(d.join("etc/dsec-marker"), format!("{marker}\n")).unwrap();
    std::fs::write(d.join("etc/.wh.dsec-gone"), "").unwrap();
    let (top, _) = store.add_layer(&d).unwrap();
    let manifest = Manifest {
        schema_version: 1,
        layers: vec![base, top],
        env: Default::default(),
        workdir: None,
        start: None,
        created_ms: 0,
        size_bytes: size,
        source: "guest boot test".into(),
    };
    let r = ImageRef::parse("root/guest-boot-test:1").unwrap();
    store
        .tag(&r, &store.put_manifest(&manifest).unwrap())
        .unwrap();
    r
}

#[test]
fn guest_boots_from_the_root_disk_into_the_configured_init() {
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("skipped: qemu-system-x86_64 is not installed");
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("skipped: building a root disk needs root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();

    let t = Instant::now();
    let kernel = guest::ensure_kernel(root).unwrap();
    println!(
        "kernel {} (package {}) with {} modules in {:.1?}",
        kernel.version,
        kernel.package_version,
        kernel.modules.len(),
        t.elapsed()
    );
    assert!(kernel.dir.starts_with(root.join("guest")));
    assert!(kernel.vmlinuz.is_file());
    let names: Vec<String> = kernel
        .modules
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    for m in ["virtio_mmio", "virtio_blk", "overlay"] {
        assert!(names.iter().any(|n| n == m), "{m} missing from {names:?}");
    }
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(kernel.dir.join("kernel.json")).unwrap()).unwrap();
    assert_eq!(json["version"], kernel.version.as_str());
    assert_eq!(json["vmlinuz_sha256"], kernel.vmlinuz_sha256.as_str());
    let t = Instant::now();
    assert_eq!(guest::ensure_kernel(root).unwrap(), kernel, "cache hit");
    println!("kernel cache hit in {:.1?}", t.elapsed());
    let leftovers: Vec<_> = std::fs::read_dir(root.join("guest"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    let initrd = guest::ensure_initramfs(root, &kernel).unwrap();
    assert_eq!(guest::ensure_initramfs(root, &kernel).unwrap(), initrd);
    let name = initrd.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("initramfs-") && name.ends_with(".cpio.gz"),
        "{name}"
    );
    let mut cpio = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&initrd).unwrap())
        .read_to_end(&mut cpio)
        .unwrap();
    let entries = read_newc(&cpio).unwrap();
    for m in &names {
        let p = format!("lib/modules/{m}.ko");
        let e = entries.iter().find(|e| e.name == p).unwrap();
        assert!(e.data.starts_with(b"\x7fELF"), "{p} is not an ELF object");
    }
    println!(
        "initramfs {} ({} KiB, {} entries)",
        initrd.display(),
        std::fs::metadata(&initrd).unwrap().len() >> 10,
        entries.len()
    );

    let store = ImageStore::open(root).unwrap();
    let mut r = [0u8; 6];
    dsec_common::id::fill_random(&mut r);
    let marker = format!("marker-{}", hex::encode(r));
    let image = make_image(&store, &marker);
    // busybox stands in for aether here; the guest is told to run /bin/sh instead.
    let disks = guest::ensure_root_disks(
        &store,
        DiskSource::Image(&image),
        Path::new(guest::HOST_BUSYBOX),
    )
    .unwrap();
    assert_eq!(disks.len(), 3, "the stage and two layers: {disks:?}");
    for d in &disks {
        println!(
            "root disk {} ({} KiB)",
            d.display(),
            std::fs::metadata(d).unwrap().len() >> 10
        );
    }

    let mut append = format!(
        "console=ttyS0 quiet panic=-1 {}",
        guest::root_cmdline(disks.len())
    );
    if let Some(khz) = host_tsc_khz() {
        append.push_str(&format!(" tsc_early_khz={khz} tsc=reliable"));
    }
    append.push_str(
        " dsec.init=/bin/sh -- -c \"cat /etc/dsec-marker; touch /probe && echo upper-writable; \
         ls /etc/dsec-gone || echo whiteout-honoured; cat /proc/mounts; echo dsec-test-done; \
         poweroff -f\"",
    );
    // Attached bottom first: the guest finds each layer by its serial, not by its order.
    let mut drives = Vec::new();
    for (i, d) in disks.iter().enumerate().rev() {
        drives.push("-drive".to_string());
        drives.push(format!(
            "id=d{i},file={},format=raw,if=none,readonly=on",
            d.display()
        ));
        drives.push("-device".to_string());
        drives.push(format!(
            "virtio-blk-device,drive=d{i},serial={}",
            guest::disk_serial(i)
        ));
    }
    let spawned = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-M", "microvm", "-accel", "tcg", "-cpu", "max", "-m", "256M",
        ])
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
        .args(["-serial", "stdio", "-kernel"])
        .arg(&kernel.vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .arg("-append")
        .arg(&append)
        .args(&drives)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting qemu-system-x86_64");
    let (tx, rx) = mpsc::channel::<String>();
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(out).split(b'\n').map_while(Result::ok) {
            let _ = tx.send(String::from_utf8_lossy(&l).trim_end().to_string());
        }
    });
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx2.send(format!("[qemu stderr] {l}"));
        }
    });
    let mut qemu = Qemu(child);

    let deadline = spawned + Duration::from_secs(60);
    let mut console = Vec::new();
    let (mut ready_at, mut marker_at, mut done) = (None, None, false);
    while !done {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if line.contains(ROOT_READY_LINE) && ready_at.is_none() {
                    ready_at = Some(spawned.elapsed());
                }
                if line.contains(&marker) && marker_at.is_none() {
                    marker_at = Some(spawned.elapsed());
                }
                done = line.contains("dsec-test-done");
                console.push(line);
            }
            Err(_) => break, // timed out, or QEMU exited and closed its output
        }
    }
    // poweroff -f in the guest ends QEMU.
    let mut exited = None;
    let stop_by = Instant::now() + Duration::from_secs(10);
    while done && Instant::now() < stop_by {
        if let Some(status) = qemu.0.try_wait().unwrap() {
            exited = Some(status);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let shutdown = spawned.elapsed();
    drop(qemu);
    while let Ok(line) = rx.try_recv() {
        console.push(line);
    }
    let text = console.join("\n");
    println!("--- guest console ---\n{text}\n---");
    assert!(
        ready_at.is_some(),
        "no `{ROOT_READY_LINE}` on the console (QEMU exited, or 60 s passed); console above"
    );
    assert!(
        marker_at.is_some(),
        "the root disk's marker {marker} was not printed; console above"
    );
    assert!(
        text.contains("upper-writable"),
        "root is not writable through the tmpfs upper layer"
    );
    assert!(
        text.contains("whiteout-honoured"),
        "the top layer's whiteout did not hide the file below"
    );
    assert_eq!(
        text.matches(" erofs ro").count(),
        3,
        "each disk is mounted as EROFS"
    );
    assert!(
        text.contains("dsec-root / overlay"),
        "/ is not the overlay root"
    );
    assert!(
        exited.is_some(),
        "QEMU did not exit within 10 s of the guest's poweroff -f"
    );
    println!(
        "boot: spawn -> `{ROOT_READY_LINE}` {:.2} s, spawn -> marker from the root disk {:.2} s, spawn -> QEMU exit {:.2} s",
        ready_at.unwrap().as_secs_f64(),
        marker_at.unwrap().as_secs_f64(),
        shutdown.as_secs_f64()
    );
}
