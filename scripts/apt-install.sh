# Sourced, not run: `apt_install PACKAGE...` installs Debian packages with apt-get
# (non-interactive, without recommends), as root or through passwordless sudo, and prints what it
# installs. On failure it returns 1 and leaves the reason in $apt_why (and apt-get's last lines on
# stderr). Used by scripts/check-systemd.sh and scripts/package.sh.

apt_install() {
    apt_why=
    if ! command -v apt-get >/dev/null 2>&1; then
        apt_why="no apt-get to install $* with"
        return 1
    fi
    local sudo=()
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            apt_why="installing $* needs root"
            return 1
        fi
    fi
    echo "installing $* (apt-get)"
    local log
    log=$(mktemp)
    if ! { "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"; } \
        >"$log" 2>&1; then
        tail -n 5 "$log" >&2
        rm -f "$log"
        apt_why="apt-get install $* failed"
        return 1
    fi
    rm -f "$log"
}
