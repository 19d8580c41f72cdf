#!/usr/bin/env bash
# Runs the test suites our peers are checked with against this project's binary standing in
# for qemu-nbd, with the real qemu-nbd as the baseline in the same run, and prints a per-test
# table for both and a final "N passed, N failed" line. Nothing of theirs is kept in this
# repository (they are GPL/LGPL): each suite is taken from the Debian source package of the
# installed tools (scripts/debian-source.sh) and cached outside the checkout; only their
# testers are built.
#
#   libnbd  The tests of libnbd's source (the installed libnbd-bin's version) that start
#           qemu-nbd (interop/, info/, copy/, dump/): their C testers are built against the
#           installed libnbd, their scripts run with the installed nbdsh, nbdinfo, nbdcopy
#           and nbddump, with `qemu-nbd` on PATH being the server under test.
#   nbd     The reference NBD project's nbd-tester-client (tests/run of the installed
#           nbd-client's source package `nbd`), in its modes, against the server over a Unix
#           socket and TCP, serving `-f raw`, `-f qcow2` and a raw file given without -f.
#
# A test fails only if it fails with ours where it passes with qemu-nbd; a test that fails
# with both is reported (it is the environment's or the suite's) but does not count.
#
# Usage: scripts/peers.sh [options] [SUITE...]   (SUITE: libnbd, nbd; default both)
#   --all           every test of each suite (default: the CI subset, a few minutes)
#   --timeout SECS  per test (default 120)
#   --bin PATH      the binary to test (default: built with `cargo build --release`)
#   --debug         build and test the debug binary instead
#   --keep          keep the scratch directory
# Environment: PEERS_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/qcow2-nbd/peers) holds the
# sources and the built testers; LIBNBD_SRC=DIR or NBD_SRC=DIR use an unpacked source tree of
# that project instead of fetching one.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/debian-source.sh
. "$repo/scripts/debian-source.sh"

all=0
timeout_secs=120
profile=release
bin=""
keep=0
suites=()
while (($#)); do
    case "$1" in
    --all) all=1; shift ;;
    --timeout) timeout_secs=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --debug) profile=debug; shift ;;
    --keep) keep=1; shift ;;
    -h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    libnbd | nbd) suites+=("$1"); shift ;;
    *) echo "peers: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
