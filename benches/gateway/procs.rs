//! Child processes that must not outlive the bench, however it ends.
//!
//! * Long-lived services (upstream, nginx, gateways) run under a small `sh`
//!   watchdog in a process group of their own. The watchdog's stdin is a pipe
//!   from this process: when we close it, or when we die for any reason
//!   (error, Ctrl-C, even SIGKILL), the watchdog sees EOF and sends SIGTERM to
//!   the service. [`Service`]'s `Drop` then kills whatever is left in the group
//!   (nginx workers, a service ignoring SIGTERM).
//! * Short-lived tools (wrk, pgbench, psql, `idemgate migrate`) run through
//!   [`run_tool`]; their pids are registered so that a signal handler can stop
//!   them at once.
//! * SIGINT/SIGTERM/SIGHUP set a flag that the main flow checks between steps
//!   ([`check_interrupted`]), so it unwinds through every `Drop`. If that takes
//!   longer than [`UNWIND_LIMIT`], the process exits and the watchdogs finish.
//! * With `IDEMGATE_BENCH_DIR` set (by `scripts/bench`), the process groups
//!   still alive are listed in `$IDEMGATE_BENCH_DIR/pgids`, so the script's trap
//!   can make sure after the fact.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// `$1` = log file, `$2..` = the service's command line. Prints the service's
/// pid, then waits for EOF (or a line) on stdin and stops the service.
const WATCHDOG: &str = r#"
log=$1; shift
"$@" </dev/null >>"$log" 2>&1 &
pid=$!
echo "$pid"
exec >/dev/null
read -r _ || :
kill -TERM "$pid" 2>/dev/null
wait "$pid"
"#;

/// How long a service gets to exit after SIGTERM before its group is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the main flow gets to unwind after a signal.
const UNWIND_LIMIT: Duration = Duration::from_secs(30);

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
struct Registry {
    /// Pids of running tools (wrk, pgbench, ...).
    tools: BTreeSet<u32>,
    /// Process groups of running services (watchdog pid = group id).
    groups: BTreeSet<u32>,
    /// Where to list `groups` for the script's trap.
    pgid_file: Option<PathBuf>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { tools: BTreeSet::new(), groups: BTreeSet::new(), pgid_file: None });

fn registry() -> MutexGuard<'static, Registry> {
    // A panic while holding the lock leaves plain sets behind: still usable.
    REGISTRY.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Registry {
    fn write_pgids(&self) {
        if let Some(path) = &self.pgid_file {
            let text: String = self.groups.iter().map(|g| format!("{g}\n")).collect();
            let _ = std::fs::write(path, text);
        }
    }
}

/// Lists live process groups in `dir/pgids` from now on.
pub fn publish_groups_in(dir: &Path) {
    let mut reg = registry();
    reg.pgid_file = Some(dir.join("pgids"));
    reg.write_pgids();
}

/// Registers a process group that is not a [`Service`] (the PostgreSQL
/// watchdog of the test harness) for the script's trap.
pub fn register_group(pgid: u32) {
    let mut reg = registry();
    reg.groups.insert(pgid);
    reg.write_pgids();
}

pub fn unregister_group(pgid: u32) {
    let mut reg = registry();
    reg.groups.remove(&pgid);
    reg.write_pgids();
}

/// Whether a stop signal arrived.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Fails once a stop signal arrived, so `?` unwinds through every `Drop`.
pub fn check_interrupted() -> Result<()> {
    if interrupted() {
        bail!("interrupted");
    }
    Ok(())
}

/// Sleeps in small steps, returning early (with an error) on a stop signal.
pub fn sleep(d: Duration) -> Result<()> {
    let until = Instant::now() + d;
    while Instant::now() < until {
        check_interrupted()?;
        thread::sleep((until - Instant::now()).min(Duration::from_millis(50)));
    }
    check_interrupted()
}

/// Installs the SIGINT/SIGTERM/SIGHUP handler (a thread with its own small
/// runtime); returns once the handlers are registered.
pub fn install_signal_handler() -> Result<()> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
    thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let waited = wait_for_signal(&ready_tx);
            if let Err(e) = waited {
                let _ = ready_tx.send(Err(e));
                return;
            }
            INTERRUPTED.store(true, Ordering::SeqCst);
            eprintln!("bench: stop signal received; stopping every process we started");
            stop_tools();
            thread::sleep(UNWIND_LIMIT);
            eprintln!("bench: cleanup took over {UNWIND_LIMIT:?}; exiting (the watchdogs stop the rest)");
            std::process::exit(130);
        })
        .context("spawning the signal thread")?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => bail!("installing signal handlers: {e}"),
        Err(_) => bail!("the signal thread died during start-up"),
    }
}

fn wait_for_signal(ready: &std::sync::mpsc::Sender<Result<(), String>>) -> Result<(), String> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().build().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
        let mut term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
        let mut hup = signal(SignalKind::hangup()).map_err(|e| e.to_string())?;
        let _ = ready.send(Ok(()));
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
            _ = hup.recv() => {}
        }
        Ok(())
    })
}

fn stop_tools() {
    let tools: Vec<u32> = registry().tools.iter().copied().collect();
    for pid in tools {
        send_signal("TERM", &pid.to_string());
    }
}

