//! Where the data that the tests, benchmarks and tools read is: in this folder of the
//! repository (`testdata/`), so that a clone needs nothing beside it. `README.md` here says what
//! each file is and where it comes from.
//!
//! - `fixtures/`: recorded captures of real vLLM and SGLang KV-event publishers, synthetic
//!   golden streams of older wire layouts, and one manifest per file with what it must decode to.
//! - `mooncake/`: two of the Mooncake project's public request traces (Apache-2.0).
//!
//! Every path to them is built here and nowhere else. `KV_RELAY_FIXTURES` names another
//! directory of captures in the same format (for example a new recording to decode or
//! benchmark); the tests' exact figures are those of the captures kept here.

use std::path::{Path, PathBuf};

/// The environment variable that points the fixtures at another directory.
pub const FIXTURES_ENV: &str = "KV_RELAY_FIXTURES";

/// This folder: `testdata/` of the repository.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The directory of captures, golden streams and manifests: `$KV_RELAY_FIXTURES`, else
/// `testdata/fixtures`. Panics, naming the directory, when it does not exist.
pub fn fixtures_dir() -> PathBuf {
    let dir = std::env::var_os(FIXTURES_ENV).map(PathBuf::from).unwrap_or_else(|| root().join("fixtures"));
    assert!(dir.is_dir(), "fixtures not found at {} (${FIXTURES_ENV} overrides testdata/fixtures)", dir.display());
    dir
}

/// The capture or golden stream `name` (`vllm-basic`, `golden-vllm-0.26`): `NAME.jsonl`.
pub fn capture(name: &str) -> PathBuf {
    existing(fixtures_dir().join(format!("{name}.jsonl")))
}

/// The manifest of `name`: `NAME.manifest.json`.
pub fn manifest(name: &str) -> PathBuf {
    existing(fixtures_dir().join(format!("{name}.manifest.json")))
}

/// Every fixture's name, read from the manifests in the directory (so none can be skipped),
/// sorted.
pub fn names() -> Vec<String> {
    let mut names: Vec<String> =
        files(".manifest.json").iter().map(|p| file_name(p).trim_end_matches(".manifest.json").to_string()).collect();
    names.sort();
    names
}

/// Every capture and golden stream file (`*.jsonl`) in the directory, sorted.
pub fn captures() -> Vec<PathBuf> {
    let mut paths = files(".jsonl");
    paths.sort();
    paths
}

/// A Mooncake trace: `conversation_trace.jsonl` or `synthetic_trace.jsonl`.
pub fn mooncake(file: &str) -> PathBuf {
    existing(root().join("mooncake").join(file))
}

fn files(suffix: &str) -> Vec<PathBuf> {
    let dir = fixtures_dir();
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| file_name(p).ends_with(suffix))
        .collect()
}

fn file_name(p: &Path) -> &str {
    p.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

fn existing(p: PathBuf) -> PathBuf {
    assert!(p.is_file(), "{} not found", p.display());
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fixture_has_its_capture_and_manifest_inside_the_repository() {
        let names = names();
        // 10 real captures and 12 golden streams (fixtures/README.md).
        assert_eq!(names.len(), 22, "{names:?}");
        assert_eq!(names.iter().filter(|n| n.starts_with("golden-")).count(), 12);
        let captures: Vec<PathBuf> = names.iter().map(|n| capture(n)).collect();
        assert_eq!(captures, super::captures());
        let repo = root().parent().unwrap().canonicalize().unwrap();
        for (n, c) in names.iter().zip(&captures) {
            assert!(c.canonicalize().unwrap().starts_with(&repo), "{} is outside {}", c.display(), repo.display());
            assert!(manifest(n).is_file());
        }
    }

    #[test]
    fn the_mooncake_traces_have_every_request() {
        let lines = |f: &str| std::fs::read_to_string(mooncake(f)).unwrap().lines().count();
        assert_eq!(lines("conversation_trace.jsonl"), 12_031);
        assert_eq!(lines("synthetic_trace.jsonl"), 3_993);
    }

    #[test]
    #[should_panic(expected = "no-such-capture.jsonl not found")]
    fn a_missing_capture_names_its_path() {
        capture("no-such-capture");
    }
}
