#!/bin/bash
# SPDX-License-Identifier: AGPL-3.0-only
# Stage 2 of the nested-KVM outer VM, PID 1 in the host's root under a tmpfs overlay (see
# outer.py): mounts the kernel filesystems, loads KVM and what `dsec up` needs from the
# kernel package's modules, brings up QEMU's user network, runs /nested-io/cmd.sh and
# powers off, leaving the command's exit status in /nested-io/rc.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
ln -sf pts/ptmx /dev/ptmx
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=0755 tmpfs /run
# Not /tmp or /var/tmp: the checkout may be there (the overlay root is in memory anyway).
mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo 1 > /proc/sys/kernel/sysrq

io=nestedio
modules=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        nested.io=*) io=${arg#nested.io=} ;;
        nested.modules=*) modules=${arg#nested.modules=} ;;
    esac
done
mkdir -p /nested-io
mount -t virtiofs "$io" /nested-io

finish() {
    echo "$1" > /nested-io/rc
    sync
    umount /nested-io
    echo o > /proc/sysrq-trigger
    sleep 10
}

# The kernel package's modules, at the path modprobe (and the kernel's autoloading) uses.
release=$(uname -r)
mkdir -p "/lib/modules/$release"
mount --bind "$modules" "/lib/modules/$release" || { echo "nested: no modules at $modules"; finish 2; }
for m in virtio_net virtio_rng kvm_amd tun veth vhost_vsock vhost_net overlay erofs; do
    modprobe "$m" || echo "nested: warning: modprobe $m failed"
done
if [ ! -c /dev/kvm ]; then
    echo "nested: /dev/kvm did not appear (kvm_amd needs an outer CPU with SVM: -cpu max)"
    finish 2
fi

hostname nested
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
rm -f /etc/resolv.conf
echo "nameserver 10.0.2.3" > /etc/resolv.conf
ulimit -n 1048576

echo "nested: outer VM up in $(cut -d' ' -f1 /proc/uptime) s (kernel $release, /dev/kvm ready)"
bash /nested-io/cmd.sh
rc=$?
# The console is quiet (loglevel 3): say what the outer kernel saw go wrong (OOM kills,
# KVM's complaints), which explains a nested VM that died.
dmesg --level=emerg,alert,crit,err,warn 2>/dev/null \
    | grep -iE "out of memory|killed process|oom|kvm|svm" | grep -v "Unhandled WRMSR" | tail -n 20 | sed 's/^/nested: kernel: /'
finish $rc
