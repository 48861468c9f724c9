//! The load generator: `wrk` with the Lua scenarios in `benches/gateway/wrk/`,
//! each ending in a `done()` that prints one parseable result line.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::procs;
use crate::report::LoadResult;

const DONE: &str = include_str!("wrk/done.lua");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    Get,
    FirstWrite,
    Replay,
    Mix,
}

impl Scenario {
    fn source(self) -> &'static str {
        match self {
            Scenario::Get => include_str!("wrk/get.lua"),
            Scenario::FirstWrite => include_str!("wrk/first_write.lua"),
            Scenario::Replay => include_str!("wrk/replay.lua"),
            Scenario::Mix => include_str!("wrk/mix.lua"),
        }
    }

    fn file_name(self) -> &'static str {
        match self {
            Scenario::Get => "get.lua",
            Scenario::FirstWrite => "first_write.lua",
            Scenario::Replay => "replay.lua",
            Scenario::Mix => "mix.lua",
        }
    }
}

/// Where the scenario scripts were written, and the wrk binary.
pub struct Wrk {
    binary: PathBuf,
    dir: PathBuf,
    threads: u32,
}

/// One wrk run.
pub struct Load<'a> {
    pub scenario: Scenario,
    pub url: String,
    pub conns: u32,
    pub secs: u32,
    pub env: &'a [(&'a str, String)],
}

impl Wrk {
    /// Writes every scenario (with the shared `done()`) into `dir/wrk`.
    pub fn new(binary: PathBuf, dir: &Path, threads: u32) -> Result<Wrk> {
        let dir = dir.join("wrk");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for s in [Scenario::Get, Scenario::FirstWrite, Scenario::Replay, Scenario::Mix] {
            let path = dir.join(s.file_name());
            std::fs::write(&path, format!("{}\n{DONE}", s.source())).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(Wrk { binary, dir, threads })
    }

    pub fn run(&self, load: &Load) -> Result<LoadResult> {
        let threads = self.threads.min(load.conns).max(1);
        let mut cmd = Command::new(&self.binary);
        cmd.arg("-t")
            .arg(threads.to_string())
            .arg("-c")
            .arg(load.conns.to_string())
            .arg("-d")
            .arg(format!("{}s", load.secs))
            .args(["--timeout", "10s"])
            .arg("-s")
            .arg(self.dir.join(load.scenario.file_name()))
            .arg(&load.url);
        for (k, v) in load.env {
            cmd.env(k, v);
        }
        let out = procs::run_tool_ok(&mut cmd)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        parse(&stdout).with_context(|| format!("wrk {:?} on {} printed no result line:\n{stdout}", load.scenario, load.url))
    }
}

/// The `IDEMGATE_BENCH key=value ...` line printed by `done()`.
fn parse(stdout: &str) -> Result<LoadResult> {
    let Some(line) = stdout.lines().find_map(|l| l.strip_prefix("IDEMGATE_BENCH ")) else { bail!("no IDEMGATE_BENCH line") };
    let field = |name: &str| -> Result<f64> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .with_context(|| format!("no {name} in {line:?}"))?
            .parse()
            .with_context(|| format!("{name} is not a number in {line:?}"))
    };
    let requests = field("requests")?;
    let secs = field("duration_us")? / 1e6;
    let socket_errors = field("connect")? + field("read")? + field("write")? + field("timeout")?;
    Ok(LoadResult {
        requests: requests as u64,
        rps: if secs > 0.0 { requests / secs } else { 0.0 },
        p50_us: field("p50_us")?,
        p99_us: field("p99_us")?,
        status_errors: field("status_errors")? as u64,
        socket_errors: socket_errors as u64,
    })
}