((${#suites[@]})) || suites=(libnbd nbd)

die() { echo "peers: $*" >&2; exit 1; }

# Beyond scripts/test.sh's tools: nbdkit (libnbd's compressed-copy test reads from it), the
# compiler, and what the testers are built with (nbd's configure wants bison and flex). Installed from Debian's packages when
# running as root, as scripts/test.sh does; otherwise the command to run is printed.
has() { command -v "$1" >/dev/null 2>&1; }
missing=()
has qemu-nbd && has qemu-img || missing+=(qemu-utils)
has nbdsh && has nbdinfo && has nbdcopy && has nbddump || missing+=(libnbd-bin)
/usr/bin/python3 -c 'import nbd' 2>/dev/null || missing+=(python3-libnbd)
has nbdkit || missing+=(nbdkit)
has certtool && has psktool || missing+=(gnutls-bin)
has make && has cc || missing+=(build-essential)
has pkg-config || missing+=(pkg-config)
has bison || missing+=(bison)
has flex || missing+=(flex)
[ -e /usr/include/gnutls/gnutls.h ] || missing+=(libgnutls28-dev)
pkg-config --exists glib-2.0 2>/dev/null || missing+=(libglib2.0-dev)
if ((${#missing[@]})); then
    if [ "$(id -u)" -ne 0 ]; then
        die "the peers' suites need: ${missing[*]}. Install them with: sudo apt-get install -y ${missing[*]}"
    fi
    echo "peers: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update >/dev/null && apt-get install -y "${missing[@]}" >/dev/null; } ||
        die "could not install ${missing[*]}"
fi
real_nbd=$(command -v qemu-nbd)
cache=${PEERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qcow2-nbd/peers}
mkdir -p "$cache"

# ---- the binary ----------------------------------------------------------------------------

if [ -z "$bin" ]; then
    flag=()
    [ "$profile" = release ] && flag=(--release)
    echo "peers: cargo build ${flag[*]}" >&2
    (cd "$repo" && cargo build "${flag[@]}" --locked --quiet --bin qcow2-nbd) || die "cargo build failed"
    bin="$repo/target/$profile/qcow2-nbd"
fi
bin=$(cd "$(dirname "$bin")" && echo "$PWD/$(basename "$bin")")
[ -x "$bin" ] || die "no binary $bin"

scratch=$(mktemp -d "${TMPDIR:-/tmp}/qcow2-nbd-peers-XXXXXX")
cleanup() { [ "$keep" = 1 ] && echo "peers: scratch kept in $scratch" >&2 || rm -rf "$scratch"; }
trap cleanup EXIT

# One directory per role holding `qemu-nbd`: ours (a link of that name, so it takes
# qemu-nbd's command line) or the real one.
mkdir -p "$scratch/bin-ours" "$scratch/bin-qemu"
ln -s "$bin" "$scratch/bin-ours/qemu-nbd"
ln -s "$real_nbd" "$scratch/bin-qemu/qemu-nbd"
# nbdsh runs `python3`: the one with libnbd's binding (Debian's), whatever is first on PATH.
python=""
for p in python3 /usr/bin/python3; do
    if "$p" -c 'import nbd' 2>/dev/null; then python=$(command -v "$p"); break; fi
done
[ -n "$python" ] || die "no python3 with libnbd's binding (python3-libnbd)"
ln -s "$python" "$scratch/bin-ours/python3"
ln -s "$python" "$scratch/bin-qemu/python3"

# Unpacks TARBALL into $cache/NAME once; prints the directory.
unpack() { # TARBALL NAME
    local dir="$cache/$2"
    if [ ! -f "$dir/.unpacked" ]; then
        rm -rf "$dir"
        mkdir -p "$dir"
        tar -xf "$1" -C "$dir" --strip-components=1 || die "could not unpack $1"
        touch "$dir/.unpacked"
    fi
    echo "$dir"
}

# Where a suite's source is: the given tree, else the Debian source of the installed package.
source_tree() { # VAR BINARY-PACKAGE NAME
    local given=${!1:-} tarball
    if [ -n "$given" ]; then
        echo "$given"
        return
    fi
    tarball=$(debian_orig_tarball "$2" "$cache/$3-debian") ||
        tarball=$(debian_newer_orig_tarball "$2" "$cache/$3-debian") || return 1
    unpack "$tarball" "$3-$(basename "$tarball" | sed 's/^[^_]*_//; s/\.orig\.tar\..*//')"
}

# Runs one test command with a role's qemu-nbd first on PATH; prints pass, skip, fail or
# timeout, and leaves the output in LOG.
run_test() { # ROLE DIR LOG COMMAND...
    local role=$1 dir=$2 log=$3 rc
    shift 3
    # QEMU_NBD as libnbd's makefiles pass it to its scripts.
    (cd "$dir" && PATH="$scratch/bin-$role:$PATH" LIBNBD_DEBUG=1 QEMU_NBD=qemu-nbd \
        exec timeout -k 10 "$timeout_secs" "$@") </dev/null >"$log" 2>&1 && rc=0 || rc=$?
    case "$rc" in
    0) echo pass ;;
    77) echo skip ;;
    124 | 137) echo timeout ;;
    *) echo fail ;;
    esac
}

# ---- libnbd --------------------------------------------------------------------------------

# DIR/TEST of libnbd's tests that start qemu-nbd; a C tester is built, a .sh is run.
libnbd_all=(
    interop/interop-qemu-nbd interop/interop-qemu-nbd-tls-certs interop/interop-qemu-nbd-tls-psk
    interop/list-exports-qemu-nbd interop/socket-activation-qemu-nbd interop/dirty-bitmap.sh
    interop/structured-read.sh interop/interop-qemu-block-size.sh
    info/info-description-qemu.sh info/info-list-json-qemu.sh info/info-list-qemu.sh
    info/info-map-qemu-allocation-depth.sh info/info-map-qemu-dirty-bitmap.sh
    copy/copy-file-to-qcow2.sh copy/copy-file-to-qcow2-compressed.sh dump/dump-empty-qcow2.sh
)
# They take seconds each: CI runs them all.
libnbd_ci=("${libnbd_all[@]}")

# Configures libnbd's tree once and builds its C testers against the installed libnbd (never
# its own library), and the TLS credentials its TLS tests read.
libnbd_build() { # SRC
    local src=$1 so args=() p v progs=()
    so=$(ldconfig -p | awk '/libnbd\.so\.0 / && /x86-64|x86_64|64bit/ { print $NF; exit }')
    [ -n "$so" ] || so=$(ldconfig -p | awk '/libnbd\.so\.0 / { print $NF; exit }')
    [ -n "$so" ] || die "the installed libnbd (libnbd0) was not found"
    if [ ! -f "$src/.peers-configured" ]; then
        echo "peers: configuring libnbd's tests (once)" >&2
        (cd "$src" && ./configure --disable-fuse --disable-ocaml --disable-python --disable-golang \
            --without-libxml2 >"$src/.peers-configure.log" 2>&1) ||
            die "libnbd's configure failed: $src/.peers-configure.log"
        # The C testers' prerequisite checks run through system(), that is /bin/sh, but
        # two are written in bash (`|&`): spelt the POSIX way, they check the same.
        sed -i 's/ |& grep/ 2>\&1 | grep/' "$src/tests/requires.c"
        touch "$src/.peers-configured"
    fi
    for p in "${libnbd_all[@]}"; do
        [[ $p == interop/*.sh ]] || [[ $p != interop/* ]] || progs+=("${p#interop/}")
    done
    progs+=(dirty-bitmap structured-read)
    for p in "${progs[@]}"; do
        v=${p//-/_}
        args+=("${v}_LDADD=$so \$(GNUTLS_LIBS)" "${v}_DEPENDENCIES=")
    done
    # SERVER is the name to look up on PATH, so each run finds its role's qemu-nbd.
    make -C "$src/interop" QEMU_NBD=qemu-nbd "${args[@]}" requires.c "${progs[@]}" \
        >"$src/.peers-make.log" 2>&1 || die "building libnbd's testers failed: $src/.peers-make.log"
    if [ ! -f "$src/tests/pki/.peers-made" ]; then
        rm -rf "$src/tests/pki"
        (cd "$src/tests" && SRCDIR=. CERTTOOL=certtool ./make-pki.sh pki) >>"$src/.peers-make.log" 2>&1 ||
            die "making libnbd's test certificates failed: $src/.peers-make.log"
        touch "$src/tests/pki/.peers-made"
    fi
    [ -s "$src/tests/keys.psk" ] || (cd "$src/tests" && psktool -u alice -p keys.psk) >>"$src/.peers-make.log" 2>&1 ||
        die "making libnbd's PSK file failed: $src/.peers-make.log"
}

libnbd_suite() {
    local src tests t role name cmd r
    src=$(source_tree LIBNBD_SRC libnbd-bin libnbd) || { echo "libnbd: source not available" >&2; return 1; }
    libnbd_build "$src"
    if [ "$all" = 1 ]; then tests=("${libnbd_all[@]}"); else tests=("${libnbd_ci[@]}"); fi
    for t in "${tests[@]}"; do
        name=${t##*/}
        if [[ $t == *.sh ]]; then cmd=(bash "./$name"); else cmd=("./$name"); fi
        for role in qemu ours; do
            r=$(run_test "$role" "$src/${t%/*}" "$scratch/log/libnbd-$name-$role" "${cmd[@]}")
            printf 'libnbd %s\t%s\t%s\n' "$t" "$role" "$r" >>"$scratch/results"
        done
    done
}

# ---- nbd's nbd-tester-client ---------------------------------------------------------------

nbd_suite() {
    local src
    src=$(source_tree NBD_SRC nbd-client nbd) || {
        echo "nbd: the source of the installed nbd-client cannot be had from Debian's archive here; give NBD_SRC=DIR" >&2
        printf 'nbd (source)\tqemu\tunavailable\nnbd (source)\tours\tunavailable\n' >>"$scratch/results"
        return 0
    }
    nbd_tester "$src"
}

# Builds nbd-tester-client from the nbd tree once (configure, then only the tester). DB2M:
# 3.26's configure stops with --disable-manpages unless a docbook2man is named; no page is
# built.
nbd_build() { # SRC
    local src=$1
    if [ ! -x "$src/tests/run/nbd-tester-client" ]; then
        echo "peers: building nbd-tester-client (once)" >&2
        (cd "$src" && { [ -x configure ] || ./autogen.sh; } && ./configure --disable-manpages DB2M=true \
            >"$src/.peers-configure.log" 2>&1 && make -C tests/run nbd-tester-client \
            >"$src/.peers-make.log" 2>&1) || die "building nbd-tester-client failed: see $src/.peers-*.log"
    fi
    echo "$src/tests/run/nbd-tester-client"
}

# A server of ROLE for one mode: prints the tester's connection arguments, the server's pid
# in $scratch/pid. FORMAT is raw, qcow2 or probed; TRANSPORT unix or tcp.
# SIZE is the export's size (the tester's own runs use 4 MiB, and 50 MiB for the replays).
nbd_server() { # ROLE FORMAT TRANSPORT DIR SIZE EXTRA...
    local role=$1 format=$2 transport=$3 dir=$4 size=$5 image fmt=() where=() port
    shift 5
    case "$format" in
    qcow2) image="$dir/disk.qcow2"; qemu-img create -q -f qcow2 "$image" "$size"; fmt=(-f qcow2) ;;
    raw) image="$dir/disk.raw"; truncate -s "$size" "$image"; fmt=(-f raw) ;;
    probed) image="$dir/disk.raw"; truncate -s "$size" "$image" ;;
    esac
    if [ "$transport" = unix ]; then
        where=(-k "$dir/sock")
    else
        port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        where=(-b 127.0.0.1 -p "$port")
    fi
    PATH="$scratch/bin-$role:$PATH" qemu-nbd -t -x export "${where[@]}" "${fmt[@]}" "$@" \
        --pid-file "$dir/pid" "$image" >"$dir/server.log" 2>&1 &
    for _ in $(seq 100); do [ -s "$dir/pid" ] && break; sleep 0.1; done
    if [ "$transport" = unix ]; then echo "-u $dir/sock"; else echo "127.0.0.1 $port"; fi
}

