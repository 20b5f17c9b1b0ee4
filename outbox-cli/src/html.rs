//! The HTML rendering of the reconciliation report: one self-contained file
//! (inline CSS and SVG, no script, no fetch), readable offline and safe to
//! attach to an incident ticket.
//!
//! Charts (each an `<svg>` with a stable id):
//! * `chart-states`: events per state over time, stacked areas, from the
//!   reconciler's snapshots (`Report::history`);
//! * `chart-unknown-age`: the age histogram of open UNKNOWNs with the SLO
//!   line (15 minutes by default);
//! * `chart-lag`: each critical consumer's watermark lag per partition;
//!
//! then the findings table (`table#findings`) with what each kind means.

use std::fmt::Write as _;

use outbox_producer::report::Report;

use crate::fmt::{age, ts};

/// Escapes text for HTML and SVG.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// A fixed color per state (the order of PROTOCOL §3).
pub fn state_color(state: &str) -> &'static str {
    match state {
        "PENDING" => "#f2b134",
        "CLAIMED" => "#9ecae1",
        "SENDING" => "#4292c6",
        "PUBLISHED" => "#41ab5d",
        "RETAINED" => "#238b45",
        "PURGED" => "#a1a1a1",
        "DISPATCH_UNKNOWN" => "#e6550d",
        "RECONCILING" => "#fd8d3c",
        "RETRY_CLAIMED" => "#9e9ac8",
        "QUARANTINED" => "#cb181d",
        "SKIPPED" => "#8c6d31",
        _ => "#636363",
    }
}

const CONSUMER_COLORS: [&str; 8] = ["#3182bd", "#31a354", "#756bb1", "#e6550d", "#636363", "#17becf", "#bcbd22", "#d62728"];

/// What a finding kind means and what to do about it (also in docs/OPERATIONS.md).
pub fn finding_help(kind: &str) -> (&'static str, &'static str) {
    match kind {
        "aged_pending" => ("PENDING past the threshold: no dispatcher is claiming it.", "Check that a dispatcher runs for its cluster, its logs and outbox_dispatch_claimed_total."),
        "unconsumed_published" => (
            "PUBLISHED, but a critical consumer's watermark has not passed it.",
            "Check the consumer is running, reads the topic, and publishes its watermarks; check routing.",
        ),
        "bypass_publish" => ("A message in a routed topic whose eventId the outbox never committed.", "Find who writes to the topic outside the outbox; the evidence is in outbox_bypass_messages."),
        "unknown_past_slo" => ("Dispatch outcome unknown for longer than the SLO.", "Page: check the broker, then `outbox trace <eventId>`; the reconciler keeps looking."),
        "quarantined" => ("Payload or destination diverged from what was frozen; nothing was sent.", "Investigate the evidence with `outbox trace <eventId>`; never edit the row to force it through. If later events of its key wait behind it: `outbox skip` (OPERATIONS.md, A blocked key)."),
        "absence_proof_refuted" => (
            "A genuine message of an attempt proven absent is in the log: the proof was wrong.",
            "It converged (primary or duplicate receipt); check the dispatcher hosts' pauses and clocks around the attempt (`outbox trace <eventId>`).",
        ),
        "unregistered_message" => ("A message with the event's id that no registered attempt sent (a mirror, a replay).", "Evidence only; find the writer, as for bypass_publish."),
        "receipt_position_lost" => ("The log position of a primary receipt no longer holds its message: the log was replaced.", "Follow the runbook for a recreated topic or a replaced cluster."),
        "log_unavailable" => ("The frozen partition's log is truncated, recreated or compacted: absence cannot be proven.", "The event stays UNKNOWN; follow the runbook for a recreated topic or a replaced cluster."),
        "published_without_receipt" => ("PUBLISHED, RETAINED or PURGED without a primary receipt.", "Find what wrote the row (database audit logs); `outbox trace <eventId>`."),
        "foreign_source" => (
            "A message on a routed topic written by another, undeclared outbox (its outbox-source).",
            "Stop the writer, or declare the source (--declared-source) and accept it on the consumers; check consumer receipts for effects.",
        ),
        "unrecorded_copy" => ("A byte-identical copy of a published event at a position no receipt records.", "Find the mirror or replay that wrote it; consumers see a duplicate."),
        "scan_gap" => (
            "Offsets of a partition deleted (retention, DeleteRecords) before the bypass check read them: copies there cannot be accounted for.",
            "Check that the reconciler runs and keeps up; keep retention above its lag; close the finding.",
        ),
        "divergent_copy" => ("A published event's eventId with other bytes at a position no receipt records.", "Incident: find the writer and check which bytes each consumer applied (receipts record the digest)."),
        "partition_count_changed" => (
            "A routed topic has another partition count than its routes froze: events routed to partitions it lacks cannot be sent and wait.",
            "Bring the partitions back (raise the topic's partition count) or migrate the waiting events to a route that matches the topic; docs/OPERATIONS.md, A changed partition count.",
        ),
        _ => ("", ""),
    }
}

