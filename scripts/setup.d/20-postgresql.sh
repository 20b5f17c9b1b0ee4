# PostgreSQL on 127.0.0.1:5432 for the tests, and its server binaries
# (initdb, pg_ctl) for outbox-testkit's throwaway servers.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  apt_install postgresql
fi
if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  echo "test: starting PostgreSQL"
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
  for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p 5432 -q || { echo "test: PostgreSQL does not answer on 127.0.0.1:5432 (set DATABASE_URL)" >&2; exit 1; }
