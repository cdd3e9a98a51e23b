//! `relayctl decode` on a small golden fixture: the table and the JSON Lines output, as insta
//! snapshots (`tests/snapshots/`), and the built binary prints exactly what the library renders.
//!
//! After an intended change of the output: `INSTA_UPDATE=always cargo test -p kv-relay --test
//! decode_cli`, then review the `.snap` diff.

use kv_relay::{capture, decode_cmd};
use std::path::PathBuf;
use std::process::Command;

fn fixture() -> PathBuf {
    kv_relay_testdata::capture("golden-vllm-0.26")
}

fn rendered(json: bool) -> String {
    let messages = capture::read(&fixture()).unwrap();
    let walk = capture::walk(&messages);
    if json {
        decode_cmd::render_json(&messages, &walk)
    } else {
        decode_cmd::render_table(&messages, &walk)
    }
}

fn relayctl(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_relayctl")).arg("decode").arg(fixture()).args(args).output().unwrap();
    assert!(out.status.success(), "relayctl failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn decode_table_of_a_golden_fixture() {
    let table = rendered(false);
    insta::assert_snapshot!("golden_vllm_0_26_table", table);
    assert_eq!(relayctl(&[]), table);
}

#[test]
fn decode_json_of_a_golden_fixture() {
    let json = rendered(true);
    // One JSON object per message, every line parses.
    let lines: Vec<serde_json::Value> = json.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), capture::read(&fixture()).unwrap().len());
    insta::assert_snapshot!("golden_vllm_0_26_json", json);
    assert_eq!(relayctl(&["--json"]), json);
}