/// "Nice" upper bound and step for an axis from 0 to `max`.
fn nice_axis(max: f64) -> (f64, f64) {
    if max <= 0.0 {
        return (1.0, 1.0);
    }
    let raw = max / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let step = if step < 1.0 { 1.0 } else { step };
    ((max / step).ceil() * step, step)
}

fn num(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{}", v as i64)
    } else {
        format!("{v:.1}")
    }
}

/// Time axis label: time of day, or date and time over a day's span.
fn time_label(ms: i64, span_ms: i64) -> String {
    let Some(t) = chrono::DateTime::from_timestamp_millis(ms) else { return ms.to_string() };
    if span_ms > 86_400_000 {
        t.format("%m-%d %H:%M").to_string()
    } else {
        t.format("%H:%M:%S").to_string()
    }
}

fn no_data(o: &mut String, id: &str, w: i32, h: i32, msg: &str) {
    let _ = write!(
        o,
        r##"<svg id="{id}" class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="{m}"><rect x="0" y="0" width="{w}" height="{h}" fill="#fafafa" stroke="#ddd"/><text x="{x}" y="{y}" text-anchor="middle" class="muted">{m}</text></svg>"##,
        m = esc(msg),
        x = w / 2,
        y = h / 2
    );
}

/// Events per state over time: stacked areas.
fn states_chart(o: &mut String, r: &Report) {
    let (w, h) = (900.0, 320.0);
    let (left, right, top, bottom) = (60.0, 215.0, 20.0, 40.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    if r.history.is_empty() {
        no_data(o, "chart-states", w as i32, h as i32, "no state snapshots yet: the reconciler records one per round");
        return;
    }
    // States present anywhere, in the order of PROTOCOL §3 (unknown names last).
    let mut states: Vec<String> = outbox_core::ALL_STATES.iter().map(|s| s.as_str().to_owned()).collect();
    for s in &r.history {
        for (k, _) in &s.counts {
            if !states.contains(k) {
                states.push(k.clone());
            }
        }
    }
    states.retain(|k| r.history.iter().any(|s| s.counts.iter().any(|(n, c)| n == k && *c > 0)));
    let count = |i: usize, k: &str| r.history[i].counts.iter().find(|(n, _)| n == k).map(|(_, c)| *c).unwrap_or(0) as f64;
    let n = r.history.len();
    let totals: Vec<f64> = (0..n).map(|i| states.iter().map(|k| count(i, k)).sum()).collect();
    let (ymax, ystep) = nice_axis(totals.iter().cloned().fold(0.0, f64::max));
    let t0 = r.history[0].at_ms;
    let t1 = r.history[n - 1].at_ms;
    let span = (t1 - t0).max(1);
    let x = |i: usize| if n == 1 { left + pw / 2.0 } else { left + pw * (r.history[i].at_ms - t0) as f64 / span as f64 };
    let y = |v: f64| top + ph - ph * v / ymax;

    let _ = write!(
        o,
        r##"<svg id="chart-states" class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="Events per state over time">"##
    );
    // Grid and y axis.
    let mut v = 0.0;
    while v <= ymax + 1e-9 {
        let _ = write!(o, r##"<line class="grid" x1="{left}" x2="{}" y1="{yy:.1}" y2="{yy:.1}"/><text x="{}" y="{:.1}" text-anchor="end" class="tick">{}</text>"##, left + pw, left - 6.0, y(v) + 4.0, num(v), yy = y(v));
        v += ystep;
    }
    // Stacked areas, bottom-up.
    let mut base = vec![0.0; n];
    for k in &states {
        let tops: Vec<f64> = (0..n).map(|i| base[i] + count(i, k)).collect();
        let mut pts = String::new();
        if n == 1 {
            let (x0, x1) = (left + pw / 2.0 - 30.0, left + pw / 2.0 + 30.0);
            let _ = write!(pts, "{x0:.1},{:.1} {x1:.1},{:.1} {x1:.1},{:.1} {x0:.1},{:.1}", y(tops[0]), y(tops[0]), y(base[0]), y(base[0]));
        } else {
            for (i, t) in tops.iter().enumerate() {
                let _ = write!(pts, "{:.1},{:.1} ", x(i), y(*t));
            }
            for i in (0..n).rev() {
                let _ = write!(pts, "{:.1},{:.1} ", x(i), y(base[i]));
            }
        }
        let last = count(n - 1, k);
        let _ = write!(
            o,
            r##"<polygon class="area" data-state="{s}" points="{}" fill="{c}" fill-opacity="0.85" stroke="{c}"><title>{s}: {} now</title></polygon>"##,
            pts.trim_end(),
            last,
            s = esc(k),
            c = state_color(k)
        );
        base = tops;
    }
    // X axis ticks: up to 6 labels.
    let _ = write!(o, r##"<line class="axis" x1="{left}" x2="{}" y1="{:.1}" y2="{:.1}"/>"##, left + pw, top + ph, top + ph);
    let ticks = n.min(6);
    for j in 0..ticks {
        let i = if ticks == 1 { 0 } else { j * (n - 1) / (ticks - 1) };
        let _ = write!(o, r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" class="tick">{}</text>"##, x(i), top + ph + 18.0, esc(&time_label(r.history[i].at_ms, span)));
    }
    // Legend.
    for (j, k) in states.iter().enumerate() {
        let ly = top + 10.0 + 20.0 * j as f64;
        let _ = write!(
            o,
            r##"<rect x="{}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{}" y="{:.1}" class="legend">{} ({})</text>"##,
            left + pw + 16.0,
            ly - 10.0,
            state_color(k),
            left + pw + 34.0,
            ly,
            esc(k),
            count(n - 1, k)
        );
    }
    o.push_str("</svg>");
}

fn bucket_label(le_ms: i64, prev: Option<i64>) -> String {
    let short = |ms: i64| match ms {
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    };
    if le_ms == i64::MAX {
        format!("> {}", prev.map(short).unwrap_or_else(|| "0".into()))
    } else {
        format!("≤ {}", short(le_ms))
    }
}

/// Age histogram of open UNKNOWNs with the SLO line.
fn unknown_chart(o: &mut String, r: &Report) {
    let (w, h) = (900.0, 280.0);
    let (left, right, top, bottom) = (60.0, 20.0, 30.0, 46.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let buckets = &r.unknown_age_histogram;
    if buckets.is_empty() {
        no_data(o, "chart-unknown-age", w as i32, h as i32, "no UNKNOWN age buckets in this report");
        return;
    }
    let (ymax, ystep) = nice_axis(buckets.iter().map(|b| b.count).max().unwrap_or(0) as f64);
    let y = |v: f64| top + ph - ph * v / ymax;
    let slot = pw / buckets.len() as f64;
    let _ = write!(o, r##"<svg id="chart-unknown-age" class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="Age of open UNKNOWN events">"##);
    let mut v = 0.0;
    while v <= ymax + 1e-9 {
        let _ = write!(o, r##"<line class="grid" x1="{left}" x2="{}" y1="{yy:.1}" y2="{yy:.1}"/><text x="{}" y="{:.1}" text-anchor="end" class="tick">{}</text>"##, left + pw, left - 6.0, y(v) + 4.0, num(v), yy = y(v));
        v += ystep;
    }
    let mut prev = None;
    for (i, b) in buckets.iter().enumerate() {
        // A bucket whose ages can exceed the SLO is past it.
        let lower = prev.unwrap_or(0);
        let past_slo = lower >= r.unknown_slo_ms;
        let color = if past_slo { "#cb181d" } else { "#fd8d3c" };
        let bx = left + slot * i as f64 + slot * 0.15;
        let bw = slot * 0.7;
        let label = bucket_label(b.le_ms, prev);
        let _ = write!(
            o,
            r##"<rect class="bar" data-le-ms="{}" x="{bx:.1}" y="{:.1}" width="{bw:.1}" height="{:.1}" fill="{color}"><title>{}: {} open</title></rect>"##,
            b.le_ms,
            y(b.count as f64),
            (top + ph - y(b.count as f64)).max(0.0),
            esc(&label),
            b.count
        );
        if b.count > 0 {
            let _ = write!(o, r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" class="value">{}</text>"##, bx + bw / 2.0, y(b.count as f64) - 4.0, b.count);
        }
        let _ = write!(o, r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" class="tick">{}</text>"##, bx + bw / 2.0, top + ph + 18.0, esc(&label));
        prev = Some(b.le_ms);
    }
    // The SLO line: at the right edge of the last bucket whose bound is within the SLO.
    let within = buckets.iter().take_while(|b| b.le_ms <= r.unknown_slo_ms).count();
    let sx = left + slot * within as f64;
    let _ = write!(
        o,
        r##"<line id="slo-line" x1="{sx:.1}" x2="{sx:.1}" y1="{}" y2="{:.1}" stroke="#cb181d" stroke-width="2" stroke-dasharray="6 4"/><text x="{:.1}" y="{}" class="slo">SLO {}</text>"##,
        top - 10.0,
        top + ph,
        sx + 6.0,
        top - 2.0,
        esc(&age(r.unknown_slo_ms))
    );
    let _ = write!(o, r##"<line class="axis" x1="{left}" x2="{}" y1="{:.1}" y2="{:.1}"/>"##, left + pw, top + ph, top + ph);
    let _ = write!(o, r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" class="muted">age since the dispatch outcome became unknown</text>"##, left + pw / 2.0, h - 6.0);
    o.push_str("</svg>");
}

/// Watermark lag per critical consumer and partition: horizontal bars.
fn lag_chart(o: &mut String, r: &Report) {
    let w = 900.0;
    let rows = r.consumer_lag.len();
    if rows == 0 {
        no_data(o, "chart-lag", w as i32, 120, "no critical consumer with published events on its topics");
        return;
    }
    let (left, right, top, row_h) = (260.0, 90.0, 24.0, 24.0);
    let h = top + row_h * rows as f64 + 30.0;
    let pw = w - left - right;
    let (xmax, xstep) = nice_axis(r.consumer_lag.iter().map(|l| l.lag_events).max().unwrap_or(0) as f64);
    let x = |v: f64| left + pw * v / xmax;
    let mut consumers: Vec<&str> = Vec::new();
    for l in &r.consumer_lag {
        if !consumers.contains(&l.consumer_id.as_str()) {
            consumers.push(&l.consumer_id);
        }
    }
    let _ = write!(o, r##"<svg id="chart-lag" class="chart" viewBox="0 0 {w} {h:.0}" role="img" aria-label="Consumer watermark lag per partition">"##);
    let mut v = 0.0;
    while v <= xmax + 1e-9 {
        let _ = write!(o, r##"<line class="grid" x1="{xx:.1}" x2="{xx:.1}" y1="{top}" y2="{:.1}"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle" class="tick">{}</text>"##, h - 26.0, h - 10.0, num(v), xx = x(v));
        v += xstep;
    }
    for (i, l) in r.consumer_lag.iter().enumerate() {
        let ci = consumers.iter().position(|c| *c == l.consumer_id).unwrap_or(0);
        let color = CONSUMER_COLORS[ci % CONSUMER_COLORS.len()];
        let yy = top + row_h * i as f64;
        let bw = (x(l.lag_events as f64) - left).max(if l.lag_events > 0 { 2.0 } else { 0.0 });
        // A topic recreated under the same name has a log per topic id: the
        // label names the id's first characters, the tooltip all of it.
        let (short_id, full_id) = match &l.topic_id {
            Some(id) => (format!(" ({}…)", id.chars().take(6).collect::<String>()), format!(" on topic id {id}")),
            None => (String::new(), String::new()),
        };
        let _ = write!(
            o,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" class="label">{} · {}{}/{}</text><rect class="bar" data-consumer="{}" x="{left}" y="{:.1}" width="{bw:.1}" height="{:.1}" fill="{color}"><title>{}{}: committed {} of {}</title></rect><text x="{:.1}" y="{:.1}" class="value">{} behind</text>"##,
            left - 8.0,
            yy + row_h * 0.65,
            esc(&l.consumer_id),
            esc(&l.topic),
            esc(&short_id),
            l.partition,
            esc(&l.consumer_id),
            yy + 3.0,
            row_h - 6.0,
            esc(&l.consumer_id),
            esc(&full_id),
            l.committed_offset,
            l.published_end_offset,
            left + bw + 6.0,
            yy + row_h * 0.65,
            l.lag_events
        );
    }
    o.push_str("</svg>");
}

const STYLE: &str = r#"
body{font-family:-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;margin:24px auto;max-width:980px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #eee;padding-bottom:4px}
.muted{color:#777;fill:#777;font-size:12px} .cards{display:flex;flex-wrap:wrap;gap:10px;margin-top:14px}
.card{border:1px solid #e3e3e3;border-radius:6px;padding:8px 12px;min-width:120px} .card b{display:block;font-size:20px}
.card span{font-size:12px;color:#666} .bad{color:#cb181d} .good{color:#238b45}
svg.chart{width:100%;height:auto;display:block;background:#fff}
.grid{stroke:#eee} .axis{stroke:#999} .tick{font-size:11px;fill:#666} .legend{font-size:12px;fill:#333}
.label{font-size:12px;fill:#333} .value{font-size:11px;fill:#333} .slo{font-size:12px;fill:#cb181d;font-weight:600}
table{border-collapse:collapse;width:100%;font-size:13px} th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #eee;vertical-align:top}
th{background:#f6f6f6} code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
.kind{display:inline-block;padding:1px 6px;border-radius:3px;color:#fff;font-size:12px}
.swatch{display:inline-block;width:10px;height:10px;margin-right:6px;border-radius:2px}
"#;

fn kind_color(kind: &str) -> &'static str {
    match kind {
        "unknown_past_slo" | "quarantined" | "bypass_publish" => "#cb181d",
        "aged_pending" => "#e6550d",
        _ => "#756bb1",
    }
}

/// Renders `report` as one self-contained HTML document.
pub fn render(r: &Report) -> String {
    let mut o = String::with_capacity(32 * 1024);
    let _ = write!(
        o,
        r#"<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1"><title>Outbox reconciliation report {}</title><style>{STYLE}</style></head><body>"#,
        esc(&ts(r.generated_at_ms))
    );
    let _ = write!(o, r#"<h1>Outbox reconciliation report</h1><div class="muted">generated {} · outbox-cli {}</div>"#, esc(&ts(r.generated_at_ms)), env!("CARGO_PKG_VERSION"));

    let slo_class = match r.unknown_slo_verdict {
        outbox_producer::SloVerdict::Met => "good",
        outbox_producer::SloVerdict::Missed => "bad",
        outbox_producer::SloVerdict::NotApplicable => "",
    };
    let p99 = r.unknown_p99_resolution_ms.map(age).unwrap_or_else(|| "n/a".into());
    o.push_str(r#"<div class="cards" id="summary">"#);
    let card = |o: &mut String, value: String, label: &str, class: &str| {
        let _ = write!(o, r#"<div class="card"><b class="{class}">{}</b><span>{}</span></div>"#, esc(&value), esc(label));
    };
    card(&mut o, r.committed_events.to_string(), "committed outbox events", "");
    card(&mut o, r.publish_receipts.to_string(), "accepted publish receipts", "");
    card(&mut o, r.duplicate_receipts.to_string(), "duplicate receipts kept", "");
    card(&mut o, r.oldest_pending_age_ms.map(age).unwrap_or_else(|| "none".into()), "oldest PENDING", "");
    card(&mut o, r.unknown_open.to_string(), "UNKNOWN open", if r.unknown_open > 0 { "bad" } else { "good" });
    card(&mut o, format!("{p99} / {}", age(r.unknown_slo_ms)), &format!("UNKNOWN p99 to resolution vs SLO ({} resolved; {})", r.unknown_resolved, r.unknown_slo_verdict.as_str()), slo_class);
    card(&mut o, r.findings.len().to_string(), "open findings", if r.findings.is_empty() { "good" } else { "bad" });
    let stale = r.findings.iter().any(|f| f.kind == "reconciler_stale");
    let last_round = r.last_reconciler_round.as_ref().map(|l| format!("{} ago", age(l.age_ms))).unwrap_or_else(|| "never".into());
    card(&mut o, last_round, "last reconciler round", if stale { "bad" } else { "" });
    o.push_str("</div>");

    o.push_str(r#"<h2>The three sets</h2><table id="sets"><tr><th>set</th><th>count</th></tr>"#);
    let _ = write!(o, "<tr><td>committed outbox events</td><td>{}</td></tr><tr><td>accepted publish receipts (primary)</td><td>{}</td></tr>", r.committed_events, r.publish_receipts);
    if r.consumed_by_critical.is_empty() {
        o.push_str(r#"<tr><td>critical consumers</td><td class="muted">none registered</td></tr>"#);
    }
    for (c, n) in &r.consumed_by_critical {
        let _ = write!(o, "<tr><td>passed by the watermark of <code>{}</code></td><td>{n}</td></tr>", esc(c));
    }
    o.push_str("</table>");

    o.push_str(r#"<h2>Events per state</h2><table id="states"><tr><th>state</th><th>now</th></tr>"#);
    for (s, n) in &r.state_counts {
        let _ = write!(o, r#"<tr><td><span class="swatch" style="background:{}"></span>{}</td><td>{n}</td></tr>"#, state_color(s), esc(s));
    }
    o.push_str("</table>");
    o.push_str(r#"<h2>Events per state over time</h2>"#);
    states_chart(&mut o, r);

    o.push_str(r#"<h2>Open UNKNOWN events by age</h2>"#);
    let _ = write!(
        o,
        r#"<div class="muted">{} open; p99 time to resolution {} over {} resolved; SLO {} ({})</div>"#,
        r.unknown_open,
        esc(&p99),
        r.unknown_resolved,
        esc(&age(r.unknown_slo_ms)),
        r.unknown_slo_verdict.as_str()
    );
    unknown_chart(&mut o, r);

    o.push_str(r#"<h2>Consumer watermark lag</h2>"#);
    lag_chart(&mut o, r);

    if !r.consumer_decisions.is_empty() {
        o.push_str(r#"<h2>Consumer quarantines and dead letters</h2><table id="consumer-decisions"><tr><th>consumer</th><th>quarantined</th><th>by reason</th><th>dead-lettered</th></tr>"#);
        for c in &r.consumer_decisions {
            let reasons: Vec<String> = c.quarantined_by_reason.iter().map(|(k, n)| format!("{}={n}", esc(k))).collect();
            let everything = if c.quarantines_everything() { " <strong>every message quarantined, none applied: check its trust policy</strong>" } else { "" };
            let _ = write!(o, "<tr><td>{}</td><td>{}</td><td>{}{everything}</td><td>{}</td></tr>", esc(&c.consumer_id), c.quarantined_total(), reasons.join(" "), c.dead_lettered_total());
        }
        o.push_str("</table>");
    }

    if !r.lost_logs.is_empty() {
        o.push_str(r#"<h2>Lost logs</h2><p>Receipts whose position no longer holds their event: the log they were recorded in is gone (docs/OPERATIONS.md §6).</p><table id="lost-logs"><tr><th>cluster</th><th>topic</th><th>topic id</th><th>partition</th><th>receipts lost</th><th>offsets</th></tr>"#);
        for l in &r.lost_logs {
            let _ = write!(
                o,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}..{}</td></tr>",
                esc(&l.cluster_id),
                esc(&l.topic),
                esc(l.topic_id.as_deref().unwrap_or("")),
                l.partition,
                l.receipts_lost,
                l.first_offset,
                l.last_offset
            );
        }
        o.push_str("</table>");
    }

    let _ = write!(o, r#"<h2>Findings ({})</h2>"#, r.findings.len());
    if r.findings.is_empty() {
        o.push_str(r#"<p class="good" id="no-findings">No findings: every committed event is accounted for.</p>"#);
    }
    o.push_str(r#"<table id="findings"><tr><th>kind</th><th>event</th><th>consumer</th><th>age</th><th>detail</th></tr>"#);
    for f in &r.findings {
        let _ = write!(
            o,
            r#"<tr><td><span class="kind" style="background:{}">{}</span></td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            kind_color(&f.kind),
            esc(&f.kind),
            esc(&f.event_id),
            f.consumer_id.as_deref().map(esc).unwrap_or_default(),
            esc(&age(f.age_ms)),
            esc(&f.detail)
        );
    }
    o.push_str("</table>");
    let mut kinds: Vec<&str> = r.findings.iter().map(|f| f.kind.as_str()).collect();
    kinds.sort();
    kinds.dedup();
    if !kinds.is_empty() {
        o.push_str(r#"<h2>What the findings mean</h2><table id="finding-help"><tr><th>kind</th><th>meaning</th><th>what to do</th></tr>"#);
        for k in kinds {
            let (meaning, todo) = finding_help(k);
            let _ = write!(o, "<tr><td>{}</td><td>{}</td><td>{}</td></tr>", esc(k), esc(meaning), esc(todo));
        }
        o.push_str("</table>");
    }
    o.push_str("</body></html>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_producer::report::{Bucket, ConsumerLag, Finding, StateSnapshot};

    pub(crate) fn sample() -> Report {
        Report {
            generated_at_ms: 1_700_000_000_000,
            committed_events: 10,
            publish_receipts: 7,
            duplicate_receipts: 1,
            consumed_by_critical: vec![("billing".into(), 5)],
            state_counts: vec![("PENDING".into(), 2), ("PUBLISHED".into(), 7), ("DISPATCH_UNKNOWN".into(), 1)],
            oldest_pending_age_ms: Some(90_000),
            unknown_open: 1,
            unknown_age_histogram: vec![Bucket { le_ms: 60_000, count: 0 }, Bucket { le_ms: 900_000, count: 1 }, Bucket { le_ms: i64::MAX, count: 0 }],
            unknown_resolved: 3,
            unknown_p99_resolution_ms: Some(120_000),
            unknown_slo_ms: 900_000,
            unknown_slo_verdict: outbox_producer::SloVerdict::Met,
            last_reconciler_round: None,
            consumer_lag: vec![ConsumerLag { consumer_id: "billing".into(), cluster_id: "kafka-a".into(), topic: "orders".into(), topic_id: None, partition: 0, committed_offset: 5, published_end_offset: 7, lag_events: 2 }],
            history: vec![
                StateSnapshot { at_ms: 1_700_000_000_000 - 60_000, counts: vec![("PENDING".into(), 5), ("PUBLISHED".into(), 2)] },
                StateSnapshot { at_ms: 1_700_000_000_000, counts: vec![("PENDING".into(), 2), ("PUBLISHED".into(), 7), ("DISPATCH_UNKNOWN".into(), 1)] },
            ],
            lost_logs: vec![],
            findings: vec![Finding { kind: "aged_pending".into(), event_id: "evt-<script>".into(), consumer_id: None, age_ms: 90_000, detail: "a & b".into() }],
            consumer_decisions: Vec::new(),
        }
    }

    #[test]
    fn renders_every_part_and_escapes() {
        let html = render(&sample());
        for id in ["chart-states", "chart-unknown-age", "chart-lag", "findings", "slo-line", "summary"] {
            assert!(html.contains(&format!("id=\"{id}\"")), "{id}");
        }
        assert!(!html.contains("<script>"));
        assert!(html.contains("evt-&lt;script&gt;") && html.contains("a &amp; b"));
        assert!(!html.contains("http://") && !html.contains("https://"), "self-contained");
        assert_eq!(html.matches("<polygon").count(), 3, "one area per state seen");
    }

    #[test]
    fn empty_report_still_renders_placeholders() {
        let mut r = sample();
        r.history.clear();
        r.consumer_lag.clear();
        r.findings.clear();
        let html = render(&r);
        assert!(html.contains("id=\"chart-states\"") && html.contains("no state snapshots yet"));
        assert!(html.contains("id=\"no-findings\""));
    }

    #[test]
    fn consumer_decisions_are_listed_when_there_are_some() {
        let mut r = sample();
        assert!(!render(&r).contains("id=\"consumer-decisions\""));
        r.consumer_decisions.push(outbox_producer::ConsumerDecisions {
            consumer_id: "billing<b>".into(),
            quarantined: 3,
            quarantined_by_reason: vec![("verify:source_unknown".into(), 2), ("verify:signature_bad".into(), 1)],
            dead_lettered: 1,
            watermark_counts: None,
        });
        let html = render(&r);
        assert!(html.contains("id=\"consumer-decisions\"") && html.contains("billing&lt;b&gt;") && html.contains("verify:source_unknown=2 verify:signature_bad=1"), "{html}");
    }

    #[test]
    fn axes_are_nice() {
        assert_eq!(nice_axis(7.0), (8.0, 2.0));
        assert_eq!(nice_axis(0.0), (1.0, 1.0));
        assert_eq!(nice_axis(1000.0), (1000.0, 250.0));
        assert_eq!(bucket_label(900_000, Some(60_000)), "≤ 15m");
        assert_eq!(bucket_label(i64::MAX, Some(21_600_000)), "> 6h");
    }
}
