//! The HTML report in a real browser: headless Chromium loads the file
//! (offline: no network flags), its DOM must hold the three SVG charts and
//! the findings table, and its screenshot must show the charts' colors.
//!
//! Chromium must be installed (`apt-get install chromium`; `.ci/extra-setup`
//! installs it in CI). Without it this test fails: it never passes silently.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use outbox_cli::html::{render, state_color};
use outbox_producer::report::{Bucket, ConsumerLag, Finding, Report, StateSnapshot, UNKNOWN_AGE_BUCKETS_MS};

fn chromium() -> PathBuf {
    if let Ok(p) = std::env::var("CHROMIUM") {
        assert!(Path::new(&p).exists(), "CHROMIUM={p} does not exist: install Chromium with `apt-get install -y chromium`");
        return PathBuf::from(p);
    }
    for c in ["/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"] {
        if Path::new(c).exists() {
            return PathBuf::from(c);
        }
    }
    panic!("Chromium is not installed: `apt-get install -y chromium` (scripts/test installs it: scripts/setup.d/30-chromium.sh), or set CHROMIUM=/path/to/chromium");
}

fn report() -> Report {
    let now = 1_795_000_000_000;
    let history = (0..30)
        .map(|i| {
            let published = 100 + i * 40;
            StateSnapshot {
                at_ms: now - (30 - i) * 60_000,
                counts: vec![
                    ("PENDING".into(), 400 - i * 10),
                    ("SENDING".into(), 10 + (i % 5)),
                    ("PUBLISHED".into(), published),
                    ("DISPATCH_UNKNOWN".into(), if i > 20 { 15 } else { 3 }),
                    ("QUARANTINED".into(), 2),
                ],
            }
        })
        .collect();
    let counts = [0, 4, 6, 3, 2, 1];
    Report {
        generated_at_ms: now,
        committed_events: 1_400,
        publish_receipts: 1_260,
        duplicate_receipts: 7,
        consumed_by_critical: vec![("billing".into(), 1_200), ("shipping".into(), 900)],
        state_counts: vec![("PENDING".into(), 22), ("PUBLISHED".into(), 1_260), ("DISPATCH_UNKNOWN".into(), 16), ("QUARANTINED".into(), 2)],
        oldest_pending_age_ms: Some(95_000),
        unknown_open: 16,
        unknown_age_histogram: UNKNOWN_AGE_BUCKETS_MS.iter().zip(counts).map(|(&le_ms, count)| Bucket { le_ms, count }).collect(),
        unknown_resolved: 240,
        unknown_p99_resolution_ms: Some(1_260_000),
        unknown_slo_ms: 900_000,
        unknown_slo_verdict: outbox_producer::SloVerdict::Missed,
        last_reconciler_round: None,
        consumer_lag: vec![
            ConsumerLag { consumer_id: "billing".into(), cluster_id: "kafka-a".into(), topic: "orders".into(), topic_id: None, partition: 0, committed_offset: 400, published_end_offset: 420, lag_events: 20 },
            ConsumerLag { consumer_id: "billing".into(), cluster_id: "kafka-a".into(), topic: "orders".into(), topic_id: None, partition: 1, committed_offset: 410, published_end_offset: 415, lag_events: 5 },
            ConsumerLag { consumer_id: "shipping".into(), cluster_id: "kafka-a".into(), topic: "orders".into(), topic_id: None, partition: 0, committed_offset: 300, published_end_offset: 420, lag_events: 120 },
            ConsumerLag { consumer_id: "shipping".into(), cluster_id: "kafka-a".into(), topic: "orders".into(), topic_id: None, partition: 1, committed_offset: 380, published_end_offset: 415, lag_events: 35 },
        ],
        history,
        lost_logs: vec![],
        findings: vec![
            Finding { kind: "unknown_past_slo".into(), event_id: "evt-01M8MMVFGW092Y6JQ84Y6FCJ7P".into(), consumer_id: None, age_ms: 1_900_000, detail: "UNKNOWN for 31.7 min".into() },
            Finding { kind: "aged_pending".into(), event_id: "evt-01M8MMVFJ5W0MSTXXWERY28VVX".into(), consumer_id: None, age_ms: 95_000, detail: "PENDING past 60 s".into() },
            Finding {
                kind: "unconsumed_published".into(),
                event_id: "evt-01M8MMVFJ2WBEVEW64BV27ESRQ".into(),
                consumer_id: Some("shipping".into()),
                age_ms: 600_000,
                detail: "published 10 min ago, watermark 300 <= offset 301".into(),
            },
            Finding { kind: "quarantined".into(), event_id: "evt-01M8MMVFGW092Y6JQ84Y6FCJ70".into(), consumer_id: None, age_ms: 3_600_000, detail: "stored payload diverged <b>not html</b>".into() },
        ],
        consumer_decisions: Vec::new(),
    }
}

