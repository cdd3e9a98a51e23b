//! `xtask`: what the packaging needs besides `cargo build`. One command so far:
//!
//! ```text
//! cargo run -p xtask -- dist-assets [--out DIR]
//! ```
//!
//! writes the man pages (`clap_mangen`) and shell completions (`clap_complete`) of `kv-relay`,
//! `relayctl` and `kv-router` from their clap definitions, so they cannot drift from the
//! binaries' flags. `DIR` defaults to `dist/` in the workspace, which is where the packages'
//! `[package.metadata.deb]` assets read them (`scripts/package.sh` runs this first). Not under
//! `target/`: cargo-deb takes asset paths with `target/` in them for build outputs.
//!
//! Layout of `DIR` (its `man/` and `completions/` are replaced whole on every run):
//!
//! ```text
//! man/<command>.1, man/<command>-<subcommand>.1
//! completions/bash/<command>   completions/zsh/_<command>   completions/fish/<command>.fish
//! ```

use anyhow::{bail, Context as _};
use clap::{CommandFactory as _, Parser};
use clap_complete::Shell;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "xtask", about = "Packaging helpers for kv-relay")]
enum Task {
    /// Writes the man pages and shell completions of kv-relay, relayctl and kv-router.
    DistAssets {
        /// Where to write them (default: dist/ in the workspace).
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
    },
}

/// The commands the packages ship, by the name they are installed under.
fn commands() -> Vec<clap::Command> {
    vec![kv_relay::config::Args::command(), kv_relay::ctl::cli::Cli::command(), kv_router::cli::Args::command()]
}

/// The completion file of `name` for `shell`, relative to `completions/`, named as each shell
/// looks it up (bash-completion by the command's name, zsh by `_name`, fish by `name.fish`).
fn completion_path(shell: Shell, name: &str) -> PathBuf {
    match shell {
        Shell::Bash => PathBuf::from(format!("bash/{name}")),
        Shell::Zsh => PathBuf::from(format!("zsh/_{name}")),
        Shell::Fish => PathBuf::from(format!("fish/{name}.fish")),
        other => PathBuf::from(format!("{other}/{name}")),
    }
}

const SHELLS: [Shell; 3] = [Shell::Bash, Shell::Zsh, Shell::Fish];

/// Writes every man page and completion into `out`; returns the files written, relative to
/// `out`, sorted.
fn dist_assets(out: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let man = out.join("man");
    let completions = out.join("completions");
    for dir in [&man, &completions] {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", dir.display())),
        }
    }
    std::fs::create_dir_all(&man).with_context(|| format!("creating {}", man.display()))?;
    for mut cmd in commands() {
        let name = cmd.get_name().to_string();
        clap_mangen::generate_to(cmd.clone(), &man).with_context(|| format!("man pages of {name}"))?;
        for shell in SHELLS {
            let path = completions.join(completion_path(shell, &name));
            let dir = path.parent().expect("a completion path has a parent");
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let mut text = Vec::new();
            clap_complete::generate(shell, &mut cmd, name.clone(), &mut text);
            if text.is_empty() {
                bail!("clap_complete wrote no {shell} completion for {name}");
            }
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    let mut written = Vec::new();
    for top in [&man, &completions] {
        walk(top, &mut written)?;
    }
    let mut written: Vec<PathBuf> =
        written.into_iter().map(|p| p.strip_prefix(out).expect("under out").to_path_buf()).collect();
    written.sort();
    Ok(written)
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            walk(&path, files)?;
        } else {
            files.push(path);
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let Task::DistAssets { out } = Task::parse();
    let out = out.unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist"));
    match dist_assets(&out) {
        Ok(files) => {
            println!("xtask: wrote {} files under {}", files.len(), out.display());
            for f in files {
                println!("  {}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dist_assets_writes_one_page_per_command_and_subcommand_and_three_completions_each() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("assets");
        let files = dist_assets(&dir).unwrap();
        let names: Vec<String> = files.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        assert_eq!(
            names,
            [
                "completions/bash/kv-relay",
                "completions/bash/kv-router",
                "completions/bash/relayctl",
                "completions/fish/kv-relay.fish",
                "completions/fish/kv-router.fish",
                "completions/fish/relayctl.fish",
                "completions/zsh/_kv-relay",
                "completions/zsh/_kv-router",
                "completions/zsh/_relayctl",
                "man/kv-relay-check-config.1",
                "man/kv-relay.1",
                "man/kv-router.1",
                "man/relayctl-decode.1",
                "man/relayctl-history.1",
                "man/relayctl-snapshot.1",
                "man/relayctl-status.1",
                "man/relayctl.1",
            ]
        );
        // The pages are the clap definitions': every flag, with its environment variable.
        let page = std::fs::read_to_string(dir.join("man/kv-relay.1")).unwrap();
        assert!(page.starts_with(".ie \\n(.g .ds Aq \\(aq\n"), "not a roff page: {:?}", &page[..40]);
        assert!(page.contains(".TH kv-relay 1  \"kv-relay 0.1.0\""), "{page}");
        for flag in ["\\-\\-config", "KV_RELAY_CONFIG", "\\-\\-hash\\-sample", "check\\-config"] {
            assert!(page.contains(flag), "kv-relay.1 lacks {flag}");
        }
        let status = std::fs::read_to_string(dir.join("man/relayctl-status.1")).unwrap();
        assert!(status.contains("\\-\\-json"), "{status}");
        let bash = std::fs::read_to_string(dir.join("completions/bash/relayctl")).unwrap();
        assert!(bash.contains("complete -F _relayctl -o nosort -o bashdefault -o default relayctl"), "{bash}");
        for sub in ["status", "history", "snapshot", "decode"] {
            assert!(bash.contains(sub), "bash completion lacks {sub}");
        }
        // A second run replaces the directories whole: a page left from an older CLI goes.
        std::fs::write(dir.join("man/relayctl-gone.1"), "old").unwrap();
        assert_eq!(dist_assets(&dir).unwrap(), files);
    }
}
