#!/usr/bin/env bash
# Runs QEMU's own test suite (tests/qemu-iotests) with this project's binary standing in for
# qemu-img and/or qemu-nbd, one test at a time with a timeout, and prints pass/fail per test
# and a summary line. Nothing from QEMU is kept in this repository (it is GPL): the suite is
# taken from the Debian source package matching the installed qemu-utils and cached outside
# the checkout. The real qemu-io stays the one that reads and writes the images; a stub stands
# in for qemu-system, answering only the capability queries the suite makes, so tests that
# need a running VM end as "not run" or fail, and are not in the lists.
#
# A failure is ours only if the same test passes with QEMU's own tools: a test that fails
# with ours is run again with QEMU's, and if it fails there too it is reported as
# "excluded" (environment) and does not count against us.
#
# Usage: scripts/iotests.sh [options] [VARIANT:TEST ...]
#   VARIANT is qcow2 (check -qcow2), raw (-raw), luks (-luks), qcow2-nbd (-qcow2 -nbd), raw-nbd
#   (-raw -nbd) or luks-nbd (-luks -nbd).
#   --list NAME|FILE  tests to run: ci (default; scripts/iotests/ci.list), all
#                     (scripts/iotests/all.list), or a file of "VARIANT TEST [ROLE]" lines
#   --as ROLE         whose tools run: img (ours as qemu-img), nbd (ours as qemu-nbd), both,
#                     qemu (QEMU's own only); default: the list's role per test, else img for
#                     file tests and nbd for -nbd tests
#   --table FILE      run every test with QEMU's tools, ours as qemu-img and ours as qemu-nbd,
#                     and write a markdown table (result of each, first differing line)
#   --discover VARIANTS  run every test of the suite (numbered and named) with QEMU's tools in
#                     each VARIANT (comma-separated, or "all" for every variant above) and print
#                     "VARIANT TEST" for those that pass without ever asking qemu-system or
#                     qemu-storage-daemon to start (every result goes to stderr, a --baseline)
#   --timeout SECS    per test (default 300)
#   --bin PATH        the binary to test (default: built with `cargo build --release`)
#   --debug           build and test the debug binary instead (`cargo build`: no release
#                     build to wait for when the tests have built it already)
#   -j N              run N tests at once (default 1)
#   --baseline FILE   results with QEMU's tools from an earlier run ("VARIANT TEST: STATUS"
#                     lines, as --discover prints on stderr), used instead of running them again
#   --keep            keep the scratch directory
# Environment: IOTESTS_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/qcow2-nbd/iotests) holds the
# QEMU source; QEMU_SRC=DIR uses an unpacked QEMU source tree instead of fetching one.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

list=ci
role=""
table=""
discover=""
timeout_secs=300
jobs=1
profile=release
baseline=""
bin=""
keep=0
tests=()
while (($#)); do
    case "$1" in
    --list) list=$2; shift 2 ;;
    --as) role=$2; shift 2 ;;
    --table) table=$2; shift 2 ;;
    --discover) discover=$2; shift 2 ;;
    --timeout) timeout_secs=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --debug) profile=debug; shift ;;
    -j) jobs=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;;
    -h | --help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "iotests: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) tests+=("$1"); shift ;;
    esac
done
case "$role" in "" | img | nbd | both | qemu) ;; *) echo "iotests: --as takes img, nbd, both or qemu" >&2; exit 2 ;; esac

die() { echo "iotests: $*" >&2; exit 1; }

for tool in qemu-img qemu-io qemu-nbd python3 timeout; do
    command -v "$tool" >/dev/null || die "$tool is needed (qemu-img, qemu-io and qemu-nbd come with Debian's qemu-utils)"
done
real_img=$(command -v qemu-img)
real_io=$(command -v qemu-io)
real_nbd=$(command -v qemu-nbd)

# ---- the QEMU source matching the installed qemu-utils -------------------------------------

