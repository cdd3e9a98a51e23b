//! The metrics catalogue (`docs/metrics.md`) against the code: every metric the code records is
//! documented, every documented metric is recorded, and the alert rules and the dashboard in
//! `deploy/` name only metrics that exist.
//!
//! Metric names are read from the source: the first argument of each `counter!`, `gauge!` and
//! `histogram!` call (a string literal, or a `const` of the same file).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The value of `const NAME: &str = "...";` in `src`.
fn const_value(src: &str, name: &str) -> Option<String> {
    let at = src.find(&format!("const {name}: &str = \""))?;
    let rest = &src[at..];
    let start = rest.find('"')? + 1;
    let end = start + rest[start..].find('"')?;
    Some(rest[start..end].to_string())
}

/// Every metric name recorded in `src`, with the macro that records it.
fn metrics_in(src: &str) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    for kind in ["counter", "gauge", "histogram"] {
        let pat = format!("{kind}!(");
        let mut from = 0;
        while let Some(i) = src[from..].find(&pat) {
            let start = from + i + pat.len();
            from = start;
            // `describe_counter!(` and the like are not recordings.
            let before = &src[..start - pat.len()];
            if before.ends_with("describe_") || before.ends_with('_') {
                continue;
            }
            let arg = src[start..].trim_start();
            let name = if let Some(lit) = arg.strip_prefix('"') {
                lit[..lit.find('"').expect("unterminated literal")].to_string()
            } else {
                let ident: String = arg.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if ident.is_empty() {
                    continue; // not a call (prose, a macro definition)
                }
                match const_value(src, &ident) {
                    Some(v) => v,
                    None => panic!("{kind}!({ident}, ..): cannot resolve the metric name"),
                }
            };
            out.push((name, kind));
        }
    }
    out
}

/// Every metric the workspace's crates record.
fn recorded() -> BTreeSet<(String, &'static str)> {
    let mut files = Vec::new();
    for dir in ["relay/src", "router-client/src", "proto/src"] {
        rust_files(&root().join(dir), &mut files);
    }
    let mut all = BTreeSet::new();
    for f in files {
        let src = std::fs::read_to_string(&f).unwrap();
        all.extend(metrics_in(&src));
    }
    all
}

fn names(set: &BTreeSet<(String, &'static str)>) -> BTreeSet<String> {
    set.iter().map(|(n, _)| n.clone()).collect()
}

/// The catalogue's rows: `| `name` | type | labels | meaning |`.
fn catalogue() -> Vec<(String, String)> {
    let doc = std::fs::read_to_string(root().join("docs/metrics.md")).unwrap();
    doc.lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            name.starts_with("kv_").then(|| (name.to_string(), cells.get(2).unwrap_or(&"").to_string()))
        })
        .collect()
}

#[test]
fn the_scanner_reads_literals_consts_and_multiline_calls() {
    let src = r#"
        const LAG: &str = "kv_x_lag_seconds";
        counter!("kv_x_total", "rank" => r).increment(1);
        metrics::gauge!(
            "kv_x_size_bytes"
        ).set(1.0);
        histogram!(LAG).record(0.1);
        describe_counter!("kv_x_total", "not a recording");
    "#;
    let got: Vec<(String, &str)> = metrics_in(src);
    assert_eq!(
        got,
        vec![
            ("kv_x_total".to_string(), "counter"),
            ("kv_x_size_bytes".to_string(), "gauge"),
            ("kv_x_lag_seconds".to_string(), "histogram"),
        ]
    );
}

#[test]
fn every_recorded_metric_is_in_the_catalogue_with_its_type() {
    let recorded = recorded();
    assert!(recorded.len() >= 10, "the scanner found too few metrics: {recorded:?}");
    let catalogue = catalogue();
    let mut missing = Vec::new();
    for (name, kind) in &recorded {
        match catalogue.iter().find(|(n, _)| n == name) {
            None => missing.push(format!("{name} ({kind}): not in docs/metrics.md")),
            Some((_, ty)) if ty != kind => missing.push(format!("{name}: docs say {ty}, the code records a {kind}")),
            Some(_) => {}
        }
    }
    assert!(missing.is_empty(), "docs/metrics.md is out of date:\n{}", missing.join("\n"));
}

#[test]
fn every_catalogued_metric_is_recorded() {
    let recorded = names(&recorded());
    let stale: Vec<String> = catalogue().into_iter().map(|(n, _)| n).filter(|n| !recorded.contains(n)).collect();
    assert!(stale.is_empty(), "docs/metrics.md lists metrics the code does not record: {stale:?}");
}

/// `kv_relay_*` names in a text, with Prometheus' histogram suffixes removed.
fn referenced(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("kv_relay_") {
        let tail = &rest[i..];
        let name: String = tail.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        rest = &tail[name.len()..];
        let name =
            ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).map(str::to_string).unwrap_or(name);
        out.insert(name);
    }
    out
}

#[test]
fn alerts_and_dashboard_name_only_recorded_metrics() {
    let recorded = names(&recorded());
    for file in ["deploy/prometheus/kv-relay-alerts.yaml", "deploy/grafana/kv-relay-dashboard.json"] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        let refs = referenced(&text);
        assert!(!refs.is_empty(), "{file} names no kv_relay_ metric");
        let unknown: Vec<&String> = refs.iter().filter(|n| !recorded.contains(*n)).collect();
        assert!(unknown.is_empty(), "{file} names metrics the code does not record: {unknown:?}");
    }
}

#[test]
fn the_dashboard_is_valid_json_with_panels() {
    let text = std::fs::read_to_string(root().join("deploy/grafana/kv-relay-dashboard.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let panels = v["panels"].as_array().expect("panels");
    assert!(panels.len() >= 10, "{} panels", panels.len());
    for p in panels {
        assert!(p["title"].is_string(), "a panel without a title: {p}");
    }
}
