#!/usr/bin/env bash
# Boots Linux guests under QEMU (TCG, no KVM needed) against the server and checks what real
# clients do with it: the kernel's nbd driver through nbd-client (ext4, XFS, O_DIRECT, discard
# and write-zeroes, fio with verification, multi-connection, read-only, a SIGTERM while
# attached, restarts of the server under a mounted file system), and a QEMU guest whose disk
# is the export through QEMU's own NBD client. Every check runs against our server and, in the
# same run, against qemu-nbd as the baseline; one line per check and a summary line.
#
# The guest has no network device: each NBD connection is a virtio-serial port whose host
# side is a `-chardev socket` on the server's Unix socket, bridged in the guest by socat to a
# Unix socket that `nbd-client -unix` attaches. Results and requests to the host (stop or
# restart a server) travel on a separate virtio-serial port. Each VM run has a timeout, the
# guest powers itself off, and the host kills a guest that stops answering.
#
# Everything comes from Debian's archive with apt and is cached outside the checkout:
# qemu-system-x86 from bookworm-backports (installed; bookworm's 7.2 faults under TCG), the
# cloud kernel 6.12 from backports (downloaded and unpacked into the cache, not installed),
# and the guest's tools (busybox-static unpacked; nbd-client, socat, e2fsprogs, xfsprogs, fio
# installed on the host and copied into the initramfs with their shared libraries). The
# guest's reconnect helper, scripts/vm/nbd-reconnect.c, is compiled static with the host's cc
# when the initramfs is built (nbd-client 3.24 gives a netlink device no new connection after
# a restart of its server; the helper does).
#
# Usage: scripts/vm-tests.sh [options]
#   --restarts N    server restarts in each restart test (default 3)
#   --skip-kernel-restart  leave out the restarts under the kernel client
#   --only LIST     comma-separated server kinds: ours, qemu (default both)
#   --skip-qemu-guest  leave out the QEMU-guest VM
#   --bin PATH      the binary to test (default: cargo build --release)
#   --debug         build and test the debug binary instead
#   --keep          keep the scratch directory
#   --prepare       fetch and build only; print the kernel's and the initramfs' paths
# Environment: VM_CACHE (default /var/cache/qcow2-nbd-vm as root, else
# ~/.cache/qcow2-nbd/vm) holds the kernel, busybox and the initramfs.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

restarts=3
only=ours,qemu
qemu_guest=1
kernel_restart=1
bin=""
profile=release
keep=0
prepare=0
while (($#)); do
    case "$1" in
    --restarts) restarts=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --skip-qemu-guest) qemu_guest=0; shift ;;
    --skip-kernel-restart) kernel_restart=0; shift ;;
    --bin) bin=$2; shift 2 ;;
    --debug) profile=debug; shift ;;
    --keep) keep=1; shift ;;
    --prepare) prepare=1; shift ;;
    -h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "vm-tests: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

die() { echo "vm-tests: $*" >&2; exit 1; }
if [ "$(id -u)" -eq 0 ]; then
    cache=${VM_CACHE:-/var/cache/qcow2-nbd-vm}
else
    cache=${VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qcow2-nbd/vm}
fi
mkdir -p "$cache"
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ -n "$codename" ] || die "no VERSION_CODENAME in /etc/os-release (a Debian host is needed)"
export DEBIAN_FRONTEND=noninteractive

# ---- host packages -------------------------------------------------------------------------

as_root() {
    [ "$(id -u)" -eq 0 ] || die "needs root to install: $* (or install it by hand and run again)"
}

# The backports suite, at apt's default backports priority: nothing else is taken from it
# unless asked for by -t.
backports_source() {
    local list=/etc/apt/sources.list.d/qcow2-nbd-backports.list
    if ! apt-cache policy 2>/dev/null | grep -q " $codename-backports/main"; then
        as_root "the $codename-backports apt source"
        echo "deb http://deb.debian.org/debian $codename-backports main" >"$list"
        apt-get update -qq >/dev/null
    fi
}

qemu_major() {
    qemu-system-x86_64 --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9]*\).*/\1/p'
}

if [ "$(qemu_major)" = "" ] || [ "$(qemu_major)" -lt 10 ]; then
    backports_source
    as_root "qemu-system-x86 from $codename-backports"
    echo "vm-tests: installing qemu-system-x86 from $codename-backports" >&2
    apt-get install -y -qq --no-install-recommends -t "$codename-backports" qemu-system-x86 >/dev/null
fi

has() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
missing=()
has nbd-client || missing+=(nbd-client)
has socat || missing+=(socat)
has mkfs.ext4 && has e2fsck || missing+=(e2fsprogs)
has mkfs.xfs || missing+=(xfsprogs)
has fio || missing+=(fio)
has blkdiscard || missing+=(util-linux)
has qemu-img && has qemu-io && has qemu-nbd || missing+=(qemu-utils)
has cpio || missing+=(cpio)
has cc || missing+=(gcc)
[ -e /usr/include/linux/nbd-netlink.h ] && [ -n "$(find /usr/lib -name libc.a -print -quit 2>/dev/null)" ] ||
    missing+=(libc6-dev linux-libc-dev)
if ((${#missing[@]})); then
    as_root "${missing[*]}"
    echo "vm-tests: installing ${missing[*]}" >&2
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null; }
fi

# ---- kernel and busybox, unpacked into the cache -------------------------------------------

# The newest 6.12 cloud kernel the backports suite has (6.12 is the first whose nbd driver
# sends WRITE_ZEROES; the cloud flavour ships nbd.ko and boots fast).
fetch_kernel() {
    local pkg dir
    pkg=$(apt-cache pkgnames linux-image-6.12 2>/dev/null | grep -E '^linux-image-6\.12\.[0-9.+a-z~-]*-cloud-amd64$' |
        grep -v -- '-dbg' | sort -V | tail -1) || true
    if [ -z "$pkg" ]; then
        backports_source
        pkg=$(apt-cache pkgnames linux-image-6.12 | grep -E '^linux-image-6\.12\.[0-9.+a-z~-]*-cloud-amd64$' |
            grep -v -- '-dbg' | sort -V | tail -1) || die "no linux-image-6.12.*-cloud-amd64 in $codename-backports"
    fi
    dir="$cache/$pkg"
    if [ ! -f "$dir/.complete" ]; then
        echo "vm-tests: fetching $pkg (once, into $cache)" >&2
        rm -rf "$dir" "$cache/deb"
        mkdir -p "$cache/deb"
        (cd "$cache/deb" && apt-get download -qq "$pkg" >/dev/null) || die "apt-get download $pkg failed"
        dpkg-deb -x "$cache"/deb/"$pkg"_*.deb "$dir" || die "could not unpack $pkg"
        rm -rf "$cache/deb"
        touch "$dir/.complete"
    fi
    echo "$dir"
}

fetch_busybox() {
    local dir="$cache/busybox-static"
    if [ ! -f "$dir/.complete" ]; then
        echo "vm-tests: fetching busybox-static (once, into $cache)" >&2
        rm -rf "$dir" "$cache/deb"
        mkdir -p "$cache/deb"
        (cd "$cache/deb" && apt-get download -qq busybox-static >/dev/null) || die "apt-get download busybox-static failed"
        dpkg-deb -x "$cache"/deb/busybox-static_*.deb "$dir" || die "could not unpack busybox-static"
        rm -rf "$cache/deb"
        touch "$dir/.complete"
    fi
    echo "$dir/bin/busybox"
}

kdir=$(fetch_kernel)
busybox=$(fetch_busybox)
kver=$(basename "$(ls -d "$kdir"/lib/modules/*)")
vmlinuz="$kdir/boot/vmlinuz-$kver"
[ -f "$vmlinuz" ] || die "no $vmlinuz"

# ---- the initramfs -------------------------------------------------------------------------

# Modules with what they depend on, in load order, from each module's "depends=" field (the
# package leaves modules.dep to depmod at install time; the host need not have kmod).
module_paths() {
    python3 - "$kdir/lib/modules/$kver" "$@" <<'EOF'
import lzma, os, sys
root, wanted = sys.argv[1], sys.argv[2:]
paths = {}
for d, _, files in os.walk(os.path.join(root, "kernel")):
    for f in files:
        if ".ko" in f:
            paths[f.split(".ko")[0].replace("-", "_")] = os.path.relpath(os.path.join(d, f), root)
def depends(path):
    with open(os.path.join(root, path), "rb") as f:
        data = f.read()
    if path.endswith(".xz"):
        data = lzma.decompress(data)
    at = data.find(b"\0depends=")
    if at < 0:
        return []
    value = data[at + 9 : data.index(b"\0", at + 1)].decode()
    return [n.replace("-", "_") for n in value.split(",") if n]
order = []
def visit(name):
    if name not in paths:
        return  # built into the kernel
    for n in depends(paths[name]):
        visit(n)
    if paths[name] not in order:
        order.append(paths[name])
for w in wanted:
    visit(w.replace("-", "_"))
print("\n".join(order))
EOF
}

build_initramfs() {
    local out=$1 root tool lib m dest
    root=$(mktemp -d "${TMPDIR:-/tmp}/qcow2-nbd-vm-root-XXXXXX")
    mkdir -p "$root"/{bin,usr/bin,dev,proc,sys,tmp,mnt,lib/modules,etc,run}
    cp "$busybox" "$root/bin/busybox"
    # In /usr/bin; the guest's init calls the ones busybox also has by their path.
    for tool in nbd-client socat mkfs.ext4 e2fsck mkfs.xfs xfs_repair fio blkdiscard dd sync; do
        tool=$(PATH="$PATH:/usr/sbin:/sbin" command -v "$tool") || die "$tool not found"
        cp -L "$tool" "$root/usr/bin/"
        for lib in $(ldd "$tool" | grep -o '/[^ ]*'); do
            dest="$root$lib"
            [ -e "$dest" ] || { mkdir -p "$(dirname "$dest")" && cp -L "$lib" "$dest"; }
        done
    done
    # Modules are compressed in Debian's kernels; busybox's insmod takes them plain.
    for m in $(module_paths nbd xfs virtio_blk); do
        dest="$root/lib/modules/$(basename "$m")"
        case "$m" in
        *.xz) xz -dc "$kdir/lib/modules/$kver/$m" >"${dest%.xz}" ;;
        *.zst) zstd -qdc "$kdir/lib/modules/$kver/$m" >"${dest%.zst}" ;;
        *) cp "$kdir/lib/modules/$kver/$m" "$dest" ;;
        esac
        echo "/lib/modules/$(basename "${dest%.*}" .ko).ko" >>"$root/lib/modules/order"
    done
    # The reconnect helper (scripts/vm/nbd-reconnect.c): static, so it needs no library.
    cc -O2 -Wall -static -o "$root/usr/bin/nbd-reconnect" "$repo/scripts/vm/nbd-reconnect.c" ||
        die "could not build scripts/vm/nbd-reconnect.c (needs cc and the static C library, libc6-dev)"
    cp "$repo/scripts/vm/init" "$root/init"
    cp "$repo/scripts/vm/carry" "$root/bin/carry"
    chmod 755 "$root/init" "$root/bin/carry"
    (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) >"$out.tmp"
    mv "$out.tmp" "$out"
    rm -rf "$root"
}