cache=${IOTESTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qcow2-nbd/iotests}

# shellcheck source=scripts/debian-source.sh
. "$repo/scripts/debian-source.sh"

fetch_source() {
    local version upstream dir tarball
    version=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null) ||
        die "qemu-utils is not installed as a Debian package; give QEMU_SRC=DIR (an unpacked QEMU source of the installed version)"
    upstream=${version#*:}  # no epoch
    upstream=${upstream%-*} # no Debian revision: the orig tarball's version
    dir="$cache/qemu-$upstream"
    if [ -f "$dir/.complete" ]; then
        echo "$dir"
        return
    fi
    tarball=$(debian_orig_tarball qemu-utils "$cache") ||
        die "could not fetch the source of qemu $version; fetch qemu_$upstream.orig.tar.xz by hand into $cache, or give QEMU_SRC=DIR"
    rm -rf "$dir.tmp"
    mkdir -p "$dir.tmp"
    # Only the test suite and the Python modules it imports are needed.
    tar -xf "$tarball" -C "$dir.tmp" --strip-components=1 --wildcards \
        '*/tests/qemu-iotests' '*/python' ||
        die "could not unpack $tarball"
    touch "$dir.tmp/.complete"
    rm -rf "$dir"
    mv "$dir.tmp" "$dir"
    echo "$dir"
}

if [ -n "${QEMU_SRC:-}" ]; then
    src=$QEMU_SRC
else
    src=$(fetch_source)
fi
iotests="$src/tests/qemu-iotests"
[ -x "$iotests/check" ] || die "$iotests/check not found"

# ---- the binary ----------------------------------------------------------------------------

if [ -z "$bin" ] && [ -z "$discover" ] && [ "$role" != qemu ]; then
    if [ "$profile" = release ]; then
        echo "iotests: cargo build --release" >&2
        (cd "$repo" && cargo build --release --locked --quiet --bin qcow2-nbd) || die "cargo build failed"
    else
        echo "iotests: cargo build" >&2
        (cd "$repo" && cargo build --locked --quiet --bin qcow2-nbd) || die "cargo build failed"
    fi
    bin="$repo/target/$profile/qcow2-nbd"
fi
[ -z "$bin" ] || bin=$(cd "$(dirname "$bin")" && echo "$PWD/$(basename "$bin")")

# ---- tool directories: one per role --------------------------------------------------------

# Some tests refuse a TEST_DIR with characters other than letters, digits, - _ and /.
scratch=$(mktemp -d "${TMPDIR:-/tmp}/qcow2-nbd-iotests-XXXXXX")
cleanup() { [ "$keep" = 1 ] && echo "iotests: scratch kept in $scratch" >&2 || rm -rf "$scratch"; }
trap cleanup EXIT

# Our binary stands in for qemu-img and qemu-nbd by name: invoked through a link called
# qemu-img or qemu-nbd it takes that tool's command lines and speaks with its name.
# Without a binary (--discover, --as qemu) the roles all run QEMU's tools.
ours() { # NAME DEST
    if [ -n "$bin" ]; then ln -s "$bin" "$2"; else ln -s "$(command -v "$1")" "$2"; fi
}

# qemu-system and qemu-storage-daemon: capability queries only; anything else is a VM the
# harness cannot start, recorded in $IOTESTS_VM_LOG so discovery can leave the test out.
# The block drivers qemu-img lists (after "Supported formats:" or, in newer versions,
# "Supported image formats:" and a blank line), as one line.
formats=$("$real_img" --help | awk '/[Ss]upported (image )?formats:/ { on = 1; sub(/.*formats:/, ""); }
    on && /^$/ && seen { exit } on { if ($0 ~ /[^ ]/) seen = 1; printf "%s ", $0 }' | tr -s ' ')
[ -n "${formats// /}" ] || die "cannot read the supported formats from $real_img --help"
make_stubs() { # DIR
    cat >"$1/qemu-system-x86_64" <<EOF
#!/bin/sh
# Stub for qemu-system: answers the iotests' capability queries, starts no VM.
case " \$* " in
*" -machine help "* | *" -M help "*)
    echo "Supported machines are:"
    echo "pc                   Standard PC (i440FX + PIIX, 1996) (alias of pc-i440fx-10.0)"
    echo "pc-i440fx-10.0       Standard PC (i440FX + PIIX, 1996) (default)"
    echo "none                 empty machine"
    exit 0 ;;
*" format=help "*)
    echo "Supported formats: $formats"
    echo "Supported formats (read-only): "
    exit 0 ;;
