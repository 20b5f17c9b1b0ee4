-- The last round of each reconciler: `outbox status` and `outbox report`
-- show when the reconciler last compared the three sets, and a round older
-- than the staleness bound is a finding (a reconciler that is down cannot
-- record findings of its own). The SLO the reconciler holds UNKNOWNs to is
-- recorded with it, so the report judges the SLO by the same figure.
CREATE TABLE outbox_reconciler_rounds (
    owner             text    COLLATE "C" PRIMARY KEY,
    cluster_id        text    NOT NULL,
    last_round_at_ms  bigint  NOT NULL,
    interval_ms       bigint  NOT NULL CHECK (interval_ms >= 0),
    unknown_slo_ms    bigint  NOT NULL CHECK (unknown_slo_ms > 0),
    examined          integer NOT NULL CHECK (examined >= 0),
    open_findings     integer NOT NULL CHECK (open_findings >= 0),
    rounds            bigint  NOT NULL CHECK (rounds >= 1)
);