fn run_chromium(args: &[String]) -> std::process::Output {
    let mut child = Command::new(chromium()).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start chromium");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn base_args(profile: &Path) -> Vec<String> {
    [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-quic",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("--user-data-dir={}", profile.display())])
    .collect()
}

fn hex(c: &str) -> [u8; 3] {
    let v = u32::from_str_radix(c.trim_start_matches('#'), 16).unwrap();
    [(v >> 16) as u8, (v >> 8) as u8, v as u8]
}

#[test]
fn html_report_renders_its_charts_in_headless_chromium() {
    let dir = std::env::temp_dir().join(format!("outbox-html-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("report.html");
    std::fs::write(&page, render(&report())).unwrap();
    let url = format!("file://{}", page.display());

    // 1. The DOM as the browser parsed it.
    let mut args = base_args(&dir.join("profile-dom"));
    args.extend(["--dump-dom".to_string(), url.clone()]);
    let out = run_chromium(&args);
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && dom.contains("</html>"), "chromium --dump-dom failed: {}", String::from_utf8_lossy(&out.stderr));
    for id in ["chart-states", "chart-unknown-age", "chart-lag"] {
        let at = dom.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("svg#{id} missing from the DOM"));
        assert_eq!(&dom[dom[..at].rfind('<').unwrap()..][..4], "<svg", "#{id} is an svg element");
    }
    assert_eq!(dom.matches("<polygon").count(), 5, "one stacked area per state");
    assert!(dom.contains("id=\"slo-line\""), "SLO line");
    assert_eq!(dom.matches("class=\"bar\"").count(), 6 + 4, "6 histogram bars + 4 lag bars");
    assert!(dom.contains("id=\"findings\""), "findings table");
    assert_eq!(dom.matches("<span class=\"kind\"").count(), 4, "4 findings rows");
    assert!(dom.contains("diverged &lt;b&gt;not html&lt;/b&gt;"), "details escaped");

    // 2. What a person sees: a screenshot with the charts' colors in it.
    let shot = dir.join("report.png");
    let mut args = base_args(&dir.join("profile-shot"));
    args.extend(["--window-size=1000,2200".to_string(), format!("--screenshot={}", shot.display()), url]);
    let out = run_chromium(&args);
    assert!(shot.exists(), "no screenshot: {}", String::from_utf8_lossy(&out.stderr));
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let pixels: Vec<[u8; 3]> = buf[..info.buffer_size()].chunks(channels).map(|p| [p[0], p[1], p[2]]).collect();
    let near = |p: &[u8; 3], c: [u8; 3]| p.iter().zip(c).all(|(a, b)| (*a as i32 - b as i32).abs() <= 12);
    let distinct: std::collections::HashSet<[u8; 3]> = pixels.iter().copied().collect();
    assert!(distinct.len() > 50, "the screenshot is (nearly) blank: {} colors", distinct.len());
    for (state, min_pixels) in [("PUBLISHED", 5_000), ("PENDING", 2_000), ("DISPATCH_UNKNOWN", 100)] {
        // The areas are drawn with fill-opacity 0.85 over white.
        let c = hex(state_color(state)).map(|v| (v as f64 * 0.85 + 255.0 * 0.15).round() as u8);
        let n = pixels.iter().filter(|p| near(p, c)).count();
        assert!(n > min_pixels, "{state}'s area color {c:?} covers only {n} pixels");
    }
    let red = pixels.iter().filter(|p| near(p, hex("#cb181d"))).count();
    assert!(red > 200, "SLO line / past-SLO bars / badges in red: {red} pixels");
    eprintln!("screenshot {} ({}x{}, {} colors)", shot.display(), info.width, info.height, distinct.len());
    if std::env::var("OUTBOX_KEEP_SCREENSHOT").is_err() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
