# Sourced by the harnesses that run other projects' test suites (scripts/peers.sh): fetches
# the Debian source package of an installed package, so that a suite matching the installed
# tools is run and nothing of it is kept in this repository.
#
#   debian_orig_tarball BINARY-PACKAGE CACHE-DIR
#
# prints the path of the upstream tarball (SRC_UPSTREAM.orig.tar.*) of the installed
# BINARY-PACKAGE's source package, downloading it into CACHE-DIR once: first with apt-get
# source from the Debian suites that carry that version (a private sources list and state, so
# the system's apt configuration is left alone; apt checks the archive's signature), then from
# snapshot.debian.org (where versions that left the archive stay, addressed by their SHA-1).
# Its messages go to stderr; it returns non-zero when the tarball cannot be had.

# Debian's suite names by release number, for versions like ~bpo12 or +deb13u1.
debian_codename_of() {
    case "$1" in 11) echo bullseye ;; 12) echo bookworm ;; 13) echo trixie ;; 14) echo forky ;; esac
}

# The suites that may carry source VERSION: from its backport/stable-update suffix, then the
# system's own release, then unstable.
debian_suites_for() { # VERSION
    local version=$1 n suites=()
    if [[ $version =~ ~bpo([0-9]+) ]]; then
        n=$(debian_codename_of "${BASH_REMATCH[1]}") && [ -n "$n" ] && suites+=("$n-backports")
    fi
    if [[ $version =~ \+deb([0-9]+)u ]]; then
        n=$(debian_codename_of "${BASH_REMATCH[1]}") && [ -n "$n" ] && suites+=("$n" "$n-updates")
    fi
    n=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
    [ -n "$n" ] && suites+=("$n" "$n-updates" "$n-backports")
    suites+=(unstable)
    printf '%s\n' "${suites[@]}" | awk '!seen[$0]++'
}

# apt-get source --download-only SRC=VERSION into CACHE with a private apt state in CACHE/apt.
debian_fetch_with_apt() { # SRC VERSION CACHE
    local src=$1 version=$2 cache=$3 apt_dir opts n
    command -v apt-get >/dev/null || return 1
    apt_dir="$cache/apt"
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial"
    : >"$apt_dir/sources.list"
    for n in $(debian_suites_for "$version"); do
        echo "deb-src http://deb.debian.org/debian $n main" >>"$apt_dir/sources.list"
    done
    opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir" -o "Dir::Cache::archives=$apt_dir/archives"
        -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)")
    apt-get "${opts[@]}" -qq update >"$apt_dir/log" 2>&1 || return 1
    # A backport's own .dsc may be gone from the pool while its orig tarball (all a harness
    # needs: the test suites are upstream's) is still there, so apt's status is not the verdict.
    (cd "$cache" && apt-get "${opts[@]}" -qq source --download-only "$src=$version") >>"$apt_dir/log" 2>&1 || true
}

# The orig tarball of SRC=VERSION from snapshot.debian.org, checked against its SHA-1.
debian_fetch_from_snapshot() { # SRC VERSION CACHE
    local src=$1 version=$2 cache=$3 found name hash
    command -v curl >/dev/null || return 1
    found=$(curl -fsS "https://snapshot.debian.org/mr/package/$src/$version/srcfiles?fileinfo=1" |
        python3 -c '
import json, sys
prefix = sys.argv[1]
for h, files in json.load(sys.stdin)["fileinfo"].items():
    for f in files:
        if f["name"].startswith(prefix) and ".orig.tar." in f["name"] and not f["name"].endswith(".asc"):
            print(f["name"], h)
            raise SystemExit
raise SystemExit(1)
' "${src}_" 2>/dev/null) || return 1
    read -r name hash <<<"$found"
    curl -fsS -o "$cache/$name.part" "https://snapshot.debian.org/file/$hash" || return 1
    echo "$hash  $cache/$name.part" | sha1sum -c --quiet >&2 || return 1
    mv "$cache/$name.part" "$cache/$name"
}

debian_orig_tarball() { # BINARY-PACKAGE CACHE
    local pkg=$1 cache=$2 version src upstream tarball
    version=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null) && [ -n "$version" ] || {
        echo "$pkg is not installed as a Debian package" >&2
        return 1
    }
    src=$(dpkg-query -W -f='${source:Package}' "$pkg")
    upstream=${version#*:}  # no epoch
    upstream=${upstream%-*} # no Debian revision: the orig tarball's version
    mkdir -p "$cache"
    tarball=$(ls "$cache/${src}_$upstream.orig.tar."* 2>/dev/null | grep -v '\.asc$' | head -1 || true)
    if [ -z "$tarball" ]; then
        echo "fetching the source of $src $version (once, into $cache)" >&2
        debian_fetch_with_apt "$src" "$version" "$cache" || true
        tarball=$(ls "$cache/${src}_$upstream.orig.tar."* 2>/dev/null | grep -v '\.asc$' | head -1 || true)
        if [ -z "$tarball" ]; then
            debian_fetch_from_snapshot "$src" "$version" "$cache" || true
            tarball=$(ls "$cache/${src}_$upstream.orig.tar."* 2>/dev/null | grep -v '\.asc$' | head -1 || true)
        fi
    fi
    [ -n "$tarball" ] || {
        echo "could not fetch the source of $src $version from Debian's archive or snapshot.debian.org (apt's messages: $cache/apt/log)" >&2
        return 1
    }
    echo "$tarball"
}

# When the installed version's source has left Debian's archive (its pool keeps only the
# versions some suite still carries), the same source package from a newer release: stable,
# testing or unstable, trying each version apt lists, newest first, until one's orig tarball
# arrives. The suites are the same project's, one release on; the message says which.
#
#   debian_newer_orig_tarball BINARY-PACKAGE CACHE-DIR
debian_newer_orig_tarball() {
    local pkg=$1 cache=$2 src installed apt_dir opts v tarball
    src=$(dpkg-query -W -f='${source:Package}' "$pkg" 2>/dev/null) && [ -n "$src" ] || return 1
    installed=$(dpkg-query -W -f='${Version}' "$pkg")
    tarball=$(ls "$cache/${src}_"*.orig.tar.* 2>/dev/null | grep -v '\.asc$' | sort -V | tail -1 || true)
    if [ -z "$tarball" ]; then
        command -v apt-get >/dev/null || return 1
        apt_dir="$cache/apt-newer"
        mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial"
        printf 'deb-src http://deb.debian.org/debian %s main\n' stable testing unstable >"$apt_dir/sources.list"
        opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir" -o "Dir::Cache::archives=$apt_dir/archives"
            -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)")
        apt-get "${opts[@]}" -qq update >"$apt_dir/log" 2>&1 || return 1
        for v in $(apt-cache "${opts[@]}" showsrc "$src" 2>/dev/null | sed -n 's/^Version: //p' | sort -rV | uniq); do
            (cd "$cache" && apt-get "${opts[@]}" -qq source --download-only "$src=$v") >>"$apt_dir/log" 2>&1 || true
            tarball=$(ls "$cache/${src}_"*.orig.tar.* 2>/dev/null | grep -v '\.asc$' | sort -V | tail -1 || true)
            [ -n "$tarball" ] && break
        done
    fi
    [ -n "$tarball" ] || {
        echo "no version of $src's source can be had from Debian's archive (apt's messages: $cache/apt-newer/log)" >&2
        return 1
    }
    echo "the source of $src $installed (installed) is gone from Debian's archive; using $(basename "$tarball"), a newer release's" >&2
    echo "$tarball"
}