nbd_tester() { # SRC
    local tester modes m role format transport dir conn r size extra args
    tester=$(nbd_build "$1") || exit 1
    # Modes as the tester's own runs (tests/run/simple_test) use them against nbd-server.
    modes=(read oversize write flush rowrite integrity list tls tlswrongcert)
    [ "$all" = 1 ] && modes+=(handshake integrityhuge tlshuge)
    # qemu-nbd's x509 directory takes the tester's certificates under its own file names.
    local certs="$scratch/nbd-certs" c="$1/tests/run/certs"
    mkdir -p "$certs"
    ln -sf "$c/ca-cert.pem" "$c/server-cert.pem" "$c/server-key.pem" "$certs/"
    local tls_server=(--object "tls-creds-x509,id=tls0,endpoint=server,dir=$certs,verify-peer=on" --tls-creds tls0)
    local tls_client=(-C "$c/client-cert.pem" -K "$c/client-key.pem" -A "$c/ca-cert.pem" -H localhost)
    for m in "${modes[@]}"; do
        for format in raw qcow2 probed; do
            for transport in unix tcp; do
                for role in qemu ours; do
                    dir="$scratch/nbd/$m-$format-$transport-$role"
                    mkdir -p "$dir"
                    extra=()
                    [ "$m" = rowrite ] && extra=(-r)
                    [ "$m" = list ] && extra=(-r)
                    [[ $m == tls* ]] && extra=("${tls_server[@]}")
                    size=4M
                    [[ $m == integrity* || $m == tls* ]] && size=50M
                    read -ra conn <<<"$(nbd_server "$role" "$format" "$transport" "$dir" "$size" "${extra[@]}")"
                    args=()
                    case "$m" in
                    read) args=() ;;
                    write) args=(-w) ;;
                    flush) args=(-w -f) ;;
                    handshake) args=(-h) ;;
                    integrity) args=(-i -t "$1/tests/run/integrity-test.tr") ;;
                    integrityhuge) args=(-i -t "$1/tests/run/integrityhuge-test.tr") ;;
                    oversize) args=(-o) ;;
                    rowrite) args=(-w -F) ;;
                    list) args=() ;;
                    tls) args=(-i -t "$1/tests/run/integrity-test.tr" "${tls_client[@]}") ;;
                    tlshuge) args=(-i -t "$1/tests/run/integrityhuge-test.tr" "${tls_client[@]}") ;;
                    # A certificate the server's CA did not sign: the connection must fail.
                    tlswrongcert) args=(-t "$1/tests/run/integrity-test.tr" -C "$c/selfsigned-cert.pem"
                        -K "$c/selfsigned-key.pem" -A "$c/ca-cert.pem" -H localhost -F) ;;
                    esac
                    if [ "$m" = list ]; then
                        # The installed nbd-client's listing, then a read of the export it names.
                        r=$(run_test "$role" "$dir" "$dir/log" sh -c 'nbd-client -l "$@" | grep -qx export && exec "$0" "$@" -N export' \
                            "$tester" "${conn[@]}")
                    else
                        r=$(run_test "$role" "$dir" "$dir/log" "$tester" "${conn[@]}" -N export "${args[@]}")
                    fi
                    kill "$(cat "$dir/pid" 2>/dev/null)" 2>/dev/null || true
                    printf 'nbd %s %s %s\t%s\t%s\n' "$m" "$format" "$transport" "$role" "$r" >>"$scratch/results"
                done
            done
        done
    done
}