*" -device help "*)
    # Named so that tests which only check for it (and start no VM) run.
    echo 'name "virtio-blk-pci", bus PCI, alias "virtio-blk"'
    exit 0 ;;
*" -accel help "* | *" -cpu help "*)
    exit 0 ;;
*" --version "* | *" -version "*)
    echo "QEMU emulator version 0.0.0 (stub: no VM)"
    exit 0 ;;
esac
echo "\$0 \$*" >>"\${IOTESTS_VM_LOG:-/dev/null}"
echo "qemu-system stub: this harness starts no VM" >&2
exit 1
EOF
    cat >"$1/qemu-storage-daemon" <<'EOF'
#!/bin/sh
# Stub for qemu-storage-daemon: the harness starts none.
echo "$0 $*" >>"${IOTESTS_VM_LOG:-/dev/null}"
echo "qemu-storage-daemon stub: this harness starts no daemon" >&2
exit 1
EOF
    chmod +x "$1/qemu-system-x86_64" "$1/qemu-storage-daemon"
}

for r in qemu img nbd both; do
    d="$scratch/bin-$r"
    mkdir -p "$d"
    make_stubs "$d"
    ln -s "$real_io" "$d/qemu-io"
    case "$r" in img | both) ours qemu-img "$d/qemu-img" ;; *) ln -s "$real_img" "$d/qemu-img" ;; esac
    case "$r" in nbd | both) ours qemu-nbd "$d/qemu-nbd" ;; *) ln -s "$real_nbd" "$d/qemu-nbd" ;; esac
done

# ---- running one test ----------------------------------------------------------------------

all_variants="qcow2 raw luks qcow2-nbd raw-nbd luks-nbd"
variant_args() {
    case "$1" in
    qcow2) echo "-qcow2" ;;
    raw) echo "-raw" ;;
    luks) echo "-luks" ;;
    qcow2-nbd) echo "-qcow2 -nbd" ;;
    raw-nbd) echo "-raw -nbd" ;;
    luks-nbd) echo "-luks -nbd" ;;
    *) die "unknown variant $1 (${all_variants// /, })" ;;
    esac
}

# Ends what a test left running (servers started with --fork outlive the test): the processes
# whose command line names the test's own scratch directory.
reap() { # DIR
    local p
    for p in /proc/[0-9]*; do
        if tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF "$1"; then
            kill -9 "${p#/proc/}" 2>/dev/null || true
        fi
    done
}

