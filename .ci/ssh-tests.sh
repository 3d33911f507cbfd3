# Sourced by .ci/run: can this machine run the ssh tests of tests/launch (a real OpenSSH server on loopback)?
# SSHD_FALLBACK is where Debian puts sshd when /usr/sbin is not on PATH.
SSHD_FALLBACK=${SSHD_FALLBACK:-/usr/sbin/sshd}

# 0 when sshd, ssh and ssh-keygen are all there: the tests then run, and a skip means something broke.
ssh_tests_can_run() {
    { command -v sshd >/dev/null 2>&1 || [ -x "$SSHD_FALLBACK" ]; } \
        && command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1
}

# As root with apt-get, install OpenSSH when it is missing; otherwise say why the ssh tests will skip.
ensure_openssh() {
    ssh_tests_can_run && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client; } \
            || echo "warning: could not install OpenSSH; the ssh tests of tests/launch will skip" >&2
    else
        echo "note: no OpenSSH (apt-get install openssh-server as root); the ssh tests of tests/launch will skip" >&2
    fi
}
