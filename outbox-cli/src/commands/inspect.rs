//! `outbox status`, `outbox trace` and `outbox report`: reading the
//! outbox database (and, for `trace`, consumer databases).

use anyhow::{bail, Context};
use outbox_core::EventId;
use outbox_producer::report::{build_report, ReportOptions};

use super::db::{connect, describe_url, open};
use super::{now_ms, EXIT_FINDINGS};
use crate::cli::{ReportArgs, StatusArgs, TraceArgs};
use crate::config::FileConfig;

/// `outbox status`.
pub(super) async fn status(url: &str, file: &FileConfig, a: &StatusArgs) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    let stale = a.reconciler_stale_ms.or(file.report.reconciler_stale_ms).unwrap_or(outbox_producer::report::DEFAULT_RECONCILER_STALE_MS);
    let s = crate::status::status(&pool, stale).await.context("reading status (has `outbox migrate` run?)")?;
    if a.json {
        println!("{}", crate::fmt::json(&s)?);
    } else {
        print!("{}", s.to_text());
    }
    Ok(if a.fail_on_findings && s.findings_total() > 0 { EXIT_FINDINGS } else { 0 })
}

/// `outbox trace`.
pub(super) async fn trace(url: &str, a: &TraceArgs) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    let id: EventId = a.event_id.parse().with_context(|| format!("{:?} is not an eventId (evt-<26 characters>)", a.event_id))?;
    let Some(mut t) = crate::trace::trace(&pool, id.as_str()).await? else { bail!("no outbox event {id}") };
    for u in &a.consumer_database_urls {
        let consumer_pool = connect(u, 1).await.context("--consumer-database-url")?;
        let source = describe_url(u);
        t.add_consumer_database(&consumer_pool, &source).await.with_context(|| format!("reading the consumer side in {source}"))?;
        consumer_pool.close().await;
    }
    if a.json {
        println!("{}", crate::fmt::json(&t)?);
    } else {
        print!("{}", t.to_text());
    }
    Ok(0)
}

pub(super) async fn report(url: &str, file: &FileConfig, a: &ReportArgs) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    let mut opts = ReportOptions::at(now_ms());
    let f = &file.report;
    opts.unknown_slo_ms = a.unknown_slo_ms.or(f.unknown_slo_ms).or(file.reconcile.unknown_slo_ms).unwrap_or(opts.unknown_slo_ms);
    opts.max_findings = a.max_findings.or(f.max_findings).unwrap_or(opts.max_findings);
    opts.max_history = a.max_history.or(f.max_history).unwrap_or(opts.max_history);
    // One SLO: the reconciler's (recorded with its rounds) unless given here.
    opts.use_reconciler_slo = a.unknown_slo_ms.is_none() && f.unknown_slo_ms.is_none();
    opts.reconciler_stale_ms = a.reconciler_stale_ms.or(f.reconciler_stale_ms).unwrap_or(opts.reconciler_stale_ms);
    let report = build_report(&pool, &opts).await.context("building the report (has `outbox migrate` run?)")?;
    if a.json {
        println!("{}", crate::fmt::json(&report)?);
    } else {
        print!("{}", report.to_text());
    }
    if let Some(path) = &a.html {
        std::fs::write(path, crate::html::render(&report)).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote HTML report to {}", path.display());
    }
    Ok(if a.fail_on_findings && !report.findings.is_empty() { EXIT_FINDINGS } else { 0 })
}
