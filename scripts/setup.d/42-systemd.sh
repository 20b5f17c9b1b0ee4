# systemd-analyze checks the shipped unit files in outbox-cli/tests/deployment.rs.
if ! command -v systemd-analyze >/dev/null 2>&1; then
  apt_install systemd
fi
