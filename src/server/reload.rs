//! Reloading the configuration without a restart: `SIGHUP` (which
//! `idemgate reload` sends) re-reads the file and swaps the gateway that
//! serves requests, whole.
//!
//! What a reload changes: identity sources (API keys, trusted headers, JWT
//! keys and settings), routes (with their authorizers, key rules, retention,
//! in-flight policy, replay mode) and upstreams (with new connection pools),
//! applied as at start ([`crate::server::apply`]). A revoked API key or a
//! removed JWT key is refused from the next request on, on open keep-alive
//! connections too: every request asks its worker for the gateway in force
//! ([`crate::server::apply::WorkerGateway::get`]). A request already running
//! finishes with the gateway it started on. The admin API and the console
//! follow too: a hand-made completion gets its reloaded route's retention,
//! and the credential headers of reloaded identity sources are masked.
//!
//! Background work follows the routes in force: the async workers, the lease
//! reaper, the reconciler and the event relay are restarted from the new
//! gateway ([`crate::server::route_tasks`]), so an async route added by a reload is
//! served at once and a route whose `upstream_idempotent` was turned off is
//! never re-forwarded after it. The store writes completion events for the
//! reloaded routes' `[routes.events]`.
//!
//! What needs a restart: `[server]`, `[store]`, `[admin]` and `[workers]`
//! (listeners, pools, the store itself); a reload that changes them applies
//! the rest, keeps those sections as they are and says so in the log.
//!
//! An invalid file is refused with its errors in the log; the configuration
//! in force stays. `idemgate_config_reloads_total{result}` counts both.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::server::apply::Applier;
use crate::telemetry::metrics::Metrics;

/// Reloads from `path` on every SIGHUP until shutdown.
#[derive(Debug)]
pub struct Reloader {
    pub path: PathBuf,
    /// The configuration in force (as applied: restart-only sections kept).
    pub running: Config,
    /// Where each configuration read is applied.
    pub applier: Applier,
    pub metrics: Arc<Metrics>,
}

impl Reloader {
    /// A SIGHUP that arrived after `hangups` was subscribed (during start-up)
    /// is pending and reloads at once: the file may have changed since it was
    /// read.
    pub async fn run(mut self, mut hangups: watch::Receiver<u64>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = hangups.changed() => if changed.is_err() { return },
            }
            self.reload();
        }
    }

    fn reload(&mut self) {
        let file = self.path.display().to_string();
        let mut config = match Config::load(&self.path) {
            Ok(c) => c,
            Err(e) => {
                self.metrics.reloaded(false);
                tracing::error!(file = %file, errors = e.issues.len(), error = %e, "reload refused: the configuration in force stays");
                return;
            }
        };
        config.log_warnings(&file);
        let kept = keep_restart_only(&self.running, &mut config);
        if !kept.is_empty() {
            tracing::warn!(file = %file, sections = ?kept, "these sections changed and need a restart; kept as they are");
        }
        self.applier.apply(&config);
        if has_background_routes(&self.running) || has_background_routes(&config) {
            tracing::info!("async workers, the lease reaper, the reconciler and the event relay restarted with the new routes");
        }
        self.metrics.reloaded(true);
        tracing::info!(
            file = %file,
            routes = config.routes.len(),
            upstreams = config.upstreams.len(),
            identity_sources = config.identity.len(),
            "configuration reloaded"
        );
        self.running = config;
    }
}

/// Puts back the sections a reload cannot apply; returns the names of those
/// that differed.
fn keep_restart_only(running: &Config, new: &mut Config) -> Vec<&'static str> {
    let mut kept = Vec::new();
    // `default_upstream` names an upstream of the new list: it reloads.
    let server = crate::config::ServerConfig { default_upstream: new.server.default_upstream, ..running.server.clone() };
    if new.server != server {
        kept.push("server");
        new.server = server;
    }
    if new.store != running.store {
        kept.push("store");
        new.store = running.store.clone();
    }
    if new.admin != running.admin {
        kept.push("admin");
        new.admin = running.admin.clone();
    }
    if new.workers != running.workers {
        kept.push("workers");
        new.workers = running.workers.clone();
    }
    kept
}

fn has_background_routes(config: &Config) -> bool {
    config.routes.iter().any(|r| r.may_run_async() || r.background.reconcile.is_some() || r.background.events.is_some())
}

/// `idemgate reload`: sends SIGHUP to the gateway whose pid is in `pid_file`
/// (written by `serve --pid-file`). A symbolic link is not followed.
pub fn signal_reload(pid_file: &Path) -> Result<u32, ReloadError> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut text = String::new();
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(pid_file)
        .and_then(|mut f| f.read_to_string(&mut text))
        .map_err(|source| ReloadError::PidFile { path: pid_file.to_owned(), source })?;
    let bad = || ReloadError::BadPid { path: pid_file.to_owned(), text: text.trim().to_owned() };
    // Only a single positive pid: 0 or a negative number would signal a group.
    let pid: i32 = text.trim().parse().ok().filter(|p| *p > 0).ok_or_else(bad)?;
    let target = rustix::process::Pid::from_raw(pid).ok_or_else(bad)?;
    // A pid file left by a gateway that was killed (SIGKILL, out of memory)
    // names whatever process has that pid now: signalled, most die.
    if let Some(name) = process_name(pid).filter(|name| !is_this_program(name)) {
        return Err(ReloadError::NotIdemgate { path: pid_file.to_owned(), pid, name });
    }
    rustix::process::kill_process(target, rustix::process::Signal::HUP).map_err(|e| ReloadError::Signal { pid, source: e.into() })?;
    Ok(pid as u32)
}