initrd="$cache/initramfs-$kver.gz"
# Rebuilt when the guest scripts or this one change (its checksum names the image).
sum=$(sha256sum "$repo/scripts/vm/init" "$repo/scripts/vm/carry" "$repo/scripts/vm/nbd-reconnect.c" "$0" |
    sha256sum | cut -c1-12)
initrd="${initrd%.gz}-$sum.gz"
if [ ! -s "$initrd" ]; then
    echo "vm-tests: building the initramfs" >&2
    rm -f "$cache"/initramfs-*.gz
    build_initramfs "$initrd"
fi

if [ "$prepare" = 1 ]; then
    echo "$vmlinuz $initrd"
    exit 0
fi

# ---- the binary and the run ----------------------------------------------------------------

if [ -z "$bin" ]; then
    if [ "$profile" = release ]; then
        (cd "$repo" && cargo build --release --locked --quiet --bin qcow2-nbd) || die "cargo build failed"
    else
        (cd "$repo" && cargo build --locked --quiet --bin qcow2-nbd) || die "cargo build failed"
    fi
    bin="$repo/target/$profile/qcow2-nbd"
fi
bin=$(cd "$(dirname "$bin")" && echo "$PWD/$(basename "$bin")")

scratch=$(mktemp -d "${TMPDIR:-/tmp}/qcow2-nbd-vm-XXXXXX")
cleanup() { [ "$keep" = 1 ] && echo "vm-tests: scratch kept in $scratch" >&2 || rm -rf "$scratch"; }
trap cleanup EXIT

args=(--kernel "$vmlinuz" --initrd "$initrd" --bin "$bin" --scratch "$scratch"
    --restarts "$restarts" --only "$only")
[ "$qemu_guest" = 1 ] || args+=(--skip-qemu-guest)
[ "$kernel_restart" = 1 ] || args+=(--skip-kernel-restart)
python3 "$repo/scripts/vm/host.py" "${args[@]}"
