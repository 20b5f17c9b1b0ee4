# promtool (Debian's `prometheus` package) checks the shipped alert rules
# (`promtool check rules`, `promtool test rules`) and a scrape of /metrics
# (`promtool check metrics`) in outbox-cli/tests/observability.rs; those
# tests fail, never skip, without it.
if ! command -v promtool >/dev/null 2>&1; then
  apt_install prometheus
fi