/// SIGSTOP (`pause`) or SIGCONT one process: a bench target's gateway kept
/// still while another target is measured on the same database cluster.
pub fn pause(pid: u32, pause: bool) {
    send_signal(if pause { "STOP" } else { "CONT" }, &pid.to_string());
}

/// `kill -s SIG -- TARGET` (TARGET may be `-PGID`) with the shell's builtin
/// (no procps needed); errors (already gone) are ignored.
fn send_signal(sig: &str, target: &str) {
    let _ = Command::new("/bin/sh")
        .args(["-c", "kill -s \"$1\" -- \"$2\"", "sh", sig, target])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Runs a short-lived tool to completion, capturing its output; a stop signal
/// terminates it.
pub fn run_tool(cmd: &mut Command) -> Result<Output> {
    check_interrupted()?;
    let program = cmd.get_program().to_string_lossy().into_owned();
    let child =
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().with_context(|| format!("starting {program}"))?;
    let pid = child.id();
    registry().tools.insert(pid);
    let out = child.wait_with_output();
    registry().tools.remove(&pid);
    let out = out.with_context(|| format!("waiting for {program}"))?;
    check_interrupted()?;
    Ok(out)
}

/// [`run_tool`], failing with the tool's stderr unless it exits 0.
pub fn run_tool_ok(cmd: &mut Command) -> Result<Output> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = run_tool(cmd)?;
    if !out.status.success() {
        bail!(
            "{program} failed ({}):\n{}{}",
            out.status,
            tail(&String::from_utf8_lossy(&out.stdout), 20),
            tail(&String::from_utf8_lossy(&out.stderr), 20)
        );
    }
    Ok(out)
}

/// A long-lived child process under a watchdog; stopped on drop.
pub struct Service {
    name: String,
    watchdog: Child,
    /// Closing it (EOF) tells the watchdog to stop the service.
    control: Option<ChildStdin>,
    pid: u32,
    log: PathBuf,
}

impl Service {
    /// Starts `program args...` with its stdout and stderr appended to `log`.
    pub fn spawn(name: &str, log: &Path, program: &Path, args: &[&OsStr], env: &[(&str, String)]) -> Result<Service> {
        check_interrupted()?;
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c").arg(WATCHDOG).arg(format!("bench-{name}-watchdog")).arg(log).arg(program).args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.process_group(0).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
        let mut watchdog = cmd.spawn().with_context(|| format!("starting the watchdog for {name}"))?;
        register_group(watchdog.id());
        let control = watchdog.stdin.take();
        let mut line = String::new();
        if let Some(out) = watchdog.stdout.take() {
            let _ = BufReader::new(out).read_line(&mut line);
        }
        let mut service = Service { name: name.to_owned(), watchdog, control, pid: 0, log: log.to_path_buf() };
        match line.trim().parse() {
            Ok(pid) => service.pid = pid,
            Err(_) => bail!("the watchdog of {name} did not report a pid"),
        }
        Ok(service)
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The process group (the watchdog's pid).
    pub fn group(&self) -> u32 {
        self.watchdog.id()
    }

    /// Whether the service process still runs (not exited, not a zombie).
    pub fn alive(&self) -> bool {
        process_alive(self.pid)
    }

    /// Polls the service's log until `find` matches a line; fails if the
    /// service exits or `timeout` passes, showing the log's tail.
    pub fn wait_for_log<T>(&self, what: &str, timeout: Duration, mut find: impl FnMut(&str) -> Option<T>) -> Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            check_interrupted()?;
            let text = read_lossy(&self.log);
            if let Some(found) = text.lines().find_map(&mut find) {
                return Ok(found);
            }
            if !self.alive() {
                bail!("{} exited before {what}; its log:\n{}", self.name, tail(&text, 30));
            }
            if Instant::now() > deadline {
                bail!("{} did not report {what} within {timeout:?}; its log:\n{}", self.name, tail(&text, 30));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_tail(&self, lines: usize) -> String {
        tail(&read_lossy(&self.log), lines)
    }

    /// Stops the service and waits for it; reports a service that had to be killed.
    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(control) = self.control.take() else { return Ok(()) };
        drop(control); // EOF: the watchdog sends SIGTERM and waits
        let pgid = self.watchdog.id();
        let deadline = Instant::now() + STOP_TIMEOUT;
        let mut result = Ok(());
        loop {
            match self.watchdog.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
                _ => {
                    result = Err(anyhow::anyhow!("{} did not stop within {STOP_TIMEOUT:?} of SIGTERM; killed", self.name));
                    send_signal("KILL", &format!("-{pgid}"));
                    let _ = self.watchdog.wait();
                    break;
                }
            }
        }
        // Anything left in the group (nginx workers whose master died, ...).
        send_signal("KILL", &format!("-{pgid}"));
        unregister_group(pgid);
        result
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("bench: {e:#}");
        }
    }
}

/// Exists and is not a zombie.
pub fn process_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let state = stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next());
    !matches!(state, None | Some("Z" | "X"))
}

pub fn read_lossy(path: &Path) -> String {
    let mut bytes = Vec::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let _ = f.read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