# Prints "STATUS<TAB>FIRST-DIFFERING-LINE"; STATUS is pass, fail, not run, timeout or vm.
run_one() { # VARIANT TEST ROLE
    local variant=$1 t=$2 r=$3 dir sock out rc status first
    dir="$scratch/run/$variant-$t-$r"
    # Unix socket paths must stay under 108 bytes, and the suite adds a directory named
    # after the test: the socket directory gets a short name of its own.
    sock="$scratch/s/$(cksum <<<"$variant-$t-$r" | cut -d' ' -f1)"
    rm -rf "$dir" "$sock"
    mkdir -p "$dir/test" "$sock" "$dir/build"
    # shellcheck disable=SC2046
    (
        cd "$dir/build"
        export QEMU_PROG="$scratch/bin-$r/qemu-system-x86_64" QEMU_IMG_PROG="$scratch/bin-$r/qemu-img" \
            QEMU_IO_PROG="$scratch/bin-$r/qemu-io" QEMU_NBD_PROG="$scratch/bin-$r/qemu-nbd" \
            QSD_PROG="$scratch/bin-$r/qemu-storage-daemon" TEST_DIR="$dir/test" SOCK_DIR="$sock" \
            IOTESTS_VM_LOG="$dir/vm.log"
        exec timeout -k 10 "$timeout_secs" python3 "$iotests/check" -tap --color off \
            --source-dir "$iotests" --build-dir "$dir/build" $(variant_args "$variant") "$t"
    ) >"$dir/out" 2>"$dir/err" && rc=0 || rc=$?
    reap "$dir"
    reap "$sock"
    rm -rf "$sock"
    out=$(cat "$dir/out")
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        status=timeout
    elif grep -q "^ok .* # SKIP" <<<"$out"; then
        status="not run"
    elif grep -q "^ok " <<<"$out"; then
        status=pass
    else
        status=fail
    fi
    [ -s "$dir/vm.log" ] && [ "$status" != pass ] && status=vm
    first=""
    if [ "$status" = fail ]; then
        # The first line the test's output has that the reference has not, or the reverse.
        first=$(grep -m1 -E '^[-+]([^-+]|$)' "$dir/err" | cut -c1-160 || true)
        [ -n "$first" ] || first=$(grep -v '^#' "$dir/err" | head -1 | cut -c1-160)
    elif [ "$status" = "not run" ]; then
        first=$(cat "$dir/test/"*/"$(basename "$t")".notrun 2>/dev/null | head -1 | cut -c1-160 || true)
    fi
    printf '%s\t%s\n' "$status" "$first"
}

default_role() { case "$1" in *-nbd) echo nbd ;; *) echo img ;; esac; }

# ---- the list ------------------------------------------------------------------------------