# ---- run and report ------------------------------------------------------------------------

mkdir -p "$scratch/log"
: >"$scratch/results"
for s in "${suites[@]}"; do
    "${s}_suite" || die "the $s suite could not run"
done

python3 - "$scratch/results" <<'EOF'
import sys
rows = {}
order = []
for line in open(sys.argv[1]):
    test, role, result = line.rstrip("\n").split("\t")
    if test not in rows:
        rows[test] = {}
        order.append(test)
    rows[test][role] = result
width = max([len(t) for t in order] + [4])
print(f"{'test':<{width}}  {'qemu-nbd':<11}  ours")
passed = failed = both = skipped = 0
for t in order:
    q, o = rows[t].get("qemu", "-"), rows[t].get("ours", "-")
    note = ""
    if o == "pass":
        passed += 1
    elif q == "pass":
        failed += 1
        note = "  <- fails with ours only"
    elif o in ("skip", "unavailable"):
        skipped += 1
    else:
        both += 1
        note = "  (fails with qemu-nbd too)"
    print(f"{t:<{width}}  {q:<11}  {o}{note}")
qp = sum(1 for t in order if rows[t].get("qemu") == "pass")
print(f"qemu-nbd: {qp} of {len(order)} pass")
print(f"ours: {passed} of {len(order)} pass; {both} fail with qemu-nbd too, {skipped} skipped or unavailable")
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
EOF
