# Headless Chromium renders the HTML reconciliation report in
# outbox-cli/tests/html_chromium.rs (that test fails, never skips, without it).
if ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium
fi