entries=()
if [ -n "$discover" ]; then
    [ "$discover" = all ] && discover=${all_variants// /,}
    for v in ${discover//,/ }; do
        variant_args "$v" >/dev/null
        # Every test the suite lists: numbered ones, and named ones (tests/NAME, listed as NAME).
        # shellcheck disable=SC2046
        mapfile -t -O "${#entries[@]}" entries < <(cd "$iotests" && python3 check -n $(variant_args "$v") 2>/dev/null |
            grep -E '^[A-Za-z0-9][A-Za-z0-9_.-]*$' | sed "s|^|$v |")
    done
elif ((${#tests[@]})); then
    for t in "${tests[@]}"; do
        [[ $t == *:* ]] || die "give tests as VARIANT:TEST, e.g. qcow2:024"
        entries+=("${t%%:*} ${t#*:}")
    done
else
    case "$list" in
    ci | all) file="$repo/scripts/iotests/$list.list" ;;
    *) file=$list ;;
    esac
    [ -f "$file" ] || die "no list $file"
    mapfile -t entries < <(sed 's/#.*//; /^[[:space:]]*$/d' "$file")
fi
((${#entries[@]})) || die "no tests to run"

# One entry's verdict, as a line in $scratch/res/INDEX:
#   discovery: "VARIANT TEST STATUS"
#   table:     "VARIANT TEST<TAB>QEMU<TAB>IMG<TAB>NBD<TAB>DIFFERENCES"
#   otherwise: "VARIANT TEST<TAB>ROLE<TAB>STATUS<TAB>WHY"
# The result with QEMU's own tools: from --baseline if it has the test, else by running it.
qemu_result() { # VARIANT TEST
    local known=""
    [ -z "$baseline" ] || known=$(sed -n "s/^$1 $2: //p" "$baseline" | head -1)
    if [ -n "$known" ]; then echo "$known"; else run_one "$1" "$2" qemu | cut -f1; fi
}

run_entry() { # INDEX VARIANT TEST ROLE
    local idx=$1 variant=$2 t=$3 erole=$4 q i n fi_ fn_ diffs r status first
    if [ -n "$discover" ]; then
        IFS=$'\t' read -r q _ < <(run_one "$variant" "$t" qemu)
        printf '%s %s\t%s\n' "$variant" "$t" "$q" >"$scratch/res/$idx"
    elif [ -n "$table" ]; then
        q=$(qemu_result "$variant" "$t")
        IFS=$'\t' read -r i fi_ < <(run_one "$variant" "$t" img)
        IFS=$'\t' read -r n fn_ < <(run_one "$variant" "$t" nbd)
        diffs=""
        [ -n "$fi_" ] && [ "$i" != pass ] && diffs="img: \`${fi_//|/\\|}\`"
        [ -n "$fn_" ] && [ "$n" != pass ] && diffs="$diffs${diffs:+ / }nbd: \`${fn_//|/\\|}\`"
        printf '%s %s\t%s\t%s\t%s\t%s\n' "$variant" "$t" "$q" "$i" "$n" "$diffs" >"$scratch/res/$idx"
    else
        r=${role:-${erole:-$(default_role "$variant")}}
        IFS=$'\t' read -r status first < <(run_one "$variant" "$t" "$r")
        if [ "$status" != pass ] && [ "$status" != "not run" ] && [ "$r" != qemu ]; then
            q=$(qemu_result "$variant" "$t")
            if [ "$q" != pass ]; then
                status=excluded
                first="fails with QEMU's tools too ($q)"
            fi
        fi
        printf '%s %s\t%s\t%s\t%s\n' "$variant" "$t" "$r" "$status" "$first" >"$scratch/res/$idx"
    fi
}

mkdir -p "$scratch/res"
idx=0
for e in "${entries[@]}"; do
    read -r variant t erole _ <<<"$e"
    while (($(jobs -rp | wc -l) >= jobs)); do wait -n || true; done
    run_entry "$idx" "$variant" "$t" "${erole:-}" &
    idx=$((idx + 1))
done
wait

fails=0
declare -A count=()
if [ -n "$table" ]; then
    {
        echo "| test | QEMU's tools | ours as qemu-img | ours as qemu-nbd | first differing line (img / nbd) |"
        echo "|---|---|---|---|---|"
    } >"$table"
fi
for ((k = 0; k < idx; k++)); do
    [ -s "$scratch/res/$k" ] || die "no result for ${entries[$k]}"
    if [ -n "$discover" ]; then
        IFS=$'\t' read -r name q <"$scratch/res/$k"
        echo "$name: $q" >&2
        [ "$q" = pass ] && echo "$name"
        count[$q]=$((${count[$q]:-0} + 1))
    elif [ -n "$table" ]; then
        IFS=$'\t' read -r name q i n diffs <"$scratch/res/$k"
        echo "| $name | $q | $i | $n | $diffs |" >>"$table"
        printf '%-16s qemu: %-8s img: %-8s nbd: %-8s %s\n' "$name" "$q" "$i" "$n" "$diffs"
        count["qemu $q"]=$((${count["qemu $q"]:-0} + 1))
        count["img $i"]=$((${count["img $i"]:-0} + 1))
        count["nbd $n"]=$((${count["nbd $n"]:-0} + 1))
    else
        IFS=$'\t' read -r name r status first <"$scratch/res/$k"
        case "$status" in pass | "not run" | excluded) ;; *) fails=$((fails + 1)) ;; esac
        count[$status]=$((${count[$status]:-0} + 1))
        printf '%-16s as %-4s %-8s %s\n' "$name" "$r" "$status" "$first"
    fi
done

summary=""
while IFS= read -r k; do
    summary="$summary${summary:+, }${count[$k]} $k"
done < <(printf '%s\n' "${!count[@]}" | sort)
echo "iotests: ${#entries[@]} tests: $summary" >&2
[ "$fails" = 0 ]