/// The name the kernel knows process `pid` by (`/proc/<pid>/comm`, the
/// executable's name cut to 15 bytes); `None` where there is no `/proc`.
/// A process that is gone is named by no one: `""`.
fn process_name(pid: i32) -> Option<String> {
    if !Path::new("/proc/self/comm").exists() {
        return None;
    }
    Some(std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|n| n.trim_end().to_owned()).unwrap_or_default())
}

/// Whether a process named `name` runs this program (under its file name).
fn is_this_program(name: &str) -> bool {
    let ours = process_name(std::process::id().cast_signed()).unwrap_or_default();
    !name.is_empty() && name == ours
}

/// Writes this process's pid for `idemgate reload`; removed on drop.
///
/// The file is created anew (`O_CREAT | O_EXCL | O_NOFOLLOW`), so a symbolic
/// link planted at the path is never followed (a privileged gateway would
/// otherwise overwrite whatever it points to). A file already there is
/// replaced only when it is a regular file of this user whose process is
/// gone (a stale file after a crash); a symbolic link, another user's file,
/// or the file of a process still running is refused.
#[derive(Debug)]
pub struct PidFile {
    path: PathBuf,
    /// The file written (device, inode): only that one is removed on drop.
    id: (u64, u64),
}

impl PidFile {
    pub fn create(path: &Path) -> Result<PidFile, ReloadError> {
        let io = |source| ReloadError::PidFile { path: path.to_owned(), source };
        let file = match create_new(path) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                stale(path)?;
                // Unlinking never follows a link: if the file was swapped
                // for one meanwhile, the link goes and the create below
                // still refuses to follow anything.
                std::fs::remove_file(path).map_err(io)?;
                create_new(path).map_err(io)?
            }
            other => other.map_err(io)?,
        };
        use std::io::Write as _;
        use std::os::unix::fs::MetadataExt as _;
        (&file).write_all(format!("{}\n", std::process::id()).as_bytes()).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        Ok(PidFile { path: path.to_owned(), id: (meta.dev(), meta.ino()) })
    }
}

fn create_new(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new().write(true).create_new(true).mode(0o644).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// An existing pid file may be replaced only if it is a stale one of ours.
fn stale(path: &Path) -> Result<(), ReloadError> {
    use std::os::unix::fs::MetadataExt as _;
    let refuse = |why: String| ReloadError::UnsafePidFile { path: path.to_owned(), why };
    let meta = std::fs::symlink_metadata(path).map_err(|source| ReloadError::PidFile { path: path.to_owned(), source })?;
    if meta.file_type().is_symlink() {
        return Err(refuse("is a symbolic link; it is not followed (remove it, or give another path)".into()));
    }
    if !meta.file_type().is_file() {
        return Err(refuse("exists and is not a regular file".into()));
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return Err(refuse(format!("is owned by uid {}, not by this user (uid {me}); remove it, or give another path", meta.uid())));
    }
    // Not through a link swapped in meanwhile, and without blocking on a FIFO.
    let mut text = String::new();
    {
        use std::io::Read as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let opened = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path);
        let _ = opened.and_then(|f| f.take(64).read_to_string(&mut text));
    }
    if let Some(pid) = text.trim().parse::<i32>().ok().and_then(rustix::process::Pid::from_raw)
        && pid.as_raw_nonzero().get() != std::process::id() as i32
        && rustix::process::test_kill_process(pid).map_or_else(|e| e == rustix::io::Errno::PERM, |()| true)
    {
        return Err(refuse(format!("names process {}, which is running: is another gateway using this pid file?", pid.as_raw_nonzero())));
    }
    Ok(())
}

impl Drop for PidFile {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt as _;
        // Only the file this process wrote: not one that replaced it.
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("pid file {}: {source}", path.display())]
    PidFile { path: PathBuf, source: std::io::Error },
    #[error("pid file {}: {why}", path.display())]
    UnsafePidFile { path: PathBuf, why: String },
    #[error("pid file {}: {text:?} is not a process id", path.display())]
    BadPid { path: PathBuf, text: String },
    #[error("cannot send SIGHUP to process {pid}: {source}")]
    Signal { pid: i32, source: std::io::Error },
    #[error(
        "pid file {}: process {pid} is {}, not this program: the file is stale (the gateway is not running, or was killed); nothing was signalled",
        path.display(),
        if name.is_empty() { "gone".to_owned() } else { format!("{name:?}") }
    )]
    NotIdemgate { path: PathBuf, pid: i32, name: String },
}
